"""Background work that runs every few seconds until the owner stops it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["start_periodic"]


def start_periodic(
    name: str, fn: Callable[[], None], every: float, stop: threading.Event, log: logging.Logger
) -> threading.Thread:
    """Start a daemon thread calling ``fn`` every ``every`` seconds until ``stop`` is set.

    A failing call is logged to ``log`` (the owner's logger) and the next one still runs: one bad
    janitor pass must not end expiry for the life of the server.
    """

    def loop() -> None:
        while not stop.wait(every):
            try:
                fn()
            except Exception:
                log.exception("background task failed", extra={"task": name})

    th = threading.Thread(target=loop, name=name, daemon=True)
    th.start()
    return th
