from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvfabric.cacheserver.config import ServerConfig, apply_overrides

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)

BASE: dict[str, Any] = {
    "listen": {"unix_socket": "/run/kvfabric/cache.sock"},
    "shm": {"arena_bytes": 64 << 20},
    "tiers": {
        "dram": {"capacity_bytes": 1 << 30},
        "local_disk": {"path": "/mnt/nvme/kv", "capacity_bytes": 10 << 30},
        "shared": {"path": "/mnt/shared/kv", "capacity_bytes": 100 << 30},
    },
}


def test_yaml_round_trip_is_exactly_what_the_operator_renders(tmp_path: Path) -> None:
    cfg = ServerConfig.model_validate(BASE)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    again = ServerConfig.from_yaml(path)
    assert again == cfg
    assert again.listen.tcp_port == 7070
    assert again.metrics.port == 9090
    assert again.ttl_seconds == 86400
    assert again.bucket_seconds == 3600


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="extra"):
        ServerConfig.model_validate(
            {**BASE, "tiers": {**BASE["tiers"], "dram": {"capacity_bytes": 1, "sizee": 2}}}
        )


def test_watermark_order_is_validated_with_a_readable_message() -> None:
    bad = apply_overrides(BASE, {"tiers.local_disk.low_watermark": 0.95})
    with pytest.raises(ValidationError, match=r"low_watermark \(0.95\) must be below high_watermark \(0.9\)"):
        ServerConfig.model_validate(bad)


def test_overlapping_tier_paths_are_rejected() -> None:
    bad = apply_overrides(BASE, {"tiers.shared.path": "/mnt/nvme/kv/shared"})
    with pytest.raises(ValidationError, match="must not overlap"):
        ServerConfig.model_validate(bad)


def test_server_id_defaults_to_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    assert ServerConfig.model_validate(BASE).resolved_server_id() == "gpu-node-7"
    with pytest.raises(ValidationError):
        ServerConfig.model_validate({**BASE, "server_id": "../evil"})


def test_cli_help_documents_every_option_and_overrides_apply(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli.main", "cacheserver", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--config",
        "--tcp-port",
        "--arena-bytes",
        "--dram-bytes",
        "--set",
        "--print-config",
        "--help-config",
    ):
        assert flag in out
    described = subprocess.run(
        [sys.executable, "-m", "kvfabric.cacheserver", "--help-config"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for field in (
        "listen.unix_socket",
        "tiers.local_disk.high_watermark",
        "limits.max_payload_bytes",
        "ttl_seconds",
    ):
        assert field in described, field
    printed = subprocess.run(
        [
            sys.executable, "-m", "kvfabric.cli.main", "cacheserver", "--config", str(path),
            "--tcp-port", "7171", "--set", "limits.max_concurrent_loads=3", "--print-config",
        ],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cfg = ServerConfig.model_validate(yaml.safe_load(printed))
    assert cfg.listen.tcp_port == 7171
    assert cfg.limits.max_concurrent_loads == 3


def test_cli_reports_invalid_config_clearly(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(apply_overrides(BASE, {"tiers.dram.capacity_bytes": -1})))
    res = subprocess.run(
        [sys.executable, "-m", "kvfabric.cacheserver", "--config", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 2
    assert "tiers.dram.capacity_bytes" in res.stderr
