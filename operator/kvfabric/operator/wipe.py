"""Wipe a deleted pool's local-disk blocks from its nodes (the pods of :mod:`kvfabric.operator.render.wipe`).

Run by the leading operator when it sees a pool's DELETED event, for the nodes its cache servers ran
on (from the informer's cache, which still holds them then). The operator keeps no finalizer (a pool
must stay deletable without it), so a pool deleted while no operator runs keeps its blocks: that gap
is documented in docs/security.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.render import names
from kvfabric.operator.render.wipe import render_wipe_pod, wipe_dir, wipe_labels

log = logging.getLogger(__name__)


async def wipe_deleted_pool(
    client: KubeClient,
    pool_body: Mapping[str, Any],
    nodes: set[str],
    *,
    operator_namespace: str,
    poll: float = 1.0,
    servers_gone_timeout: float = 180.0,
    wipe_timeout: float = 330.0,
) -> dict[str, str]:
    """Empty the pool's local-disk directory on each of ``nodes``; return each node's outcome.

    Waits for the pool's cache servers to be gone first (a server writes blocks back as it stops);
    a node whose server outlives the wait is left alone and reported, never wiped under it.
    """
    if wipe_dir(pool_body) is None or not nodes:
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
        }
        if not running & nodes or loop.time() > deadline:
            break
        await asyncio.sleep(poll)
    for node in sorted(running & nodes):
        outcome[node] = "skipped: its cache server did not stop"
    targets = sorted(nodes - running)
    for node in targets:
        pod = render_wipe_pod(pool_body, node, operator_namespace)
        assert pod is not None
        try:
            await client.create(pod)
        except ApiError as exc:
            if exc.status != 409:  # 409: an earlier attempt made it; wait for that one
                outcome[node] = f"failed: {exc}"
    selector = ",".join(f"{k}={v}" for k, v in wipe_labels(ns, pool).items())
    deadline = loop.time() + wipe_timeout
    pending = {n for n in targets if n not in outcome}
    by_node: dict[str, dict[str, Any]] = {}
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
    for node in targets:
        pod_name = render_wipe_pod(pool_body, node, operator_namespace)["metadata"]["name"]  # type: ignore[index]
        try:
            await client.delete("Pod", operator_namespace, pod_name)
        except ApiError as exc:
            log.warning("could not delete wipe pod %s/%s: %s", operator_namespace, pod_name, exc)
    for node, result in sorted(outcome.items()):
        level = logging.INFO if result == "wiped" else logging.WARNING
        log.log(level, "local-disk blocks of deleted pool %s/%s on %s: %s", ns, pool, node, result)
    return outcome
