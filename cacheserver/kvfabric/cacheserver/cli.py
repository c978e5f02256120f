"""``kvfabric cacheserver``: run the per-node cache server from a YAML config plus overrides.

Imports only the standard library at import time (``kvfabric --help`` must work in every image);
pydantic, grpc and the engine are imported inside :func:`run`.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["configure", "run"]

# option dest -> dotted config path. Each becomes one --flag documented below.
_OVERRIDES: dict[str, tuple[str, str, type]] = {
    "server_id": (
        "server_id",
        "name of this server on the shared volume (default $NODE_NAME, hostname)",
        str,
    ),
    "unix_socket": ("listen.unix_socket", "Unix socket path for same-node engines", str),
    "tcp_host": ("listen.tcp_host", "TCP bind address for peers and tools", str),
    "tcp_port": ("listen.tcp_port", "TCP port (0 = any free port)", int),
    "arena_bytes": ("shm.arena_bytes", "byte budget of store staging slots", int),
    "metrics_port": ("metrics.port", "port of GET /metrics, /healthz, /readyz", int),
    "dram_bytes": ("tiers.dram.capacity_bytes", "DRAM tier budget in bytes", int),
    "local_disk_path": ("tiers.local_disk.path", "local-disk tier directory", str),
    "local_disk_bytes": ("tiers.local_disk.capacity_bytes", "local-disk tier budget in bytes", int),
    "shared_path": ("tiers.shared.path", "shared-volume tier directory", str),
    "shared_bytes": ("tiers.shared.capacity_bytes", "shared-volume tier budget in bytes", int),
    "ttl_seconds": ("ttl_seconds", "blocks not hit for about this long expire", int),
    "bucket_seconds": ("bucket_seconds", "width of one TTL bucket in seconds", int),
    "log_level": ("log_level", "DEBUG, INFO, WARNING or ERROR", str),
}


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the cacheserver options to ``parser``."""
    parser.description = (
        "Run the per-node KV-chunk cache server. Settings come from --config (the YAML the operator "
        "renders, schema kvfabric.cacheserver.config.ServerConfig); the options below override single "
        "fields, and --set overrides any field by its dotted path."
    )
    parser.add_argument(
        "--config", metavar="FILE", help="YAML configuration file (e.g. /etc/kvfabric/config.yaml)"
    )
    for dest, (path, help_text, typ) in _OVERRIDES.items():
        parser.add_argument(
            "--" + dest.replace("_", "-"), dest=dest, type=typ, metavar=typ.__name__.upper(),
            help=f"{help_text} (overrides {path})",
        )  # fmt: skip
    parser.add_argument(
        "--set",
        dest="set_values",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override any config field, VALUE parsed as YAML (e.g. --set limits.max_concurrent_loads=128); "
        "repeatable",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective configuration as YAML and exit"
    )
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="describe every configuration field (type, default, meaning) and exit",
    )


def _collect(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    import yaml

    data: dict[str, Any] = {}
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"{args.config}: expected a YAML mapping")
        data = loaded
    overrides: dict[str, Any] = {}
    for dest, (path, _, _) in _OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[path] = value
    for item in args.set_values:
        path, sep, raw = item.partition("=")
        if not sep or not path:
            raise SystemExit(f"--set expects PATH=VALUE, got {item!r}")
        overrides[path] = yaml.safe_load(raw)
    return data, overrides


def _describe(model: Any, prefix: str = "") -> list[str]:
    """One line per leaf field of a pydantic model class: dotted path, type, default, description."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    lines = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        nested = [
            a for a in getattr(field.annotation, "__args__", (field.annotation,)) if isinstance(a, type)
        ]
        sub = next((a for a in nested if issubclass(a, BaseModel)), None)
        default = (
            "required"
            if field.default is PydanticUndefined and field.default_factory is None
            else (
                "default: see below" if field.default_factory is not None else f"default: {field.default!r}"
            )
        )
        type_name = getattr(field.annotation, "__name__", None) or str(field.annotation).replace(
            "typing.", ""
        )
        lines.append(f"{path}  ({type_name}; {default})\n    {field.description or ''}")
        if sub is not None:
            lines.extend(_describe(sub, path + "."))
    return lines


def run(args: argparse.Namespace) -> int:
    """Validate the configuration and serve until SIGTERM/SIGINT."""
    import asyncio
    import sys

    from pydantic import ValidationError

    from kvfabric.cacheserver.config import ServerConfig, apply_overrides

    if args.help_config:
        print("\n".join(_describe(ServerConfig)))
        return 0

    data, overrides = _collect(args)
    try:
        config = ServerConfig.model_validate(apply_overrides(data, overrides))
    except ValidationError as exc:
        print(f"invalid cache-server configuration:\n{exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0

    from kvfabric.cacheserver.logs import setup_logging
    from kvfabric.cacheserver.server import serve

    setup_logging(config.log_level, server_id=config.resolved_server_id())
    asyncio.run(serve(config, install_signal_handlers=True))
    return 0
