"""The real-node tier's configuration, as pure functions (the e2e level runs it: e2e/test_real_kubelet.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kvfabric.localcluster import realnodes
from kvfabric.localcluster.nodes import GPU_RESOURCE


def test_nodes_get_distinct_namespaces_addresses_pod_ranges_and_short_socket_paths(tmp_path: Path) -> None:
    nodes = realnodes.plan(tmp_path / "cluster", Path("/run/kvfabric-0/nodes"), 3)
    for attr in ("name", "netns", "address", "host_address", "host_link", "pod_subnet", "run", "cgroup"):
        assert len({getattr(n, attr) for n in nodes}) == 3, attr
    for n in nodes:
        assert len(n.host_link) <= 15, "the kernel's limit for an interface name"
        assert n.host_address.rsplit(".", 1)[0] == n.address.rsplit(".", 1)[0], "one /24 per node"
        assert len(str(n.containerd_socket)) < 100
        # The cache server's socket lives in the node's run directory: clients on the host need < 108.
        sock = n.host_dir("/run/kvfabric") / "kd-12345678-pool-name" / "cache.sock"  # as the tests name them
        assert len(str(sock)) < 108
    # Another cluster directory, other names (the addresses and cgroups are the same: one cluster
    # with real nodes per machine at a time; `up` removes what a killed one left).
    other = realnodes.plan(tmp_path / "other", Path("/run/kvfabric-0/nodes"), 1)
    assert other[0].netns != nodes[0].netns
    assert other[0].host_link != nodes[0].host_link


def test_kubelet_config_has_what_this_machine_kind_needs(tmp_path: Path) -> None:
    (node,) = realnodes.plan(tmp_path, Path("/run/x"), 1)
    cfg = realnodes.kubelet_config(node, tmp_path / "ca.crt")
    assert cfg["failCgroupV1"] is False, "cgroup v1 only here; v1.36 refuses it by default"
    assert cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["cgroupRoot"] == f"/kvfabric-nodes/{node.name}", "its own subtree, killed at down"
    assert cfg["imageGCHighThresholdPercent"] == 100, "no registry: a collected image is lost"
    assert cfg["authentication"]["anonymous"]["enabled"] is False
    assert cfg["containerRuntimeEndpoint"] == f"unix://{node.containerd_socket}"
    assert {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"} in cfg["registerWithTaints"]


def test_containerd_config_is_valid_toml_with_the_runc_wrapper_and_no_oom_adj(tmp_path: Path) -> None:
    (node,) = realnodes.plan(tmp_path, Path("/run/x"), 1)
    cfg = tomllib.loads(realnodes.containerd_config(node))
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["sandbox_image"] == realnodes.PAUSE_IMAGE
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["options"]["BinaryName"] == str(realnodes.RUNC_WRAPPER)
    assert realnodes.RUNC_WRAPPER.is_file()
    assert cfg["grpc"]["address"] == str(node.containerd_socket)
    assert cri["cni"]["conf_dir"] == str(node.dir / "cni")


def test_cni_config_keeps_pods_in_the_node_range(tmp_path: Path) -> None:
    nodes = realnodes.plan(tmp_path, Path("/run/x"), 2)
    subnets = [realnodes.cni_config(n)["plugins"][0]["ipam"]["ranges"][0][0]["subnet"] for n in nodes]
    assert subnets == [n.pod_subnet for n in nodes]
    assert realnodes.cni_config(nodes[0])["plugins"][0]["ipMasq"] is False, "nothing leaves the namespace"
