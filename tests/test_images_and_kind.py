"""Static checks of the container images (images/) and the kind path (e2e/kind/).

Neither can be exercised here (no Docker engine, so no image build and no kind cluster), so this file
checks what can be checked without them: each Dockerfile is parsed into stages and held to the rules
the images promise (multi-stage, pinned bases, non-root numeric USER, real ``kvfabric`` commands,
the right extras, OCI labels); the kind config goes through kind's own loader and validation (a tiny
Go program in e2e/kind/validate) besides a YAML-shape check; the scripts pass ``bash -n`` and
shellcheck (when installed); and the names that the images, the operator's API, the sample pool and
the scripts share agree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfabric.cli.main import SUBCOMMANDS, build_parser
from kvfabric.cli.version import __version__
from kvfabric.demo import workloads
from kvfabric.localcluster.versions import KUBERNETES_VERSION
from kvfabric.operator.api.v1alpha1 import ImageSpec, KVCachePool
from kvfabric.operator.render import names
from kvfabric.operator.render.children import render_daemonset

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
KIND = ROOT / "e2e" / "kind"
TAG = f"v{__version__}"
IMAGE_DIRS = ("operator", "cacheserver", "connector", "engine")
GPU_LABEL = "nvidia.com/gpu.present"
NVME_MOUNT = "/mnt/nvme"
SHARED_MOUNT = "/mnt/kvfabric-shared"
HOST_PREFIX = "/tmp/kvfabric-kind"  # up.sh rewrites it to $KVFABRIC_KIND_HOST_DIR


# --------------------------------------------------------------------------------------------------
# A small Dockerfile parser: enough of the syntax for these files (continuations, comments, global
# ARGs, FROM ... AS, exec-form ENTRYPOINT/CMD, flags of COPY).


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int

    def flags(self) -> dict[str, str]:
        """``--name=value`` flags at the start of the arguments (COPY --from=..., --chmod=...)."""
        out: dict[str, str] = {}
        for word in shlex.split(self.args):
            if not word.startswith("--"):
                break
            key, _, value = word[2:].partition("=")
            out[key] = value
        return out

    def operands(self) -> list[str]:
        """The arguments after the flags (exec form is parsed as JSON)."""
        if self.args.lstrip().startswith("["):
            parsed = json.loads(self.args)
            assert isinstance(parsed, list)
            return [str(p) for p in parsed]
        return [w for w in shlex.split(self.args) if not w.startswith("--")]


@dataclass
class Stage:
    index: int
    base: str  # after substituting the global ARG defaults
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage_args(self, stage: Stage) -> dict[str, str]:
        """ARG defaults declared in ``stage``."""
        out: dict[str, str] = {}
        for ins in stage.all("ARG"):
            key, _, value = ins.args.partition("=")
            out[key.strip()] = value.strip().strip('"')
        return out


def _logical_lines(text: str) -> list[tuple[int, str]]:
    lines: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped, as BuildKit does
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        lines.append((start, " ".join(part.strip() for part in buf)))
        buf = []
    assert not buf, "the file ends inside a line continuation"
    return lines


def _substitute(value: str, args: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        key = m.group(1) or m.group(2)
        if key not in args:
            raise AssertionError(f"${key} in {value!r} has no global ARG default")
        return args[key]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, value)


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, text in _logical_lines(path.read_text()):
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--platform")]
            name = None
            if len(words) == 3 and words[1].upper() == "AS":
                name = words[2]
            else:
                assert len(words) == 1, f"{path}:{line}: cannot parse FROM {args!r}"
            stages.append(Stage(len(stages), _substitute(words[0], global_args), name))
        elif not stages:
            assert keyword == "ARG", f"{path}:{line}: only ARG may come before the first FROM"
            key, _, value = args.partition("=")
            global_args[key.strip()] = value.strip().strip('"')
        else:
            stages[-1].instructions.append(Instruction(keyword, args, line))
    assert stages, f"{path}: no FROM"
    return Dockerfile(path, global_args, stages)


def dockerfile(name: str) -> Dockerfile:
    return parse_dockerfile(IMAGES / name / "Dockerfile")


def image_list() -> dict[str, str]:
    """images/images.txt: image directory -> repository."""
    out: dict[str, str] = {}
    for raw in (IMAGES / "images.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            directory, repository = line.split()
            out[directory] = repository
    return out


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """Parse a command line with the real ``kvfabric`` parser; a usage error fails the test."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"kvfabric rejects the command line {argv!r} (exit {exc.code})")


