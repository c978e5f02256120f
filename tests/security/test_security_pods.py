"""Paths and pods: pools never share a directory, the cache DaemonSet is hardened, the server refuses
symlinked directories."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.render import names, render_children
from kvfabric.testing.serverproc import MiB, cache_server

# DNS-1123 labels (namespaces) and DNS-1035 labels (pool names), short enough to collide often.
_NAMESPACE = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,6}[a-z0-9])?", fullmatch=True)
_POOL = st.from_regex(r"[a-z]([-a-z0-9]{0,6}[a-z0-9])?", fullmatch=True)


def _paths(ns: str, pool: str) -> tuple[str, ...]:
    return (names.host_dir(ns, pool), names.local_disk_dir(ns, pool), names.pool_dir_name(ns, pool))


def test_the_reported_collision_is_gone() -> None:
    # Namespace a / pool b-x and namespace a-b / pool x shared '/run/kvfabric/a-b-x'.
    assert set(_paths("a", "b-x")).isdisjoint(_paths("a-b", "x"))


@settings(max_examples=500, deadline=None)
@given(a=st.tuples(_NAMESPACE, _POOL), b=st.tuples(_NAMESPACE, _POOL))
def test_host_paths_are_injective_in_namespace_and_pool(a: tuple[str, str], b: tuple[str, str]) -> None:
    if a != b:
        for pa, pb in zip(_paths(*a), _paths(*b), strict=True):
            assert pa != pb
            # Not even nested in one another (a pool's directory is never inside another's).
            assert not pa.startswith(pb + "/")
            assert not pb.startswith(pa + "/")


def _pool(**spec: Any) -> KVCachePool:
    body = {
        "image": {"repository": "attacker.example/evil", "tag": "v1"},
        "tiers": {
            "memory": {"size": "1Gi"},
            "localDisk": {"hostPath": {"path": "/mnt/nvme/kv"}, "capacity": "10Gi"},
        },
        **spec,
    }
    return KVCachePool.model_validate(
        {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": body}
    )


def _pod_spec(p: KVCachePool) -> dict[str, Any]:
    ds = next(o for o in render_children(p).objects if o["kind"] == "DaemonSet")
    spec: dict[str, Any] = ds["spec"]["template"]["spec"]
    return spec


def test_cache_daemonset_is_hardened() -> None:
    spec = _pod_spec(_pool())
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "hostNetwork" not in spec
    assert "hostPID" not in spec
    assert "hostIPC" not in spec
    (cache,) = spec["containers"]
    sc = cache["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in sc


def test_directory_preparation_runs_the_operators_image_with_only_chown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(names.OPERATOR_IMAGE_ENV, "registry.example/kvfabric/operator:v9")
    (prepare,) = _pod_spec(_pool())["initContainers"]
    # The pool's author chose "attacker.example/evil": it must never run as root with the path mounted.
    assert prepare["image"] == "registry.example/kvfabric/operator:v9"
    sc = prepare["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    # It sees the hostPath directories it prepares, and nothing else (no config, no credentials).
    assert {m["name"] for m in prepare["volumeMounts"]} == {
        names.RUN_VOLUME,
        names.HANDOVER_VOLUME,
        "local-disk",
    }


@pytest.mark.process
@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_the_server_refuses_a_symlinked_or_non_directory_tier_path(tmp_path: Path, kind: str) -> None:
    with cache_server(dram_bytes=16 * MiB, start=False) as srv:
        tier = srv.config.tiers.local_disk
        assert tier is not None
        target = tmp_path / "elsewhere"
        target.mkdir()
        if kind == "symlink":
            tier.path.symlink_to(target)
        else:
            tier.path.write_bytes(b"")
        with pytest.raises(
            RuntimeError, match=r"tiers\.local_disk\.path .* (is a symbolic link|is not a directory)"
        ):
            srv.start(timeout=60)
        assert list(target.iterdir()) == []  # nothing was written through the link
        with contextlib.suppress(FileNotFoundError):
            tier.path.unlink()
        srv.start(timeout=60)  # a real directory (created by the server) is fine
        assert tier.path.is_dir()
        assert not tier.path.is_symlink()
