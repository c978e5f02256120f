"""A load waiting on a hung server fails as soon as the server's published heartbeat stops.

Without the watch such a load waits for its own deadline (for the connector, up to the prefill it
was meant to save: seconds on a slow engine); with it, the server's heartbeat going stale (0.5 s)
cancels the call, and the load fails as ``CacheUnavailable``, not ``CacheTimeout``: the connector
recomputes and its breaker opens, as for a dead server.
"""

from __future__ import annotations

import signal

import pytest

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheTimeout, CacheUnavailable
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for

pytestmark = pytest.mark.process

NS = digest("hangwatch")


@pytest.mark.parametrize("local_index", [True, False])
def test_a_load_waiting_on_a_hung_server_fails_when_its_heartbeat_stops(local_index: bool) -> None:
    keys = [digest("hw", i) for i in range(2)]
    payloads = [payload_for(k, MiB) for k in keys]
    with (
        cache_server(dram_bytes=64 * MiB) as srv,
        CacheClient(srv.unix_target, shared_memory=True, local_index=local_index) as c,
    ):
        assert c.store(NS, keys, payloads, timeout=30).accepted == 2
        assert c.lookup(NS, keys, timeout=10).matched == 2  # maps the namespace's published table
        bufs = [memoryview(bytearray(MiB)) for _ in keys]
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            # The watched load's deadline is far beyond the heartbeat's staleness bound: only the
            # watch can end it as "unavailable". Unwatched (no published index), only the deadline.
            if local_index:
                with pytest.raises(CacheUnavailable, match="stopped beating"):
                    c.load_into(NS, keys, bufs, timeout=60)
            else:
                with pytest.raises(CacheTimeout):
                    c.load_into(NS, keys, bufs, timeout=2)
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        # Back: loads work again.
        assert c.load_into(NS, keys, bufs, timeout=30) == 2
        assert [bytes(b) for b in bufs] == payloads