def entry_argv(df: Dockerfile) -> list[str]:
    """ENTRYPOINT + CMD of the final stage, both in exec form."""
    entry = df.final.last("ENTRYPOINT")
    cmd = df.final.last("CMD")
    assert entry is not None, f"{df.path}: no ENTRYPOINT"
    for ins in (entry, cmd):
        if ins is not None:
            assert ins.args.startswith("["), f"{df.path}:{ins.line}: use the exec (JSON) form"
    return entry.operands() + (cmd.operands() if cmd else [])


# --------------------------------------------------------------------------------------------------
# Dockerfiles


def test_image_list_matches_the_image_directories() -> None:
    dirs = {p.parent.name for p in IMAGES.glob("*/Dockerfile")}
    assert dirs == set(IMAGE_DIRS)
    assert set(image_list()) == set(IMAGE_DIRS)
    # The cache-server image is what a KVCachePool runs by default.
    assert image_list()["cacheserver"] == ImageSpec.model_fields["repository"].default


@pytest.mark.parametrize("name", IMAGE_DIRS)
def test_dockerfile_is_multi_stage_pinned_and_non_root(name: str) -> None:
    df = dockerfile(name)
    text = df.path.read_text()
    assert len(df.stages) >= 2, "a builder stage and a final stage"
    assert "latest" not in text.lower(), "no floating tags"
    stage_names = {s.name for s in df.stages if s.name}
    assert len(stage_names) == len([s for s in df.stages if s.name]), "stage names are unique"
    for stage in df.stages:
        if stage.base in stage_names:
            continue
        repo, sep, tag = stage.base.rpartition(":")
        assert sep, f"{stage.base} has no tag"
        assert repo, stage.base
        assert "/" not in tag, f"{stage.base} has no tag"
        assert tag != "latest"
    for i, stage in enumerate(df.stages):
        earlier = {s.name for s in df.stages[:i] if s.name} | {str(s.index) for s in df.stages[:i]}
        for ins in stage.all("COPY"):
            source = ins.flags().get("from")
            if source is not None:
                assert source in earlier, f"{df.path}:{ins.line}: COPY --from={source} names no earlier stage"
    user = df.final.last("USER")
    assert user is not None, "the final stage sets USER"
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit(), f"USER {user.args} must be a numeric uid"
    assert int(uid) != 0, "USER must not be root"
    assert not gid or gid.isdigit(), f"USER {user.args}: numeric gid"
    # USER comes after everything that needs root in the final stage.
    assert all(i.line < user.line for i in df.final.instructions if i.keyword in {"RUN", "COPY", "ADD"})
    assert not any(s.all("ADD") for s in df.stages), "COPY, not ADD"


