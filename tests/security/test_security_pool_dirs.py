"""One pool's cache server reaches no other pool's directory: not on the disk path, not on the node's
/run, not on a shared claim (docs/security.md, "Paths and pods").

Every pool's server runs as the same uid (65532) with an image its author picks, so what tells pools
apart on a node is what the DaemonSet mounts, not file ownership. These tests read the rendered
DaemonSet back (every hostPath and claim the server container mounts, over generated pools that
share disk paths and claims), then make the mounts for real in a private mount namespace (the
init container's, with its script run in a chroot, then the server's) and look from the server's
side.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.localcluster.podrunner.spec import Mount, mounts
from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.render import names, render_children
from kvfabric.testing.mountns import run_in_private_mount_namespace

_NAMESPACE = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,4}[a-z0-9])?", fullmatch=True)
_POOL = st.from_regex(r"[a-z]([-a-z0-9]{0,4}[a-z0-9])?", fullmatch=True)
# Disk paths (normalised, as admission requires) that pools share or nest in one another.
_DISK = st.sampled_from(["/mnt/nvme/kv", "/mnt/nvme", "/mnt", "/var/lib/kv", None])
_CLAIM = st.sampled_from(["shared-kv", None])  # an existing claim (pools of a namespace share it)


def _pool(ns: str, name: str, disk: str | None, claim: str | None, hand_over: bool) -> KVCachePool:
    tiers: dict[str, Any] = {"memory": {"size": "1Gi"}}
    if disk is not None:
        tiers["localDisk"] = {"hostPath": {"path": disk}, "capacity": "10Gi"}
    if claim is not None:
        tiers["shared"] = {"existingClaim": claim, "capacity": "10Gi"}
    return KVCachePool.model_validate(
        {
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{ns}-{name}"},
            "spec": {
                "image": {"repository": "attacker.example/evil", "tag": "v1"},
                "tiers": tiers,
                "updateStrategy": {"handOver": hand_over},
            },
        }
    )


def _pod_spec(pool: KVCachePool) -> dict[str, Any]:
    (ds,) = render_children(pool).by_kind("DaemonSet")
    spec: dict[str, Any] = ds["spec"]["template"]["spec"]
    return spec


def _container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in [*spec["containers"], *spec.get("initContainers", [])] if c["name"] == name)


def _reach(pool: KVCachePool, container: str = names.CACHE_CONTAINER) -> list[tuple[str, ...]]:
    """What the container's mounts expose of the node: ('host', path) or ('claim', ns, claim, dir)."""
    spec = _pod_spec(pool)
    volumes = {v["name"]: v for v in spec["volumes"]}
    out: list[tuple[str, ...]] = []
    for m in _container(spec, container)["volumeMounts"]:
        vol, sub = volumes[m["name"]], m.get("subPath")
        if "hostPath" in vol:
            out.append(("host", posixpath.normpath(posixpath.join(vol["hostPath"]["path"], sub or ""))))
        elif "persistentVolumeClaim" in vol:
            out.append(("claim", pool.namespace, vol["persistentVolumeClaim"]["claimName"], sub or ""))
    return out


def _own_dirs(pool: KVCachePool) -> list[tuple[str, ...]]:
    """The pool's directories on a node and on its claim."""
    ns, name = pool.namespace, pool.name
    out: list[tuple[str, ...]] = [("host", names.host_dir(ns, name)), ("host", names.handover_dir(ns, name))]
    disk = pool.spec.tiers.local_disk
    if disk is not None and disk.host_path is not None:
        out.append(
            ("host", posixpath.join(posixpath.normpath(disk.host_path.path), names.pool_dir_name(ns, name)))
        )
    shared = pool.spec.tiers.shared
    if shared is not None and shared.existing_claim is not None:
        out.append(("claim", ns, shared.existing_claim, names.pool_dir_name(ns, name)))
    return out


def _reaches(exposed: tuple[str, ...], directory: tuple[str, ...]) -> bool:
    """Whether a mount of ``exposed`` shows ``directory`` (the same one, or one below it)."""
    if exposed[:-1] != directory[:-1]:
        return False
    top, d = exposed[-1], directory[-1]
    return top in ("", d) or d.startswith(top.rstrip("/") + "/")


