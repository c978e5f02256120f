"""Fake nodes for kwok: pure functions that return Node manifests."""

from __future__ import annotations

from typing import Any

GPU_LABEL = "nvidia.com/gpu.present"
GPU_RESOURCE = "nvidia.com/gpu"
KWOK_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}


def node_manifest(name: str, *, gpus: int, managed_by_kwok: bool = True) -> dict[str, Any]:
    """A Node that kwok keeps Ready; GPU nodes carry the label, capacity and taint of a real GPU node.

    ``managed_by_kwok=False`` leaves out kwok's annotation, for nodes whose pods a test's own pod
    runner executes (it then heartbeats the node itself).
    """
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    spec: dict[str, Any] = {}
    if gpus:
        capacity[GPU_RESOURCE] = str(gpus)
        labels[GPU_LABEL] = "true"
        spec["taints"] = [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": dict(KWOK_ANNOTATION) if managed_by_kwok else {},
        },
        "spec": spec,
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
        },
    }


def node_names(gpu_nodes: int, cpu_nodes: int) -> tuple[list[str], list[str]]:
    """Names of the GPU and CPU nodes of a cluster of the given shape."""
    return [f"kwok-gpu-{i}" for i in range(gpu_nodes)], [f"kwok-cpu-{i}" for i in range(cpu_nodes)]