@pytest.mark.parametrize("name", IMAGE_DIRS)
def test_dockerfile_labels_and_version(name: str) -> None:
    df = dockerfile(name)
    labels = " ".join(i.args for i in df.final.all("LABEL"))
    for key in ("title", "description", "source", "licenses", "version", "revision"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels
    assert df.stage_args(df.final)["KVFABRIC_VERSION"] == __version__
    assert f"-t {image_list()[name]}:{TAG} ." in df.path.read_text(), "the build example names the image"


@pytest.mark.parametrize("name", IMAGE_DIRS)
def test_dockerfile_copies_only_what_the_build_context_holds(name: str) -> None:
    df = dockerfile(name)
    allowed = {
        line[1:].strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for stage in df.stages:
        for ins in stage.all("COPY"):
            if "from" in ins.flags():
                continue
            *sources, _dest = ins.operands()
            for source in sources:
                assert (ROOT / source).exists(), f"{df.path}:{ins.line}: {source} is not in the repository"
                assert source.split("/")[0] in allowed, f"{source} is excluded by .dockerignore"


@pytest.mark.parametrize(
    ("name", "extra"), [("operator", "operator"), ("cacheserver", None), ("engine", "engine")]
)
def test_kvfabric_images_run_a_real_subcommand_with_their_extras(name: str, extra: str | None) -> None:
    df = dockerfile(name)
    argv = entry_argv(df)
    assert argv[0] == "kvfabric"
    assert argv[1] in SUBCOMMANDS
    # The whole default command line parses with the real CLI (flags included).
    args = parse_cli(argv[1:])
    assert args.command == argv[1]
    builder = "\n".join(i.args for s in df.stages[:-1] for i in s.all("RUN"))
    extras = set(re.findall(r"--extra (\w+)", builder))
    assert extras == ({extra} if extra else set())
    assert "--require-hashes" in builder, "installs from uv.lock"
    assert "uv export --frozen --no-dev" in builder, "installs from uv.lock"
    assert "uv build --wheel" in builder
    # The builder proves the console script works for this subcommand.
    assert f"/opt/venv/bin/kvfabric {argv[1]}" in builder
    assert "COPY --from=builder /opt/venv /opt/venv" in {f"COPY {i.args}" for i in df.final.all("COPY")}
    env = " ".join(i.args for i in df.final.all("ENV"))
    assert "PATH=/opt/venv/bin:" in env


def test_cacheserver_image_matches_the_daemonset_the_operator_renders() -> None:
    sample = yaml.safe_load(
        (ROOT / "manifests" / "samples" / "kvfabric.io_v1alpha1_kvcachepool.yaml").read_text()
    )
    sample["metadata"]["namespace"] = "default"
    pool = KVCachePool.model_validate(sample)
    container = render_daemonset(pool, "rev")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"{image_list()['cacheserver']}:{TAG}", "the sample runs the image we build"
    df = dockerfile("cacheserver")
    argv = entry_argv(df)
    assert container["command"] == argv == ["kvfabric", "cacheserver", "--config", names.CONFIG_PATH]
    exposed = {int(p.split("/")[0]) for i in df.final.all("EXPOSE") for p in i.args.split()}
    # The sample pool keeps the TCP listener off (secure by default): only the metrics port.
    assert {p["containerPort"] for p in container["ports"]} < exposed
    sample["spec"].setdefault("server", {})["tcp"] = {"enabled": True}
    tcp_pool = KVCachePool.model_validate(sample)
    tcp_container = render_daemonset(tcp_pool, "rev")["spec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in tcp_container["ports"]} == exposed
    # The rendered pod drops every capability and mounts the root filesystem read-only.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "PYTHONDONTWRITEBYTECODE=1" in " ".join(i.args for i in df.final.all("ENV"))


def test_operator_image_serves_the_webhook_port() -> None:
    df = dockerfile("operator")
    exposed = {p for i in df.final.all("EXPOSE") for p in i.args.split()}
    assert exposed == {str(parse_cli(["operator"]).webhook_port)}
    assert '! /opt/venv/bin/python -c "import torch"' in df.path.read_text(), "the build proves: no torch"


def test_engine_image_serves_on_all_interfaces_with_cpu_torch() -> None:
    df = dockerfile("engine")
    args = parse_cli(entry_argv(df)[1:])
    assert (args.engine_command, args.host, args.port) == ("serve", "0.0.0.0", 8000)
    text = df.path.read_text()
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "torch.version.cuda is None" in text, "the build proves it is a CPU-only torch"


def test_engine_requirements_filter_keeps_everything_but_torch_and_cuda(tmp_path: Path) -> None:
    """Run the engine builder's awk filter on the real ``uv export`` of the engine extra."""
    if shutil.which("uv") is None or shutil.which("awk") is None:
        pytest.skip("uv or awk is not on PATH")
    locked = subprocess.run(
        ["uv", "export", "--frozen", "--no-dev", "--no-emit-project", "--extra", "engine"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    text = dockerfile("engine").path.read_text()
    program = re.search(r"awk '(.*?)' /dist/locked.txt", text, re.S)
    assert program is not None
    awk = re.sub(r"\\\n\s*", " ", program.group(1))
    kept = subprocess.run(
        ["awk", awk], input=locked, capture_output=True, text=True, check=True, timeout=30
    ).stdout

    def names_of(reqs: str) -> set[str]:
        return {m.group(1) for m in re.finditer(r"^([a-z0-9][a-z0-9._-]*)==", reqs, re.M)}

    dropped = names_of(locked) - names_of(kept)
    assert "torch" in dropped
    assert "numpy" in names_of(kept)
    assert "grpcio" in names_of(kept)
    assert all(re.match(r"^(torch|triton|cuda-|nvidia-)", n) for n in dropped), dropped
    # Every kept requirement still carries its hashes (pip --require-hashes).
    for block in re.split(r"\n(?=[a-z0-9])", kept.strip()):
        assert "--hash=sha256:" in block, block.splitlines()[0]
    torch = re.search(r"sed -n '(s/\^torch==.*?)' /dist/locked.txt", text)
    assert torch is not None
    version = subprocess.run(
        ["sed", "-n", torch.group(1)], input=locked, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version


def test_connector_payload_image() -> None:
    df = dockerfile("connector")
    text = df.path.read_text()
    argv = entry_argv(df)
    copied = {i.operands()[-1] for i in df.final.all("COPY") if i.flags().get("from")}
    assert argv[:2] == ["cp", "-R"]
    source = argv[2]
    assert source.endswith("/.")
    assert source[:-2] in copied, "it copies the tree the final stage holds"
    assert argv[3:] == ["/opt/kvfabric"], "default destination: the shared emptyDir"
    builder = "\n".join(i.args for s in df.stages[:-1] for i in s.all("RUN"))
    assert "--target /kvfabric-connector/site-packages" in builder
    assert "--extra" not in builder, "the base dependencies only (vLLM brings torch)"
    assert "test ! -e /kvfabric-connector/site-packages/torch" in builder
    assert "PYTHONPATH=/kvfabric-connector/site-packages python -c" in builder
    # The module vLLM is told to load is the one the operator injects.
    from kvfabric.operator.injection import KV_TRANSFER_CONFIG

    assert KV_TRANSFER_CONFIG["kv_connector_module_path"] in text
    assert KV_TRANSFER_CONFIG["kv_connector"] in text


def _replay_env(tmp: Path) -> dict[str, str]:
    """PATH shims so the builder's ``python`` and ``pip`` are an interpreter that has pip."""
    base = getattr(sys, "_base_executable", sys.executable)
    if subprocess.run([base, "-m", "ensurepip", "--version"], capture_output=True, check=False).returncode:
        pytest.skip(f"{base} has no ensurepip, so `python -m venv` cannot seed pip")
    if shutil.which("uv") is None:
        pytest.skip("uv is not on PATH")
    shims = tmp / "shims"
    shims.mkdir()
    for name, line in (("python", f'exec "{base}" "$@"'), ("pip", f'exec "{base}" -m pip "$@"')):
        (shims / name).write_text(f"#!/bin/sh\n{line}\n")
        (shims / name).chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT"}
    }
    env.update(
        PATH=f"{shims}:{env.get('PATH', '')}",
        UV_PYTHON_DOWNLOADS="never",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_ROOT_USER_ACTION="ignore",
    )
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["operator", "cacheserver", "connector"])
def test_builder_stage_runs_here(name: str, tmp_path: Path) -> None:
    """Run the builder stage's own RUN lines on this machine, in a copy of the build context.

    What Docker would do, minus the base image: the absolute paths (/dist, /opt/venv,
    /kvfabric-connector) move under tmp_path, the host's Python stands in for the image's, and the
    step installing uv is skipped (uv is here already). The engine's builder is not replayed: its
    torch comes from the PyTorch CPU index, which this machine cannot reach.
    """
    env = _replay_env(tmp_path)
    df = dockerfile(name)
    builder = df.stages[0]
    assert builder.name == "builder"
    context = tmp_path / "src"
    context.mkdir()
    for ins in builder.all("COPY"):
        *sources, _dest = ins.operands()
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache")
                shutil.copytree(src, context / source, ignore=ignore)
            else:
                shutil.copy2(src, context / source)
    remap = {
        "/dist": tmp_path / "dist",
        "/opt/venv": tmp_path / "venv",
        "/kvfabric-connector": tmp_path / "kvfabric-connector",
    }
    for ins in builder.all("RUN"):
        if ins.args.startswith('pip install "uv=='):
            continue
        command = ins.args
        for old, new in remap.items():
            command = re.sub(rf"(?<![\w./-]){re.escape(old)}(?![\w-])", str(new), command)
        proc = subprocess.run(
            ["/bin/sh", "-c", command],
            cwd=context,
            env=env,
            capture_output=True,
            text=True,
            timeout=800,
            check=False,
        )
        assert proc.returncode == 0, (
            f"{df.path}:{ins.line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    wheels = list((tmp_path / "dist").glob("kvfabric-*.whl"))
    assert [w.name for w in wheels] == [f"kvfabric-{__version__}-py3-none-any.whl"]
    if name == "connector":
        site = tmp_path / "kvfabric-connector" / "site-packages"
        assert (site / "kvfabric" / "connector" / "vllm.py").is_file()
        assert not (site / "torch").exists()
        assert not (site / "kopf").exists()
        assert not (site / "bin").exists()
    else:
        venv_python = tmp_path / "venv" / "bin" / "python"
        probe = (
            "import importlib.util as u; "
            "print(sorted(m for m in ('kopf', 'torch', 'kubernetes') if u.find_spec(m)))"
        )
        found = subprocess.run(
            [str(venv_python), "-c", probe], capture_output=True, text=True, check=True
        ).stdout
        assert found.strip() == ("['kopf', 'kubernetes']" if name == "operator" else "[]")


def test_dockerignore_keeps_the_context_small() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "an allow-list"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    assert {
        "pyproject.toml",
        "uv.lock",
        "README.md",
        "operator",
        "cacheserver",
        "connector",
        "harness",
    } <= allowed
    assert not allowed & {".venv", ".git", "tests", "e2e"}


def test_e2e_workloads_use_images_we_build() -> None:
    built = {f"{repo}:{TAG}" for repo in image_list().values()}
    pool = workloads.pool_manifest("p")
    assert f"{pool['spec']['image']['repository']}:{pool['spec']['image']['tag']}" in built
    deployment = workloads.engine_deployment("engine", "p")
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        assert container["image"] in built


# --------------------------------------------------------------------------------------------------
# The kind path


def kind_config() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((KIND / "kind-config.yaml").read_text())
    return data


def test_kind_config_shape() -> None:
    cfg = kind_config()
    assert (cfg["kind"], cfg["apiVersion"]) == ("Cluster", "kind.x-k8s.io/v1alpha4")
    nodes = cfg["nodes"]
    roles = [n["role"] for n in nodes]
    assert roles.count("control-plane") == 1
    gpu = [n for n in nodes if n["role"] == "worker" and n.get("labels", {}).get(GPU_LABEL) == "true"]
    assert 2 <= len(gpu) <= 3
    # No node names an image: up.sh passes --image (KIND_NODE_IMAGE, else the pinned kindest/node),
    # which would silently lose to a per-node one on some kind versions and reads as if it didn't.
    assert all("image" not in n for n in nodes)
    nvme_hosts = []
    shared_hosts = set()
    for node in nodes:
        for mount in node.get("extraMounts", []):
            for key in ("hostPath", "containerPath"):
                assert Path(mount[key]).is_absolute(), mount
            assert mount["hostPath"].startswith(HOST_PREFIX + "/"), mount
            if mount["containerPath"] == NVME_MOUNT:
                nvme_hosts.append(mount["hostPath"])
            if mount["containerPath"] == SHARED_MOUNT:
                shared_hosts.add(mount["hostPath"])
    for node in gpu:
        paths = {m["containerPath"] for m in node["extraMounts"]}
        assert {NVME_MOUNT, SHARED_MOUNT} <= paths
    assert len(nvme_hosts) == len(set(nvme_hosts)) == len(gpu), "one NVMe stand-in per GPU worker"
    workers = [n for n in nodes if n["role"] == "worker"]
    assert all(SHARED_MOUNT in {m["containerPath"] for m in n["extraMounts"]} for n in workers)
    assert len(shared_hosts) == 1, "every worker sees the same shared directory"
    # up.sh creates every host directory before `kind create cluster`.
    up = (KIND / "up.sh").read_text()
    assert f'HOST_DIR="${{KVFABRIC_KIND_HOST_DIR:-{HOST_PREFIX}}}"' in up
    for host in {*nvme_hosts, *shared_hosts}:
        assert f'"${{HOST_DIR}}/{host.removeprefix(HOST_PREFIX + "/")}"' in up, host


def go_validate(config: Path) -> subprocess.CompletedProcess[str]:
    go = shutil.which("go")
    if go is None:
        pytest.skip("Go is not installed: kind's own validation cannot run (the YAML-shape test still did)")
    return subprocess.run(
        [go, "run", ".", str(config)],
        cwd=KIND / "validate",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_kind_accepts_the_config_with_its_own_loader_and_validation() -> None:
    proc = go_validate(KIND / "kind-config.yaml")
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert loaded["Name"] == kind_config()["name"]
    gpu = [n for n in loaded["Nodes"] if (n["Labels"] or {}).get(GPU_LABEL) == "true"]
    assert len(gpu) >= 2
    for node in gpu:
        assert {m["ContainerPath"] for m in node["ExtraMounts"]} >= {NVME_MOUNT, SHARED_MOUNT}


@pytest.mark.slow
def test_the_kind_validator_is_strict(tmp_path: Path) -> None:
    bad = kind_config()
    bad["nodes"][1]["extraMount"] = bad["nodes"][1].pop("extraMounts")  # a typo kind must reject
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = go_validate(path)
    assert proc.returncode == 1
    assert "extraMount" in proc.stderr


def test_shared_volumes_match_the_kind_mounts_and_the_pools_storage_class() -> None:
    docs = list(yaml.safe_load_all((KIND / "shared-volumes.yaml").read_text()))
    classes = [d for d in docs if d["kind"] == "StorageClass"]
    volumes = [d for d in docs if d["kind"] == "PersistentVolume"]
    assert len(classes) == 1
    assert len(volumes) >= 4
    storage_class = classes[0]["metadata"]["name"]
    paths = set()
    for pv in volumes:
        spec = pv["spec"]
        assert spec["accessModes"] == ["ReadWriteMany"]
        assert spec["storageClassName"] == storage_class
        assert spec["persistentVolumeReclaimPolicy"] == "Retain"
        assert spec["hostPath"]["path"].startswith(SHARED_MOUNT + "/")
        paths.add(spec["hostPath"]["path"])
        assert pv["metadata"]["labels"]["kvfabric.io/test-volume"] == "shared"  # up.sh recycles by it
    assert len(paths) == len(volumes)
    claim = workloads.pool_manifest("p")["spec"]["tiers"]["shared"]["claimTemplate"]
    assert claim["storageClassName"] == storage_class
    assert "ReadWriteMany" in claim["accessModes"]


def kubectl_binary() -> str:
    """The pinned kubectl (its kustomize is the one the README's commands use)."""
    from kvfabric.localcluster import binaries

    return str(binaries.ensure(quiet=True) / "kubectl")


@pytest.mark.parametrize("overlay", ["kind", "kind/cert-manager"])
def test_kind_overlays_render_the_images_up_sh_loads(overlay: str) -> None:
    rendered = subprocess.run(
        [kubectl_binary(), "kustomize", str(ROOT / "manifests" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    built = {f"{repo}:{TAG}" for repo in image_list().values()}
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    deployments = [d for d in docs if d.get("kind") == "Deployment"]
    assert deployments
    operator_image = f"{image_list()['operator']}:{TAG}"
    for deployment in deployments:
        spec = deployment["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["image"] in built, container["image"]
            assert container.get("imagePullPolicy") == "IfNotPresent"
            argv = [*container.get("command", []), *container.get("args", [])]
            if argv[:2] == ["kvfabric", "operator"]:
                # kopf is only in the operator image.
                assert container["image"] == operator_image
    namespace = deployments[0]["metadata"]["namespace"]
    assert f'OPERATOR_NAMESPACE="${{OPERATOR_NAMESPACE:-{namespace}}}"' in (KIND / "up.sh").read_text()
    with_cert_manager = any(d.get("kind") == "Certificate" for d in docs)
    assert with_cert_manager == overlay.endswith("cert-manager")


# --------------------------------------------------------------------------------------------------
# Scripts


SCRIPTS = sorted(KIND.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_syntax_and_strict_mode(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert script.stat().st_mode & 0o111, "executable"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_passes_shellcheck(script: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout


FAKE_TOOLS = {
    "docker": """
case "$1" in
  info) [ "$2" = --format ] && echo "${FAKE_CGROUP_VERSION:-2}"; exit 0 ;;
esac
""",
    "kind": """
case "$1" in
  version) echo "kind v0.33.0 go1.26.8 linux/amd64" ;;
  get) [ "$2" = clusters ] && printf '%s\\n' ${FAKE_CLUSTERS:-} ;;
  create)
    while [ $# -gt 0 ]; do
      if [ "$1" = --kubeconfig ]; then echo "apiVersion: v1" >"$2"; fi
      if [ "$1" = --config ]; then cp "$2" "$FAKE_LOG.config"; fi
      shift
    done ;;
esac
""",
    "kubectl": """
case "$*" in
  *"get nodes -l nvidia.com/gpu.present=true"*) printf 'kvfabric-worker kvfabric-worker2' ;;
  *allocatable*) printf 8 ;;
  *"get pv"*) printf '' ;;
esac
""",
    "uv": """
echo "KVFABRIC_TEST_KUBECONFIG=$KVFABRIC_TEST_KUBECONFIG" >>"$FAKE_LOG"
""",
}


def fake_tools(tmp: Path, names: list[str]) -> tuple[dict[str, str], Path]:
    """Stand-ins for docker, kind, kubectl and uv that log their arguments."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    log = tmp / "calls.log"
    for name in names:
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >>"$FAKE_LOG"\n{FAKE_TOOLS[name]}')
        script.chmod(0o755)
    # The system's commands, less the real tools (a machine may have kubectl or a docker client).
    system = tmp / "system"
    system.mkdir()
    for directory in (Path("/usr/bin"), Path("/bin")):
        for exe in directory.iterdir():
            target = system / exe.name
            if exe.name not in FAKE_TOOLS and not target.exists():
                target.symlink_to(exe)
    env = {
        "PATH": f"{bin_dir}:{system}",
        "HOME": str(tmp),
        "FAKE_LOG": str(log),
        "KVFABRIC_KIND_HOST_DIR": str(tmp / "host"),
    }
    return env, log


@pytest.mark.parametrize("cert_manager", [False, True])
def test_up_sh_drives_kind_docker_and_kubectl_in_order(cert_manager: bool, tmp_path: Path) -> None:
    """Run up.sh with logging stand-ins for the tools it needs: the calls, their order and arguments."""
    env, log = fake_tools(tmp_path, ["docker", "kind", "kubectl", "uv"])
    env["CERT_MANAGER"] = "1" if cert_manager else "0"
    if cert_manager:  # one run with a local node image and a cgroup v1 engine, one without
        env["KIND_NODE_IMAGE"] = "kvfabric.local/kind-node:v1.36.3-0123456789"
        env["FAKE_CGROUP_VERSION"] = "1"
    overlay = "manifests/overlays/kind/cert-manager" if cert_manager else "manifests/overlays/kind"
    proc = subprocess.run(
        ["bash", str(KIND / "up.sh"), "-x", "-k", "hit"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    host = tmp_path / "host"
    kubeconfig = host / "kubeconfig"

    def index(prefix: str) -> int:
        matches = [i for i, c in enumerate(calls) if c.startswith(prefix)]
        assert matches, f"no call starting with {prefix!r} in:\n" + "\n".join(calls)
        return matches[0]

    create = index(f"kind create cluster --name kvfabric --config {host}/kind-config.yaml")
    # The node image: the one given, else kindest/node at the project's Kubernetes pin.
    image = env.get("KIND_NODE_IMAGE", f"kindest/node:{KUBERNETES_VERSION}")
    assert f" --image {image} " in calls[create] + " "
    # The config kind got has the host paths moved under KVFABRIC_KIND_HOST_DIR, and they exist.
    rendered = yaml.safe_load(Path(str(log) + ".config").read_text())
    # Kubernetes >= 1.35 kubelets refuse cgroup v1 unless the KubeletConfiguration says otherwise.
    patches = rendered.get("kubeadmConfigPatches", [])
    if env.get("FAKE_CGROUP_VERSION") == "1":
        assert [yaml.safe_load(p) for p in patches] == [
            {"kind": "KubeletConfiguration", "failCgroupV1": False}
        ]
    else:
        assert patches == []
    mounts = [m["hostPath"] for n in rendered["nodes"] for m in n.get("extraMounts", [])]
    assert mounts
    assert all(m.startswith(f"{host}/") and Path(m).is_dir() for m in mounts)
    for pv in yaml.safe_load_all((KIND / "shared-volumes.yaml").read_text()):
        if pv["kind"] == "PersistentVolume":
            relative = pv["spec"]["hostPath"]["path"].removeprefix(SHARED_MOUNT + "/")
            assert (host / "shared" / relative).is_dir()
    patch = index(
        "kubectl --kubeconfig " + str(kubeconfig) + " patch node kvfabric-worker --subresource=status"
    )
    assert '"path":"/status/capacity/nvidia.com~1gpu","value":"8"' in calls[patch]
    index(f"kubectl --kubeconfig {kubeconfig} taint node kvfabric-worker2 nvidia.com/gpu=present:NoSchedule")
    builds = [c for c in calls if c.startswith("docker build")]
    loads = [c for c in calls if c.startswith("kind load docker-image")]
    assert len(builds) == len(loads) == len(IMAGE_DIRS)
    for directory, repo in image_list().items():
        assert any(f"-f {ROOT}/images/{directory}/Dockerfile -t {repo}:{TAG} " in b for b in builds)
        assert f"kind load docker-image {repo}:{TAG} --name kvfabric" in loads
        assert f"--build-arg KVFABRIC_VERSION={__version__}" in builds[0]
    kubectl = f"kubectl --kubeconfig {kubeconfig}"
    apply_k = index(f"{kubectl} apply --server-side --force-conflicts -k {ROOT}/{overlay}")
    volumes = index(f"kubectl --kubeconfig {kubeconfig} apply -f {KIND}/shared-volumes.yaml")
    # Only the tests meant for an existing cluster: the kubelet and vLLM levels bring their own nodes.
    tests = index("uv run pytest e2e -m fabric -x -k hit")
    assert calls[tests + 1] == f"KVFABRIC_TEST_KUBECONFIG={kubeconfig}"
    assert create < patch < index("docker build") < apply_k < volumes < tests
    if cert_manager:
        # The stand-in kubectl finds cert-manager's CRD, so it is waited for, not installed.
        assert index(f"{kubectl} -n cert-manager wait --for=condition=Available") < apply_k
    else:
        assert not any("cert-manager" in c for c in calls), "cert-manager only with CERT_MANAGER=1"


@pytest.mark.parametrize("missing", ["docker", "kind", "kubectl"])
def test_up_sh_names_a_missing_tool_and_how_to_get_it(missing: str, tmp_path: Path) -> None:
    env, log = fake_tools(tmp_path, [n for n in ("docker", "kind", "kubectl", "uv") if n != missing])
    proc = subprocess.run(
        ["bash", str(KIND / "up.sh")], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 1
    assert f"'{missing}' is not on PATH" in proc.stderr
    assert "Install" in proc.stderr
    assert not log.exists() or "create" not in log.read_text(), "nothing ran before the check"


def _script(name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(KIND / name), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_down_sh_deletes_the_cluster_and_the_host_directory_up_sh_made(tmp_path: Path) -> None:
    env, log = fake_tools(tmp_path, ["docker", "kind", "kubectl", "uv"])
    env["SKIP_TESTS"] = "1"
    host = tmp_path / "host"
    proc = _script("up.sh", env)
    assert proc.returncode == 0, proc.stderr
    # Private, so no other local user reaches the world-writable directories the nodes mount.
    assert stat.S_IMODE(host.stat().st_mode) == 0o700
    assert (host / ".kvfabric-kind-host-dir").is_file()
    env["FAKE_CLUSTERS"] = "other kvfabric"
    proc = _script("down.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert "kind delete cluster --name kvfabric" in log.read_text().splitlines()
    assert not host.exists()
    env["FAKE_CLUSTERS"] = "other"
    proc = _script("down.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert "no kind cluster named 'kvfabric'" in proc.stderr


@pytest.mark.parametrize("marker", [False, True])
def test_down_sh_leaves_a_directory_up_sh_did_not_make(marker: bool, tmp_path: Path) -> None:
    """KVFABRIC_KIND_HOST_DIR may name any directory (a typo, $HOME): down.sh deletes it only with
    up.sh's marker, and only when it and the marker are this user's."""
    env, _ = fake_tools(tmp_path, ["kind"])
    precious = tmp_path / "precious"
    (precious / "shared").mkdir(parents=True)
    (precious / "notes.txt").write_text("mine\n")
    if marker:  # someone else's directory, with a marker they planted
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        (precious / ".kvfabric-kind-host-dir").write_text("")
        os.chown(precious / ".kvfabric-kind-host-dir", 65534, 65534)
        os.chown(precious, 65534, 65534)
    env["KVFABRIC_KIND_HOST_DIR"] = str(precious)
    proc = _script("down.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert (precious / "notes.txt").read_text() == "mine\n"
    assert f"leaving {precious}" in proc.stderr


@pytest.mark.parametrize("problem", ["others-write", "group-write", "foreign-owner", "symlink", "file"])
def test_up_sh_refuses_a_host_directory_another_user_could_have_made(problem: str, tmp_path: Path) -> None:
    """The default host directory is a fixed path under /tmp: another local user could make it first
    and swap kind-config.yaml or the mounts. up.sh refuses it before creating anything."""
    env, log = fake_tools(tmp_path, ["docker", "kind", "kubectl", "uv"])
    env["SKIP_TESTS"] = "1"
    host = tmp_path / "host"
    if problem == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        host.symlink_to(tmp_path / "elsewhere")
    elif problem == "file":
        host.write_text("")
    else:
        host.mkdir(mode=0o700)
        host.chmod({"others-write": 0o1777, "group-write": 0o770, "foreign-owner": 0o755}[problem])
        if problem == "foreign-owner":
            if os.geteuid() != 0:
                pytest.skip("giving a directory to another user needs root")
            os.chown(host, 65534, 65534)
    proc = _script("up.sh", env)
    assert proc.returncode == 1, proc.stderr
    assert f"KVFABRIC_KIND_HOST_DIR={host}" in proc.stderr
    assert not any(c.startswith("kind create") for c in log.read_text().splitlines())
    assert not (host / "kind-config.yaml").exists()


def test_up_sh_accepts_a_private_host_directory_of_this_user_and_down_sh_keeps_it(tmp_path: Path) -> None:
    env, _ = fake_tools(tmp_path, ["docker", "kind", "kubectl", "uv"])
    env["SKIP_TESTS"] = "1"
    host = tmp_path / "host"
    host.mkdir(mode=0o755)
    proc = _script("up.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert (host / "kind-config.yaml").is_file()
    assert not (host / ".kvfabric-kind-host-dir").exists()
    proc = _script("down.sh", env)
    assert proc.returncode == 0, proc.stderr
    assert (host / "kind-config.yaml").is_file()


def test_up_sh_uses_what_exists() -> None:
    up = (KIND / "up.sh").read_text()
    for referenced in (
        "images/images.txt",
        "manifests/overlays/kind",
        "kind-config.yaml",
        "shared-volumes.yaml",
        "operator/kvfabric/cli/version.py",
    ):
        assert referenced in up
    for overlay in ("kind", "kind/cert-manager", "kind/images"):
        assert (ROOT / "manifests" / "overlays" / overlay / "kustomization.yaml").is_file()
    assert "manifests/overlays/kind/cert-manager" in up
    assert "KVFABRIC_TEST_KUBECONFIG=" in up
    assert "uv run pytest e2e -m fabric" in up
    assert "kind load docker-image" in up
    assert "docker build -f" in up
    assert "--subresource=status" in up
    assert "nvidia.com~1gpu" in up
    assert "nvidia.com/gpu=present:NoSchedule" in up
    # The same taint as the local control plane's GPU nodes.
    from kvfabric.localcluster.nodes import GPU_RESOURCE

    assert GPU_RESOURCE == "nvidia.com/gpu"
    component = yaml.safe_load(
        (ROOT / "manifests" / "overlays" / "kind" / "images" / "kustomization.yaml").read_text()
    )
    assert component["kind"] == "Component"
    assert {i.get("newTag") for i in component["images"]} == {TAG}
    assert {i.get("newName", i["name"]) for i in component["images"]} == {image_list()["operator"]}
