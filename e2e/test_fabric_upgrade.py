"""Upgrading the whole fabric from the previous release while engines keep serving.

The previous release (the newest ``v*`` tag before HEAD, built from its tag by
:mod:`kvfabric.testing.release`) runs the operator and the pool's cache servers: the operator is
restarted from the release's source tree, and the pod runner runs containers of the pool's image
``…:<tag>`` from that tree too (the runner has no images: an image is the code its environment selects,
:meth:`Fabric.add_image`). Engines of this release are injected by the old operator and serve a prompt
continuously on both nodes. Then the operator is upgraded (restarted as this release) and the pool's
``spec.image`` changed to this release: every cache server is replaced, by hand-over, while the
engines keep sending requests.

What the compatibility promise in docs/operations.md ("Versions that work together") says must
hold, counted exactly: no request fails, every output equals the output computed without the cache,
the hit rate while the fabric is upgraded is at least 0.9 of the same workload's without an upgrade
(the measure of the rolling-update test in test_fabric.py), hits come from DRAM (the new servers took
the old ones' memory over), and once the upgrade is done every request hits the whole cached prefix.

The CRD is this release's throughout (the session's fabric is shared with the other e2e tests; the
CRD only gained optional fields since the previous release, which the chart upgrades with the
operator).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kvfabric.cli.version import __version__
from kvfabric.demo.fabric import Fabric, wait_pool_ready
from kvfabric.demo.workloads import engine_deployment, generate, pool_manifest, prompt, ready_pods
from kvfabric.localcluster.testing import wait_for
from kvfabric.testing.release import ReleaseTree, previous_release, release_tree

POOL = "pool-upgrade"
CHUNK = 64
REPOSITORY = "ghcr.io/kvfabric/kvfabric"
CURRENT = f"v{__version__}"
CACHE_SELECTOR = f"app.kubernetes.io/name=kvfabric-cache,app.kubernetes.io/instance={POOL}"
PROMPT_CHUNKS = 3
# The fabric (first test of a session), a release tree, two rolls of the pool: more than the default 180 s.
pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def previous(fabric: Fabric) -> Iterator[ReleaseTree]:
    if fabric.operator is None or fabric.runner_base is None:
        pytest.skip(
            "an existing cluster (KVFABRIC_TEST_KUBECONFIG): its images are real, not releases' trees"
        )
    tag = previous_release()
    if tag is None:
        pytest.skip("no previous release: tag one (git tag -a v<version> <commit>)")
    assert tag != CURRENT, f"HEAD's version {CURRENT} is already tagged: bump kvfabric/cli/version.py"
    with release_tree(tag) as tree:
        # The cache servers run as their pods' user (65532): the tree must be readable by it.
        tree.root.chmod(0o755)
        yield tree


def _cache_pods(fabric: Fabric, ns: str) -> list[dict[str, Any]]:
    return ready_pods(fabric.cluster, ns, CACHE_SELECTOR)


def _image(pod: dict[str, Any]) -> str:
    return str(pod["spec"]["containers"][0]["image"])


def _pythonpath(pod: dict[str, Any]) -> str | None:
    """The PYTHONPATH the pod's cache-server process runs with (the pod runner's container is its pid)."""
    return _pythonpath_of(int(pod["status"]["containerStatuses"][0]["containerID"].rsplit("/", 1)[1]))


def _pythonpath_of(pid: int | None) -> str | None:
    assert pid is not None
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"PYTHONPATH=")), None)


Done = list[tuple[float, dict[str, Any]]]


def _traffic(
    fabric: Fabric,
    engines: list[dict[str, Any]],
    p: list[int],
    expected: list[int],
    stop: threading.Event,
    done: Done,
    failures: list[str],
) -> None:
    """Send ``p`` to every engine in turn until ``stop``: ``(time, result)`` per request, and failures."""
    while not stop.is_set():
        for pod in engines:
            try:
                r = generate(fabric, pod, p)
            except Exception as exc:  # a failed request is what the test counts
                failures.append(f"{pod['spec']['nodeName']}: {exc!r}")
                continue
            r["node"] = pod["spec"]["nodeName"]
            done.append((time.monotonic(), r))
            if r["output_token_ids"] != expected:
                failures.append(f"wrong output on {r['node']}: {r['output_token_ids']} != {expected}")


def _hits(fabric: Fabric, pod: dict[str, Any], p: list[int]) -> bool:
    return bool(generate(fabric, pod, p)["hit_tokens"] > 0)


def _hit_rate(results: list[dict[str, Any]]) -> float:
    return sum(1 for r in results if r["hit_tokens"] > 0) / max(1, len(results))


def test_upgrading_the_operator_and_the_pools_image_keeps_engines_serving(
    fabric: Fabric, previous: ReleaseTree
) -> None:
    assert fabric.operator is not None
    old_image = f"{REPOSITORY}:{previous.tag}"
    old_env = {"PYTHONPATH": previous.pythonpath}
    fabric.add_image(old_image, old_env)
    try:
        fabric.operator.restart(env=old_env)
        with fabric.cluster.namespace("e2e-upgrade") as ns:
            _upgrade_while_serving(fabric, ns, previous)
    finally:
        # Whatever happened, the session's other tests get this release's operator back.
        fabric.operator.restart()


def _upgrade_while_serving(fabric: Fabric, ns: str, previous: ReleaseTree) -> None:
    assert fabric.operator is not None
    pool = pool_manifest(POOL, chunk_tokens=CHUNK)
    pool["spec"]["image"] = {"repository": REPOSITORY, "tag": previous.tag}
    fabric.cluster.apply(pool, namespace=ns)
    # Generous: the previous release's operator and servers start from source on a loaded machine
    # (once, with a load average of 16 on two cores, this took more than the default 180 s).
    wait_pool_ready(fabric.cluster, ns, POOL, timeout=360)
    fabric.cluster.apply(engine_deployment("engine-upgrade", POOL), namespace=ns)
    engines = wait_for(
        lambda: len(e := ready_pods(fabric.cluster, ns, "app=engine-upgrade")) == 2 and e,
        timeout=180,
        message="two ready engines",
    )
    old_servers = _cache_pods(fabric, ns)
    assert len(old_servers) == len(fabric.gpu_nodes)
    # The previous release's code really runs the operator and serves the nodes: their processes
    # import its tree (PYTHONPATH selects it: tests/cacheserver/test_cacheserver_version_skew.py).
    assert _pythonpath_of(fabric.operator.pid) == previous.pythonpath
    assert {_image(s) for s in old_servers} == {f"{REPOSITORY}:{previous.tag}"}
    assert {_pythonpath(s) for s in old_servers} == {previous.pythonpath}

    p = prompt(21, PROMPT_CHUNKS * CHUNK + 1)
    expected = generate(fabric, engines[0], p)["output_token_ids"]
    for pod in engines:  # both nodes warm
        wait_for(partial(_hits, fabric, pod, p), timeout=30, message="a warm cache")

    # The same workload without an upgrade, for the baseline.
    stop = threading.Event()
    timer = threading.Timer(8.0, stop.set)
    timer.start()
    steady: Done = []
    failures: list[str] = []
    _traffic(fabric, engines, p, expected, stop, steady, failures)
    assert failures == []

    done: Done = []
    stop = threading.Event()
    thread = threading.Thread(target=_traffic, args=(fabric, engines, p, expected, stop, done, failures))
    thread.start()
    old_uids = {s["metadata"]["uid"] for s in old_servers}
    try:
        started_at = time.monotonic()
        fabric.operator.restart()  # the operator of this release
        fabric.cluster.kubectl(
            "patch", "kvcachepool", POOL, "-n", ns, "--type=merge",
            "-p", f'{{"spec":{{"image":{{"tag":"{CURRENT}"}}}}}}',
        )  # fmt: skip

        def upgraded() -> bool:
            pods = _cache_pods(fabric, ns)
            every = fabric.cluster.get_json("pods", "-n", ns, "-l", CACHE_SELECTOR)["items"]
            return (
                len(pods) == len(every) == len(fabric.gpu_nodes)
                and {_image(s) for s in pods} == {f"{REPOSITORY}:{CURRENT}"}
                and not {s["metadata"]["uid"] for s in pods} & old_uids
            )

        wait_for(upgraded, timeout=240, message="every cache server replaced by this release's")
        upgraded_at = time.monotonic()
        wait_pool_ready(fabric.cluster, ns, POOL)
        # A few more rounds on the upgraded fabric.
        wait_for(
            lambda: sum(t > upgraded_at for t, _ in list(done)) >= 4,
            timeout=60,
            message="four requests after the upgrade",
        )
    finally:
        stop.set()
        thread.join(timeout=120)

    new_servers = _cache_pods(fabric, ns)
    assert {_pythonpath(s) for s in new_servers} == {None}, "this release's servers run this checkout's code"
    assert _pythonpath_of(fabric.operator.pid) != previous.pythonpath
    assert failures == [], failures
    during = [r for t, r in done if started_at <= t <= upgraded_at]
    after = [r for t, r in done if t > upgraded_at]
    base, upgrade = _hit_rate([r for _, r in steady]), _hit_rate(during)
    tiers = Counter(r.get("tier") for r in during if r["hit_tokens"] > 0)
    misses = Counter(r.get("fallback_reason") for r in during if r["hit_tokens"] == 0)
    print(
        f"\nupgrade {previous.tag} -> {CURRENT}: hit rate {upgrade:.3f} ({len(during)} requests, hits by "
        f"tier {dict(tiers)}, misses by reason {dict(misses)}) vs {base:.3f} without an upgrade "
        f"({len(steady)} requests); {len(after)} requests after it, "
        f"{sum(r['hit_tokens'] == PROMPT_CHUNKS * CHUNK for r in after)} full hits"
    )
    assert len(during) >= 4, f"only {len(during)} requests ran during the upgrade"
    assert base > 0.9, "the steady workload hits"
    assert upgrade >= 0.9 * base, f"hit rate {upgrade:.3f} during the upgrade against {base:.3f} without one"
    # Every hit is the whole cached prefix (three chunks; the prompt's last token is always computed).
    assert {r["hit_tokens"] for r in during if r["hit_tokens"] > 0} <= {PROMPT_CHUNKS * CHUNK}
    # The new servers took the old ones' DRAM over: hits stay DRAM hits, not disk re-reads.
    assert tiers.get("dram", 0) >= 0.9 * sum(tiers.values()), tiers
    # Once upgraded, every request hits the whole prefix.
    assert after, "no request ran after the upgrade"
    assert [r["hit_tokens"] for r in after] == [PROMPT_CHUNKS * CHUNK] * len(after)
