"""Manifests and helpers the whole-fabric tests and the demo share."""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

from kvfabric.localcluster.testing import ClusterHandle

if TYPE_CHECKING:
    from kvfabric.demo.fabric import Fabric
    from kvfabric.testing.s3server import S3Server

ENGINE_PORT = 8000


def pool_manifest(name: str, *, memory: str = "256Mi", chunk_tokens: int = 64) -> dict[str, Any]:
    """A pool with all three tiers: DRAM, a node-local disk (hostPath) and a shared claim it owns."""
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {
            "image": {"repository": "ghcr.io/kvfabric/kvfabric", "tag": "v0.2.0"},
            "chunkTokens": chunk_tokens,
            # Generous deadlines: the tests assert hits, and two busy CPU cores can stretch a lookup
            # past the 100 ms default (the fallback would be correct, but not what the test checks).
            "consumers": {"deadlines": {"lookupMs": 2000, "loadMs": 10000}},
            "tiers": {
                "memory": {"size": memory},
                "localDisk": {"hostPath": {"path": "/mnt/nvme/kvcache"}, "capacity": "1Gi"},
                "shared": {
                    "claimTemplate": {
                        "storageClassName": "kvfabric-shared",
                        "size": "1Gi",
                        "accessModes": ["ReadWriteMany"],
                    },
                    "capacity": "1Gi",
                },
            },
        },
    }


def with_object_tier(
    pool: dict[str, Any], s3: S3Server, secret: str, *, capacity: str = "1Gi", local_disk: bool = False
) -> dict[str, Any]:
    """``pool`` with its shared volume replaced by ``s3``'s bucket (keys in ``secret``).

    Its node-local disk goes too unless ``local_disk``: then nothing but DRAM and the bucket.
    """
    tiers = pool["spec"]["tiers"]
    tiers.pop("shared", None)
    if not local_disk:
        tiers.pop("localDisk", None)
    tiers["objectStore"] = {
        "endpoint": s3.endpoint,
        "bucket": s3.bucket,
        "pathStyle": True,
        "credentials": {"secretName": secret},
        "capacity": capacity,
    }
    return pool


def object_store_secret(s3: S3Server, name: str) -> dict[str, Any]:
    """The Secret with ``s3``'s key pair under the keys the pool's credentials default to."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
    }


def one_per_gpu_node(labels: dict[str, str]) -> dict[str, Any]:
    """Pod-spec fields that put one replica (pods with ``labels``) on each GPU node."""
    return {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
                ]
            }
        },
    }


def engine_deployment(name: str, pool: str | None, replicas: int = 2, preset: str = "tiny") -> dict[str, Any]:
    """The reference engine as an inference Deployment, one replica per GPU node.

    With ``pool`` it opts in to injection (label ``kvfabric.io/pool``); without, it runs with no cache.
    """
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": {**labels, **({"kvfabric.io/pool": pool} if pool else {})}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    **one_per_gpu_node(labels),
                    "containers": [
                        {
                            "name": "engine",
                            "image": "ghcr.io/kvfabric/engine:v0.2.0",
                            "command": [
                                "kvfabric",
                                "engine",
                                "serve",
                                "--host",
                                "0.0.0.0",
                                "--port",
                                str(ENGINE_PORT),
                                "--max-model-len",
                                "8192",
                                "--preset",
                                preset,
                            ],
                            "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                            "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
                            "readinessProbe": {
                                "httpGet": {"path": "/healthz", "port": "http"},
                                "periodSeconds": 1,
                            },
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                },
            },
        },
    }


def ready_pods(cluster: ClusterHandle, namespace: str, selector: str) -> list[dict[str, Any]]:
    """Pods matching ``selector`` that are Ready and not terminating."""
    items: list[dict[str, Any]] = cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]
    return [
        p
        for p in items
        if p["metadata"].get("deletionTimestamp") is None
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
    ]


def generate(
    fabric: Fabric, pod: dict[str, Any], prompt: list[int], max_tokens: int = 2, timeout: float = 120
) -> dict[str, Any]:
    """POST /generate to the engine in ``pod``."""
    status, body = fabric.request(
        pod,
        ENGINE_PORT,
        "/generate",
        data=json.dumps({"prompt_token_ids": prompt, "max_tokens": max_tokens}),
        timeout=timeout,
    )
    if status != 200:
        raise AssertionError(f"engine on {pod['spec']['nodeName']} answered {status}: {body[:500]}")
    result: dict[str, Any] = json.loads(body)
    return result


def prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    """A deterministic pseudo-random prompt."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]