@settings(max_examples=400, deadline=None)
@given(
    a=st.tuples(_NAMESPACE, _POOL, _DISK, _CLAIM, st.booleans()),
    b=st.tuples(_NAMESPACE, _POOL, _DISK, _CLAIM, st.booleans()),
)
def test_a_pools_server_mounts_no_other_pools_directory(
    a: tuple[str, str, str | None, str | None, bool], b: tuple[str, str, str | None, str | None, bool]
) -> None:
    if a[:2] == b[:2]:
        return
    pa, pb = _pool(*a), _pool(*b)
    theirs = _own_dirs(pb)
    for exposed in _reach(pa):
        for directory in theirs:
            assert not _reaches(exposed, directory), (
                f"{a[:2]}'s server mounts {exposed}: {directory} is {b[:2]}'s"
            )
    # And what it does mount is its own: every hostPath and claim mount is one of its directories.
    assert all(exposed in _own_dirs(pa) for exposed in _reach(pa)), _reach(pa)


@settings(max_examples=100, deadline=None)
@given(a=st.tuples(_NAMESPACE, _POOL, _DISK, _CLAIM, st.booleans()))
def test_the_servers_tier_paths_are_its_mount_points(
    a: tuple[str, str, str | None, str | None, bool],
) -> None:
    pool = _pool(*a)
    (cm,) = render_children(pool).by_kind("ConfigMap")
    tiers = yaml.safe_load(cm["data"][names.CONFIG_KEY])["tiers"]
    by_name = {
        m["name"]: m["mountPath"] for m in _container(_pod_spec(pool), names.CACHE_CONTAINER)["volumeMounts"]
    }
    if a[2] is not None:
        assert tiers["local_disk"]["path"] == by_name["local-disk"] == names.local_disk_dir(a[0], a[1])
    if a[3] is not None:
        assert tiers["shared"]["path"] == by_name["shared"] == names.SHARED_MOUNT


# --- the same mounts, made for real ----------------------------------------------------------------

_DISK_PATH = "/mnt/nvme/kv"


def _volume_dirs(spec: dict[str, Any], host: Path) -> dict[str, Path]:
    """The pod's volumes on a node whose root is ``host`` (hostPath: DirectoryOrCreate, as the kubelet)."""
    dirs: dict[str, Path] = {}
    for vol in spec["volumes"]:
        if "hostPath" in vol:
            path = host / vol["hostPath"]["path"].lstrip("/")
            if not path.is_symlink():
                path.mkdir(parents=True, exist_ok=True)
        else:
            path = host.parent / "vol" / vol["name"]
            path.mkdir(parents=True, exist_ok=True)
        dirs[vol["name"]] = path
    return dirs


def _bind_script(plan: list[Mount], root: Path) -> str:
    """Shell lines making ``plan`` below ``root`` (parents first), as a runtime does for a container."""
    lines = []
    for m in plan:
        target = shlex.quote(str(root / m.target.lstrip("/")))
        lines.append(f"mkdir -p {target} && mount --bind {shlex.quote(str(m.source))} {target}")
        if m.read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    return "\n".join(lines)


def _chroot_tools(root: Path) -> str:
    """Shell lines giving ``root`` this machine's /usr (read-only) and its /bin, /lib... for ``sh``."""
    lines = [f"mkdir -p {root}/usr && mount --bind /usr {root}/usr && mount -o remount,bind,ro {root}/usr"]
    for top in ("bin", "sbin", "lib", "lib64"):
        src = Path("/") / top
        if src.is_symlink():
            lines.append(f"ln -sfn {shlex.quote(os.readlink(src))} {root}/{top}")
        elif src.is_dir():
            lines.append(f"mkdir -p {root}/{top} && mount --bind /{top} {root}/{top}")
    return "\n".join(lines)


