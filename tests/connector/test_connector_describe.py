"""The connector describes its namespaces to its cache server once, at start, and again after a restart.

Real client, real server process, kill -9: what the server exports (``kvfabric_namespace_info``) is
what the pool's status shows as the namespaces in use (docs/operator.md, "Cache insight").
"""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.cacheserver.metrics import namespace_label as lbl
from kvfabric.client import CacheClient
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import Reason, build_cache
from kvfabric.connector.scheduler import SchedulerHalf
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.worker import WorkerHalf
from kvfabric.testing.serverproc import ServerProcess, cache_server, digest

pytestmark = [pytest.mark.process, pytest.mark.slow]

SPEC = NamespaceSpec("tiny-llama", "rev-a", "float32", 2, 1, 4, 16, 32, tp_size=2, tp_rank=0)
KEYS = [digest("k", i) for i in range(4)]


def scrape(srv: ServerProcess) -> tuple[dict[str, dict[str, str]], int]:
    """(namespace label -> info labels, accepted descriptions) as the server exports them."""
    with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    info: dict[str, dict[str, str]] = {}
    accepted = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvfabric_namespace_info":
                info[s.labels["namespace_label"]] = dict(s.labels)
            elif s.name == "kvfabric_cache_describes_total" and s.labels.get("result") == "accepted":
                accepted += int(s.value)
    return info, accepted


@pytest.mark.parametrize("local_index", [False, True], ids=["rpc-lookups", "published-index"])
def test_the_connector_describes_each_namespace_once_at_start_and_again_after_a_restart(
    local_index: bool,
) -> None:
    with cache_server(dram_bytes=16 << 20) as srv:
        settings = ConnectorSettings(
            socket=str(srv.config.listen.unix_socket),
            shared_memory=True,
            local_index=local_index,
            chunk_tokens=SPEC.chunk_tokens,
            breaker_failures=1,
            breaker_cooldown_ms=200,
        )
        cache = build_cache(settings, shared=False)
        assert cache is not None
        try:
            scheduler = SchedulerHalf(settings, SPEC, cache=cache)
            worker = WorkerHalf(settings, dataclasses.replace(SPEC, tp_rank=1), cache=cache)
            sched_ns, worker_ns = scheduler.namespace, worker.namespace
            assert sched_ns != worker_ns
            assert lbl(sched_ns) != lbl(worker_ns)
            # Both are sent at start, on an I/O thread: no request's lookup or store carries them.
            deadline = time.monotonic() + 30
            while scrape(srv)[1] < 2:
                assert time.monotonic() < deadline, "the namespaces were not described at start"
                time.sleep(0.05)
            client = cache.endpoints[0]._client  # connected at start
            assert isinstance(client, CacheClient)
            if local_index:  # the lookups' table is mapped at start too (a call-free lookup answers)
                while client.lookup_local(sched_ns, KEYS) is None:
                    assert time.monotonic() < deadline, "the published table was not mapped at start"
                    time.sleep(0.05)
            assert cache.lookup(sched_ns, KEYS, 5.0).reason is Reason.NOT_FOUND
            # ... and, connected, the very first lookup is answered from the published table.
            assert cache.counters.get("lookup_local") == (1 if local_index else 0)
            for _ in range(5):
                assert cache.lookup(sched_ns, KEYS, 5.0).reason is Reason.NOT_FOUND
                assert cache.store(worker_ns, KEYS[:1], [b"x" * 64], 5.0) is not None
            if local_index:  # the published table answers once the description is sent
                assert cache.counters.get("lookup_local") > 0
            info, accepted = scrape(srv)
            assert accepted == 2  # once per namespace, not once per call
            assert set(info) == {lbl(sched_ns), lbl(worker_ns)}
            assert (info[lbl(sched_ns)]["model"], info[lbl(sched_ns)]["tp_rank"]) == ("tiny-llama", "0")
            assert info[lbl(worker_ns)]["tp_rank"] == "1"

            srv.kill()
            srv.start()
            assert scrape(srv) == ({}, 0)
            # The breaker lets a probe through after its cooldown; the first answer from the new
            # server says it lacks the description, and the next call sends it.
            deadline = time.monotonic() + 30
            while cache.lookup(sched_ns, KEYS, 1.0).reason in (Reason.UNAVAILABLE, Reason.TIMEOUT):
                assert time.monotonic() < deadline, "lookups never reached the restarted server"
                time.sleep(0.05)
            for _ in range(5):
                assert cache.lookup(sched_ns, KEYS, 5.0).reason is Reason.NOT_FOUND
            info, accepted = scrape(srv)
            if local_index:
                # The published index saw the server go: every description is due again at once.
                assert (set(info), accepted) == ({lbl(sched_ns), lbl(worker_ns)}, 2)
            else:
                # The lookup answer asked for the lookups' namespace only (the store's comes below).
                assert (set(info), accepted) == ({lbl(sched_ns)}, 1)
            for _ in range(3):
                assert cache.store(worker_ns, KEYS[1:2], [b"y" * 64], 5.0) is not None
            info, accepted = scrape(srv)
            assert (set(info), accepted) == ({lbl(sched_ns), lbl(worker_ns)}, 2)
        finally:
            cache.close()


def test_a_lookup_during_the_start_up_warm_up_never_reads_the_index_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The published index is read by one thread at a time (its table fetches poll one socket).

    The warm-up maps the lookups' table on an I/O thread at start while a request may already look
    up: that lookup must not enter the index beside it (it asks over RPC instead). Two readers at
    once failed the request's lookup as "unavailable" (``RuntimeError: concurrent poll()``).
    """
    with (
        cache_server(dram_bytes=16 << 20) as srv,
        CacheClient(srv.unix_target, shared_memory=True, local_index=True) as client,
    ):
        index = client.local_index
        assert index is not None
        ns = SPEC.digest()
        client.announce(ns, SPEC.canonical().decode())
        inside, most, lock = [0], [0], threading.Lock()
        real = index.lookup
        entered = threading.Event()

        def watched(namespace: str, raw: bytes, *, fetch: bool = True) -> object:
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            entered.set()
            try:
                time.sleep(0.3)  # a slow table fetch
                return real(namespace, raw, fetch=fetch)
            finally:
                with lock:
                    inside[0] -= 1

        monkeypatch.setattr(index, "lookup", watched)
        warm = threading.Thread(target=lambda: client.warm_up(ns, timeout=10))
        warm.start()
        assert entered.wait(10), "the warm-up never mapped the table"
        assert client.lookup_local(ns, KEYS) is None  # busy: "ask over RPC"
        assert client.lookup(ns, KEYS, timeout=10).matched == 0  # answered over RPC
        warm.join(10)
        assert most[0] == 1, "two threads read the published index at once"
        assert client.lookup(ns, KEYS, timeout=10).matched == 0
