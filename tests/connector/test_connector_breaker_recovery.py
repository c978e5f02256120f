"""The breaker closes again once a killed cache server is back: real client, real server, kill -9.

The in-memory transport of ``test_connector_resilient.py`` has no published index, so it could not
show this: the real client always offers ``lookup_local``, and a lookup that took the breaker's
half-open probe there (and then, with no index to answer, asked over RPC) found its own probe taken;
the breaker stayed half-open "probing" for good and every later lookup failed fast. Hits never
came back after a cache-server restart (the recovery tests of real vLLM and of the whole fabric).
"""

from __future__ import annotations

import time

import pytest

from kvfabric.connector.resilient import Reason, build_cache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.testing.serverproc import cache_server

NS = "a" * 64
KEYS = [f"{i:064x}" for i in range(1, 5)]
COOLDOWN_MS = 200


@pytest.mark.process
@pytest.mark.parametrize("local_index", [False, True], ids=["rpc-lookups", "published-index"])
def test_lookups_reach_a_restarted_server_after_the_cooldown(local_index: bool) -> None:
    with cache_server(dram_bytes=16 << 20) as srv:
        settings = ConnectorSettings(
            socket=str(srv.config.listen.unix_socket),
            shared_memory=True,
            local_index=local_index,
            breaker_failures=1,
            breaker_cooldown_ms=COOLDOWN_MS,
        )
        cache = build_cache(settings, shared=False)
        assert cache is not None
        try:
            assert cache.store(NS, KEYS, [bytes([i]) * 512 for i in range(len(KEYS))], 5.0) is not None
            assert cache.lookup(NS, KEYS, 5.0).reason is None
            srv.kill()
            # Dead: the first lookup fails and opens the breaker; the next ones fail fast.
            deadline = time.monotonic() + 10
            while cache.lookup(NS, KEYS, 0.5).reason is not Reason.UNAVAILABLE:
                assert time.monotonic() < deadline, "lookups kept succeeding on a killed server"
            assert cache.endpoints[0].breaker.state != "closed"
            srv.start()
            # Back: after the cooldown one probe reaches it and closes the breaker, so lookups are
            # answered again (a hit from its disk, or a miss: not "unavailable").
            reasons = []
            deadline = time.monotonic() + 10 * COOLDOWN_MS / 1000 + 5
            while time.monotonic() < deadline:
                reasons.append(cache.lookup(NS, KEYS, 1.0).reason)
                if reasons[-1] not in (Reason.UNAVAILABLE, Reason.TIMEOUT):
                    break
                time.sleep(COOLDOWN_MS / 4000)
            assert reasons[-1] not in (Reason.UNAVAILABLE, Reason.TIMEOUT), reasons[-5:]
            assert cache.endpoints[0].breaker.state == "closed"
        finally:
            cache.close()
