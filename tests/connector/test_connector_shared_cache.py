"""One resilience state per process: the halves share connections, breakers and counters."""

from __future__ import annotations

from pathlib import Path

from kvfabric.client import _common
from kvfabric.connector.resilient import build_cache
from kvfabric.connector.settings import ConnectorSettings


def test_different_servers_get_different_caches(tmp_path: Path) -> None:
    a = build_cache(ConnectorSettings(socket=str(tmp_path / "a.sock")))
    b = build_cache(ConnectorSettings(socket=str(tmp_path / "b.sock")))
    private = build_cache(ConnectorSettings(socket=str(tmp_path / "a.sock")), shared=False)
    assert a is not None
    assert b is not None
    assert private is not None
    assert len({id(a), id(b), id(private)}) == 3
    for c in (a, b, private):
        c.close()


def test_channels_reconnect_within_a_second() -> None:
    """gRPC's default reconnect backoff grows to 120 s; after a server restart that kept hits away
    for minutes (issue 11). Every client channel caps it at one second."""
    opts = dict(_common.CHANNEL_OPTIONS)
    assert opts["grpc.max_reconnect_backoff_ms"] <= 1000
    assert opts["grpc.initial_reconnect_backoff_ms"] <= opts["grpc.max_reconnect_backoff_ms"]


def test_channels_never_go_idle() -> None:
    """gRPC drops an idle channel's connection after 30 minutes by default; the next call connects
    as a newcomer, which a server whose listener is full refuses. An engine on the block socket and
    the published index makes few calls: its channel keeps its connection."""
    opts = dict(_common.CHANNEL_OPTIONS)
    assert opts["grpc.client_idle_timeout_ms"] == 2**31 - 1  # gRPC's largest: about 25 days
