"""Structured JSON logs on stderr (one object per line, fields from ``extra=``)."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

__all__ = ["setup_logging"]


def setup_logging(level: str, *, server_id: str | None = None) -> None:
    """Route every logger to one JSON handler on stderr at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    static = {"server_id": server_id} if server_id else None
    handler.setFormatter(
        JsonFormatter(
            "{asctime}{levelname}{name}{message}",
            style="{",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            static_fields=static,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
