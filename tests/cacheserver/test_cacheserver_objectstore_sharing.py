"""Real cache-server processes sharing nothing but an S3 bucket (SeaweedFS on loopback)."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.client import CacheClient
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache, transport_factory
from kvfabric.testing.s3server import S3Server, s3_server
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.process]  # a real S3 server process


def object_tier(s3: S3Server, prefix: str, secrets_dir: Path, **kw: Any) -> dict[str, Any]:
    """The ``tiers.object_store`` section, credentials in files as a mounted Secret provides them."""
    secrets_dir.mkdir(parents=True, exist_ok=True)
    (secrets_dir / "AWS_ACCESS_KEY_ID").write_text(s3.access_key)
    (secrets_dir / "AWS_SECRET_ACCESS_KEY").write_text(s3.secret_key)
    return {
        "endpoint": s3.endpoint,
        "bucket": s3.bucket,
        "prefix": prefix,
        "access_key_id_file": str(secrets_dir / "AWS_ACCESS_KEY_ID"),
        "secret_access_key_file": str(secrets_dir / "AWS_SECRET_ACCESS_KEY"),
        "capacity_bytes": 512 * MiB,
        "journal_poll_seconds": 0.2,
        "request_timeout_seconds": 2.0,
        "connect_timeout_seconds": 1.0,
        "max_retries": 1,
        "retry_timeout_seconds": 2.0,
        "cooldown_seconds": 1.0,
        "part_bytes": 1 * MiB,
        **kw,
    }


@contextlib.contextmanager
def nodes(s3: S3Server, tmp: Path, *ids: str) -> Iterator[list[ServerProcess]]:
    """Servers with DRAM and the object tier only: no local disk, no shared volume."""
    prefix = f"pool-{secrets.token_hex(4)}"
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                cache_server(
                    server_id=sid,
                    local_disk_bytes=None,
                    overrides={"tiers.object_store": object_tier(s3, prefix, tmp / sid)},
                )
            )
            for sid in ids
        ]


def test_chunk_stored_on_node_a_is_a_hit_on_node_b_through_the_object_tier(
    s3: S3Server, ns: str, tmp_path: Path
) -> None:
    keys = [digest("obj-ab", i) for i in range(3)]
    payloads = [payload_for(k, 2 * MiB + i) for i, k in enumerate(keys)]
    with (
        nodes(s3, tmp_path, "node-a", "node-b") as (a, b),
        CacheClient(a.unix_target, shared_memory=True) as ca,
        CacheClient(b.unix_target, shared_memory=True) as cb,
    ):
        assert cb.lookup(ns, keys, timeout=5).matched == 0
        assert ca.store(ns, keys, payloads, timeout=10).accepted == 3
        # A writes back to the bucket asynchronously; B learns from A's journal segments.
        res = wait_until(
            lambda: (r := cb.lookup(ns, keys, timeout=5)).matched == 3 and r, what="B to see A's objects"
        )
        assert res.tiers == ["object"] * 3
        assert cb.load(ns, keys, timeout=10) == payloads
        # Promoted into B's DRAM by the load.
        assert cb.lookup(ns, keys, timeout=5).tiers == ["dram"] * 3
        stats = cb.stats(timeout=5)
        assert stats["counters"]["hits"]["object"] == 3
        assert stats["counters"].get("checksum_failures", {}).get("object", 0) == 0
        # A restarted B rebuilds its index from a listing of the bucket.
        b.restart()
        with CacheClient(b.unix_target, shared_memory=True) as cb2:
            assert cb2.lookup(ns, keys, timeout=5).tiers == ["object"] * 3
            assert cb2.load(ns, keys, timeout=10) == payloads


def test_a_hung_or_killed_object_store_mid_load_is_a_recompute_never_a_failed_request(
    ns: str, tmp_path: Path
) -> None:
    n = 12
    keys = [digest("obj-fault", i) for i in range(n)]
    payloads = [payload_for(k, 1 * MiB) for k in keys]
    with (
        s3_server() as own,
        nodes(own, tmp_path, "node-a", "node-b") as (a, b),
        CacheClient(a.unix_target, shared_memory=True) as ca,
        CacheClient(b.unix_target) as cb,
    ):
        assert ca.store(ns, keys, payloads, timeout=10).accepted == n
        wait_until(lambda: cb.lookup(ns, keys, timeout=5).matched == n, what="B to see every object")
        cache = ResilientCache(
            [Endpoint("b", transport_factory(b.unix_target, shared_memory=True), CircuitBreaker(3, 1.0))]
        )
        outcomes: list[tuple[int, int, str | None]] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def load(i: int) -> None:
            """What the connector does: load the chunk, or count a fallback and recompute it."""
            try:
                buf = bytearray(MiB)
                out = cache.load_into(ns, keys[i : i + 1], [buf], deadline=_deadline(3.0))
                if out.count:
                    assert bytes(buf) == payloads[i]  # a hit is always the right bytes
                with lock:
                    outcomes.append((i, out.count, out.reason.value if out.reason else None))
            except BaseException as exc:  # the assertion below reports it
                errors.append(exc)

        try:
            load(0)
            assert outcomes[-1][1] == 1  # from the object tier
            # Hung (SIGSTOP) while loads are in flight: each is a miss within its deadline.
            threads = [threading.Thread(target=load, args=(i,)) for i in (1, 2, 3)]
            for t in threads:
                t.start()
            own.pause()
            for t in threads:
                t.join()
            load(4)
            load(0)  # DRAM keeps serving while the object store hangs
            assert outcomes[-1] == (0, 1, None)
            own.resume()

            def served_again() -> bool:
                load(5)
                return outcomes[-1][1] == 1

            wait_until(served_again, timeout=30, what="store to serve again")
            own.kill()
            load(6)
            load(7)
            load(0)
            assert outcomes[-1] == (0, 1, None)
        finally:
            cache.close()
        assert not errors, errors
        during_faults = [o for o in outcomes if o[0] in (1, 2, 3, 4, 6, 7)]
        # Fault-time loads either completed before the fault hit or fell back with a reason.
        assert all(count == 1 or reason is not None for _, count, reason in during_faults)
        assert any(count == 0 for i, count, _ in during_faults if i in (6, 7))
        assert cb.health(timeout=5)
        assert cb.stats(timeout=5)["counters"]["object_errors"]["get"] >= 1


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds
