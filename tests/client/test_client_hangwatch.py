"""A load waiting on a hung server fails as soon as the server's published heartbeat stops.

Without the watch such a load waits for its own deadline (for the connector, up to the prefill it
was meant to save: seconds on a slow engine); with it, the server's heartbeat going stale (0.5 s)
cancels the call, and the load fails as ``CacheUnavailable``, not ``CacheTimeout``: the connector
recomputes and its breaker opens, as for a dead server.
"""

from __future__ import annotations

import signal
import threading

import pytest

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheTimeout, CacheUnavailable
from kvfabric.client.hangwatch import HangWatch
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for, wait_until

pytestmark = pytest.mark.process

NS = digest("hangwatch")


@pytest.mark.parametrize("local_index", [True, False])
def test_a_load_waiting_on_a_hung_server_fails_when_its_heartbeat_stops(local_index: bool) -> None:
    keys = [digest("hw", i) for i in range(2)]
    payloads = [payload_for(k, MiB) for k in keys]
    with (
        cache_server(dram_bytes=64 * MiB) as srv,
        # A reply bound beyond the staleness bound: the heartbeat decides (the reply bound, which
        # gives up in milliseconds, is test_client_suspect_server's).
        CacheClient(srv.unix_target, shared_memory=True, local_index=local_index, reply_floor_s=30) as c,
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
        # Back once it beats again (until then a load started on the stale heartbeat fails at
        # once, as it should): loads work again.
        if local_index:
            index = c.local_index
            assert index is not None
            wait_until(lambda: index.alive(NS) is True, 30, 0.02, "the resumed server's heartbeat")
        assert c.load_into(NS, keys, bufs, timeout=30) == 2
        assert [bytes(b) for b in bufs] == payloads


class _FlakyIndex:
    """alive(): raises on its first check, then says the server stopped beating."""

    def __init__(self) -> None:
        self.checks = 0

    def alive(self, namespace: str) -> bool | None:
        self.checks += 1
        if self.checks == 1:
            raise RuntimeError("concurrent poll() invocation")
        return False


class _Call:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def test_the_watch_outlives_a_check_that_raises() -> None:
    # One failed check must not end the watch thread for the life of the process (a load waiting
    # on a hung server would then wait its whole deadline): it logs and checks again.
    watch = HangWatch(_FlakyIndex(), poll_seconds=0.01)  # type: ignore[arg-type]
    call = _Call()
    try:
        with watch.watching(NS, call) as w:
            assert call.cancelled.wait(10), "the watch stopped after the failed check"
            assert w.hung
    finally:
        watch.close()
