"""Connector settings: environment the operator injects, settings file, extra-config overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvfabric.connector.settings import ConnectorSettings


def test_reads_injected_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFABRIC_SOCKET", "unix:///run/kvfabric/cache.sock")
    monkeypatch.setenv("KVFABRIC_SHARED_MEMORY", "false")
    monkeypatch.setenv("KVFABRIC_REMOTE", "cache.kvfabric.svc:7070")
    monkeypatch.setenv("KVFABRIC_CHUNK_TOKENS", "512")
    monkeypatch.setenv("KVFABRIC_TENANT", "acme")
    monkeypatch.setenv("KVFABRIC_LOOKUP_DEADLINE_MS", "20")
    monkeypatch.setenv("KVFABRIC_LOAD_DEADLINE_MS", "300")
    monkeypatch.setenv("KVFABRIC_STORE_DEADLINE_MS", "900")
    monkeypatch.setenv("KVFABRIC_MIN_HIT_TOKENS", "1024")
    monkeypatch.setenv("KVFABRIC_POOL", "pool-a")
    monkeypatch.setenv("KVFABRIC_CONFIG_HASH", "abc")
    s = ConnectorSettings.load()
    assert s.socket == "/run/kvfabric/cache.sock"
    assert s.shared_memory is False
    assert s.remote == "cache.kvfabric.svc:7070"
    assert (s.chunk_tokens, s.tenant, s.min_hit_tokens) == (512, "acme", 1024)
    assert (s.lookup_deadline_ms, s.load_deadline_ms, s.store_deadline_ms) == (20, 300, 900)
    assert (s.pool, s.config_hash) == ("pool-a", "abc")
    assert s.configured


def test_priority_overrides_env_file_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text("KVFABRIC_CHUNK_TOKENS: 128\ntenant: from-file\nlookup_deadline_ms: 7\n")
    monkeypatch.setenv("KVFABRIC_SETTINGS_FILE", str(f))
    monkeypatch.setenv("KVFABRIC_TENANT", "from-env")
    s = ConnectorSettings.load({"lookup_deadline_ms": 9, "unrelated": True})
    assert s.chunk_tokens == 128  # file beats default
    assert s.tenant == "from-env"  # env beats file
    assert s.lookup_deadline_ms == 9  # extra config beats everything
    assert not s.configured


def test_json_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"socket": "/tmp/s.sock", "min_hit_tokens": 64}))
    monkeypatch.setenv("KVFABRIC_SETTINGS_FILE", str(f))
    s = ConnectorSettings.load()
    assert (s.socket, s.min_hit_tokens) == ("/tmp/s.sock", 64)


@pytest.mark.parametrize(
    "bad",
    [{"socket": "relative.sock"}, {"remote": "no-port"}, {"chunk_tokens": 0}, {"load_deadline_ms": -1}],
)
def test_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ConnectorSettings.load(bad)


def test_the_reply_floor_reaches_the_same_node_client_and_bad_values_name_the_field(tmp_path: Path) -> None:
    from kvfabric.client import CacheClient
    from kvfabric.connector.resilient import _new_cache

    cache = _new_cache(ConnectorSettings(socket=str(tmp_path / "c.sock"), reply_floor_ms=20), None)
    try:
        client = cache.endpoints[0].client()  # no call: the channel and the index connect lazily
        assert isinstance(client, CacheClient)
        assert client._clock is not None
        assert client._clock.bound() == pytest.approx(0.02)
    finally:
        cache.close()
    for bad in (0, -1, 501):
        with pytest.raises(ValidationError, match="reply_floor_ms"):
            ConnectorSettings(reply_floor_ms=bad)
