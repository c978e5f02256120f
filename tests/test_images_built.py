"""The container images, built from ``images/*/Dockerfile`` and run (marker ``images``).

Runs against the harness's private Docker engine (Debian's dockerd, started and stopped here) on the
images ``scripts/bootstrap.sh`` built (``kvfabric images build``): each image's default command runs
in a container, the cache server as the DaemonSet runs it (non-root, read-only root file system, no
capabilities) and serving a real chunk through its Unix socket. ``KVFABRIC_SKIP_IMAGES=1`` (a machine
without Debian's docker.io, as in bootstrap) skips the module; otherwise a missing engine fails it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.containers import base, build, smoke
from kvfabric.containers.engine import RUNC_WRAPPER, DockerEngine, EnginePaths, dockerd_argv

ROOT = Path(__file__).resolve().parents[1]


def _image(directory: str) -> build.Image:
    return next(i for i in build.images() if i.directory == directory)


# --- pure parts (no engine) -----------------------------------------------------------------------


def test_dockerd_is_private_and_uses_the_runc_wrapper(tmp_path: Path) -> None:
    paths = EnginePaths(
        data_root=tmp_path / "data",
        exec_root=tmp_path / "exec",
        socket=tmp_path / "d.sock",
        pidfile=tmp_path / "d.pid",
        log=tmp_path / "d.log",
        lock=tmp_path / "d.lock",
    )
    argv = dockerd_argv(paths)
    assert f"--host=unix://{tmp_path / 'd.sock'}" in argv
    assert not any(a.startswith("--host=tcp") for a in argv), "never a TCP socket"
    assert {"--bridge=none", "--iptables=false", "--ip6tables=false"} <= set(argv)
    assert f"--add-runtime=kvfabric-runc={RUNC_WRAPPER}" in argv
    assert "--default-runtime=kvfabric-runc" in argv


def _fake_runc(tmp_path: Path) -> Path:
    fake = tmp_path / "runc"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/argv"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


@pytest.mark.process
def test_runc_wrapper_drops_cap_sys_resource_on_create_and_exec(tmp_path: Path) -> None:
    caps = ["CAP_CHOWN", "CAP_SYS_RESOURCE", "CAP_KILL"]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    sets = {k: list(caps) for k in ("bounding", "effective", "permitted", "inheritable", "ambient")}
    (bundle / "config.json").write_text(
        json.dumps({"process": {"capabilities": sets}, "root": {"path": "r"}})
    )
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"capabilities": {"bounding": list(caps)}, "args": ["sh"]}))
    env = {**os.environ, "KVFABRIC_REAL_RUNC": str(_fake_runc(tmp_path))}

    subprocess.run(
        [str(RUNC_WRAPPER), "--root", "/x", "create", "--bundle", str(bundle), "id1"], env=env, check=True
    )
    config = json.loads((bundle / "config.json").read_text())
    assert all(v == ["CAP_CHOWN", "CAP_KILL"] for v in config["process"]["capabilities"].values())
    assert config["root"] == {"path": "r"}, "nothing else changes"
    assert (tmp_path / "argv").read_text().split() == [
        "--root",
        "/x",
        "create",
        "--bundle",
        str(bundle),
        "id1",
    ]

    subprocess.run([str(RUNC_WRAPPER), "exec", "--process", str(process), "id1"], env=env, check=True)
    assert json.loads(process.read_text())["capabilities"] == {"bounding": ["CAP_CHOWN", "CAP_KILL"]}

    # Other commands pass through untouched (and a config without capabilities stays valid).
    (bundle / "config.json").write_text(json.dumps({"process": {}}))
    subprocess.run([str(RUNC_WRAPPER), "state", "id1"], env=env, check=True)
    subprocess.run([str(RUNC_WRAPPER), "run", "-b", str(bundle), "id2"], env=env, check=True)
    assert json.loads((bundle / "config.json").read_text()) == {"process": {}}


def test_build_context_digest_follows_dockerignore_allow_list() -> None:
    allowed = [
        line[1:]
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!") and "*" not in line
    ]
    assert sorted(allowed) == sorted(build.CONTEXT_PATHS), "the digest must cover exactly the build context"


# --- built images -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Iterator[DockerEngine]:
    if os.environ.get("KVFABRIC_SKIP_IMAGES") == "1":
        pytest.skip("KVFABRIC_SKIP_IMAGES=1")
    with DockerEngine() as eng:
        missing = [i.ref for i in build.images() if base.image_digest(eng, i.ref) is None]
        assert not missing, f"not built (run scripts/bootstrap.sh or `kvfabric images build`): {missing}"
        yield eng


@pytest.mark.images
def test_base_images_are_local_stand_ins(engine: DockerEngine) -> None:
    out = engine.docker(
        "run", "--rm", *smoke.LOCKED_DOWN, base.PYTHON_IMAGE, "python", "-c", "import sys; print(sys.version)"
    )
    assert out.stdout.startswith("3.12."), out.stdout
    for ref in (base.PYTHON_IMAGE, base.BUSYBOX_IMAGE):
        labels = json.loads(
            engine.docker("image", "inspect", "--format", "{{json .Config.Labels}}", ref).stdout
        )
        assert "io.kvfabric.stand-in" in labels, f"{ref} is the local stand-in, not a pulled image"


@pytest.mark.images
def test_operator_image_runs_its_command(engine: DockerEngine) -> None:
    assert "kvfabric operator" in smoke.help_of(engine, _image("operator"), "operator")


@pytest.mark.images
def test_engine_image_runs_its_command(engine: DockerEngine) -> None:
    assert "kvfabric engine serve" in smoke.help_of(engine, _image("engine"), "engine", "serve")


@pytest.mark.images
def test_engine_image_serves_requests_and_hits_the_cache_server_image(engine: DockerEngine) -> None:
    # 150 = 4 x 32 + 22 tokens: the four chunks and the tail's one whole 16-token block (144 tokens)
    # are stored, then loaded (as tests/refengine/test_refengine_serve.py has it for the process).
    prompt = [(i * 7919) % 500 for i in range(150)]  # the tiny preset has 512 token ids
    answers = smoke.engine_with_cache(
        engine, _image("engine"), _image("cacheserver"), prompt, want_hit_tokens=144
    )
    first, last = answers[0], answers[-1]
    assert (first["hit_tokens"], first["tier"]) == (0, None)
    assert len(first["output_token_ids"]) == 3
    assert (last["hit_tokens"], last["tier"]) == (144, "dram")
    assert all(a["output_token_ids"] == first["output_token_ids"] for a in answers)


@pytest.mark.images
@pytest.mark.parametrize("name", ["operator", "cacheserver", "engine"])
def test_images_know_their_runtime_user(engine: DockerEngine, name: str) -> None:
    # Without a passwd entry for 65532, kopf's start-up (getpass.getuser()) raised KeyError: the
    # operator image crashed on its first start under a real kubelet (e2e/test_real_kubelet.py).
    out = engine.docker(
        "run",
        "--rm",
        *smoke.LOCKED_DOWN,
        "--entrypoint",
        "python",
        _image(name).ref,
        "-c",
        "import getpass, os; print(os.getuid(), getpass.getuser())",
    )
    assert out.stdout.split() == ["65532", "nonroot"]


@pytest.mark.images
def test_cacheserver_image_serves_a_chunk_locked_down(engine: DockerEngine) -> None:
    facts = smoke.cacheserver_round_trip(engine, _image("cacheserver"))
    assert facts["uids"] == [65532] * 4, "non-root (the image's USER)"
    assert facts["gids"] == [65532] * 4
    assert facts["cap_eff"] == 0, "no effective capability"
    assert facts["cap_bnd"] == 0, "none even in the bounding set"
    assert facts["no_new_privs"] is True
    assert facts["root_read_only"] is True


@pytest.mark.images
def test_connector_payload_copies_and_imports_in_python_312(engine: DockerEngine) -> None:
    names = smoke.connector_payload(engine, _image("connector"))
    assert {"kvfabric", "grpc", "pydantic"} <= set(names)
    assert "torch" not in names


@pytest.mark.images
def test_rebuild_with_unchanged_inputs_is_skipped(engine: DockerEngine) -> None:
    image = _image("connector")
    build.build(engine, image, say=lambda _m: None)  # current after this, whatever it was before
    before = engine.docker("image", "inspect", "--format", "{{.Id}}", image.ref).stdout
    assert build.build(engine, image, say=lambda _m: None) is False
    assert engine.docker("image", "inspect", "--format", "{{.Id}}", image.ref).stdout == before