def _node(tmp_path: Path, *, plant_symlink: bool) -> tuple[Path, KVCachePool, dict[str, Any]]:
    """A node with pool b/q's blocks on the disk path, and the pool a/p that will start there."""
    host = tmp_path / "node" / "host"
    theirs = host / _DISK_PATH.lstrip("/") / names.pool_dir_name("b", "q")
    (theirs / "buckets" / "7").mkdir(parents=True)
    (theirs / "buckets" / "7" / "b-prompt-block").write_bytes(b"the other pool's prompt at rest")
    os.chown(theirs, 4242, 4242)  # so a chown through a symlink would show
    if plant_symlink:
        # Planted (by whoever could write the disk path) where pool a/p's directory goes.
        # Relative, so it resolves inside the container too (mkdir -p then succeeds through it).
        (host / _DISK_PATH.lstrip("/") / names.pool_dir_name("a", "p")).symlink_to(theirs.name)
    pool = _pool("a", "p", _DISK_PATH, None, True)
    return host, pool, _pod_spec(pool)


_needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("chroot") is None,
    reason="needs root, unshare and chroot",
)


def needs_root(test: Any) -> Any:
    """Real mount(2) in a child process: level ``process``, skipped without root and unshare."""
    return pytest.mark.process(_needs_root(test))


@needs_root
def test_from_the_server_containers_view_a_sibling_pools_directory_is_absent(tmp_path: Path) -> None:
    host, _pool_a, spec = _node(tmp_path, plant_symlink=False)
    dirs = _volume_dirs(spec, host)
    prepare, server = _container(spec, "prepare-dirs"), _container(spec, names.CACHE_CONTAINER)
    init_root, server_root = tmp_path / "init-root", tmp_path / "server-root"
    mine = server_root / names.local_disk_dir("a", "p").lstrip("/")
    other = f"-name b-prompt-block -o -name {names.pool_dir_name('b', 'q')}"
    cmd = textwrap.dedent(
        f"""
        set -e
        {_chroot_tools(init_root)}
        {_bind_script(mounts(prepare, dirs), init_root)}
        chroot {init_root} {shlex.join(prepare["command"])}
        {_bind_script(mounts(server, dirs), server_root)}
        echo "mine: $(stat -c %u {mine})"
        find {server_root} {other}
        echo "theirs: $(find {server_root} {other} | wc -l)"
        touch {mine}/written-by-a
        """
    )
    out = run_in_private_mount_namespace(cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    # The init container made the pool's own directory below the disk path and gave it to the server...
    ours = host / _DISK_PATH.lstrip("/") / names.pool_dir_name("a", "p")
    assert ours.is_dir()
    assert not ours.is_symlink()
    assert ours.stat().st_uid == 65532
    assert "mine: 65532" in out.stdout
    # ...which sees that directory where its configuration says, and nothing of the other pool's.
    assert "theirs: 0" in out.stdout, out.stdout
    assert (ours / "written-by-a").exists()
    theirs = host / _DISK_PATH.lstrip("/") / names.pool_dir_name("b", "q")
    assert sorted(p.name for p in theirs.rglob("*")) == ["7", "b-prompt-block", "buckets"]


@needs_root
def test_a_symlink_where_the_pools_directory_goes_stops_the_pod_before_the_server_starts(
    tmp_path: Path,
) -> None:
    host, _pool_a, spec = _node(tmp_path, plant_symlink=True)
    dirs = _volume_dirs(spec, host)
    prepare = _container(spec, "prepare-dirs")
    init_root = tmp_path / "init-root"
    cmd = textwrap.dedent(
        f"""
        set -e
        {_chroot_tools(init_root)}
        {_bind_script(mounts(prepare, dirs), init_root)}
        exec chroot {init_root} {shlex.join(prepare["command"])}
        """
    )
    out = run_in_private_mount_namespace(cmd)
    # The init container fails (the kubelet retries it and never starts the server's container).
    assert out.returncode == 3, out.stdout + out.stderr
    assert "is a symlink" in out.stderr
    theirs = host / _DISK_PATH.lstrip("/") / names.pool_dir_name("b", "q")
    assert theirs.stat().st_uid == 4242  # not handed to the server's uid through the link
