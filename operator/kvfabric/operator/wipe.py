"""Wipe a deleted pool's local-disk blocks from its nodes (the pods of :mod:`kvfabric.operator.render.wipe`).

Run by the leading operator when it sees a pool's DELETED event, for every node the pool's cache
servers were seen on. The operator keeps no finalizer (a pool must stay deletable without it), so a
pool deleted while no operator leads keeps its blocks: docs/security.md says so.

Never under a running server: it waits until the pool's servers are gone, and it wipes nothing when
a pool of the same name exists again (its servers would be using that directory) or when another
pool keeps its own disk path inside the deleted pool's directory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kvfabric.operator.api.v1alpha1 import KIND
from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.render import names
from kvfabric.operator.render.wipe import disk_path, render_wipe_pod, wipe_dir, wipe_labels

log = logging.getLogger(__name__)


def _selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


async def _why_not(client: KubeClient, pool_body: Mapping[str, Any], directory: str) -> str | None:
    """A reason not to wipe ``directory`` at all, read from the live pools (None: go ahead)."""
    meta = pool_body["metadata"]
    ns, pool = str(meta["namespace"]), str(meta["name"])
    again = await client.get(KIND, ns, pool)
    if again is not None:
        return f"skipped: KVCachePool {ns}/{pool} exists again and uses that directory"
    try:
        pools = await client.list(KIND, None)
    except ApiError:  # a namespaced install may list only its namespaces: the pool's own, at least
        pools = await client.list(KIND, ns)
    for other in pools:
        path = disk_path(other)
        if path is not None and (path == directory or path.startswith(directory + "/")):
            om = other.get("metadata") or {}
            name = f"{om.get('namespace')}/{om.get('name')}"
            return f"skipped: KVCachePool {name} keeps its disk inside {directory}"
    return None


async def wipe_deleted_pool(
    client: KubeClient,
    pool_body: Mapping[str, Any],
    nodes: set[str],
    *,
    operator_namespace: str,
    poll: float = 1.0,
    servers_gone_timeout: float = 180.0,
    wipe_timeout: float = 660.0,
) -> dict[str, str]:
    """Empty the pool's local-disk directory on each of ``nodes``; return each node's outcome.

    Waits for the pool's cache servers to be gone first (a server writes blocks back as it stops);
    a node whose server outlives the wait is left alone and reported, never wiped under it. The wipe
    pods are deleted however this ends (cancellation included).
    """
    directory = wipe_dir(pool_body)
    if directory is None or not nodes:
        return {}
    meta = pool_body["metadata"]
    ns, pool = str(meta["namespace"]), str(meta["name"])
    loop = asyncio.get_running_loop()
    outcome: dict[str, str] = {}
    deadline = loop.time() + servers_gone_timeout
    while True:
        running = {
            str(p.get("spec", {}).get("nodeName"))
            for p in await client.list("Pod", ns, label_selector=names.owned_pod_selector(pool))
            if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        }
        if not running & nodes or loop.time() > deadline:
            break
        await asyncio.sleep(poll)
    for node in sorted(running & nodes):
        outcome[node] = "skipped: its cache server did not stop"
    targets = sorted(nodes - running)
    reason = await _why_not(client, pool_body, directory) if targets else None
    if reason is not None:
        outcome.update(dict.fromkeys(targets, reason))
        targets = []
    created: list[str] = []
    try:
        for node in targets:
            pod = render_wipe_pod(pool_body, node, operator_namespace)
            assert pod is not None
            try:
                await client.create(pod)
                created.append(pod["metadata"]["name"])
            except ApiError as exc:
                outcome[node] = f"failed: {exc}"
        selector = _selector(wipe_labels(pool_body))
        deadline = loop.time() + wipe_timeout
        pending = {n for n in targets if n not in outcome}
        while pending and loop.time() < deadline:
            by_node = {
                str(p["spec"].get("nodeName")): p
                for p in await client.list("Pod", operator_namespace, label_selector=selector)
            }
            for node in list(pending):
                phase = (by_node.get(node) or {}).get("status", {}).get("phase")
                if phase in ("Succeeded", "Failed"):
                    outcome[node] = "wiped" if phase == "Succeeded" else "failed: the wipe pod failed"
                    pending.discard(node)
            if pending:
                await asyncio.sleep(poll)
        for node in pending:
            outcome[node] = "failed: the wipe pod did not finish"
    finally:
        # Shielded: a cancelled wipe (leadership lost, operator stopping) still removes its pods.
        await asyncio.shield(_delete_pods(client, operator_namespace, created))
    for node, result in sorted(outcome.items()):
        level = logging.INFO if result == "wiped" else logging.WARNING
        log.log(level, "local-disk blocks of deleted pool %s/%s on %s: %s", ns, pool, node, result)
    return outcome


async def _delete_pods(client: KubeClient, namespace: str, pod_names: list[str]) -> None:
    for name in pod_names:
        try:
            await client.delete("Pod", namespace, name)
        except ApiError as exc:
            log.warning("could not delete wipe pod %s/%s: %s", namespace, name, exc)


async def sweep_finished_wipe_pods(client: KubeClient, operator_namespace: str) -> int:
    """Delete finished wipe pods a previous leader left (killed before it could); return how many."""
    swept = 0
    for pod in await client.list("Pod", operator_namespace, label_selector=_selector(wipe_labels())):
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            await _delete_pods(client, operator_namespace, [pod["metadata"]["name"]])
            swept += 1
    return swept
