"""Every command the README and the docs show parses: the docs are tested like code.

- every ``kvfabric …`` command (in a code block or inline) parses with the real CLI parser, and its
  ``--help`` works (a group such as ``kvfabric bench`` is checked by its ``--help`` alone);
- every ``-k`` path renders with ``kubectl kustomize`` (the pinned kubectl's kustomize), and so does
  the README's image overlay, which must leave no image or ``KVFABRIC_OPERATOR_IMAGE`` behind;
- every ``kubectl apply``/``create`` in a code block passes ``--dry-run=server`` against the local
  control plane, in the order shown, the README's ``pool.yaml`` and ``vllm.yaml`` included.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfabric.cli.main import build_parser
from kvfabric.localcluster.testing import ClusterHandle
from kvfabric.testing.opstools import prometheus_operator_crds

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "images" / "README.md", *(ROOT / "docs").glob("*.md")])
# Placeholders the docs write for a value of the reader's, and a value that parses in their place.
PLACEHOLDERS = {"<kubeconfig>": "/tmp/kubeconfig", "N": "2", "NS/NAME": "kvfabric-system/kvfabric-webhook"}
README_REGISTRY = "registry.example.com/kvfabric"


@dataclass(frozen=True)
class Block:
    """A fenced code block of a doc: its info string, its text and where it starts."""

    doc: Path
    line: int
    lang: str
    text: str


def blocks(doc: Path) -> list[Block]:
    found: list[Block] = []
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(m.group(1)) :])
            i += 1
        # A shell line continued with a trailing backslash is one command.
        found.append(Block(doc, start + 1, m.group(2), "\n".join(body).replace("\\\n", " ")))
        i += 1
    return found


def without_comment(line: str) -> str:
    """A shell line without its trailing ``# comment`` (none of the commands quote a ``#``)."""
    return re.sub(r"\s+#.*$", "", line).strip()


def kvfabric_commands() -> dict[str, str]:
    """Every ``kvfabric …`` command shown, mapped to where it is shown first."""
    found: dict[str, str] = {}
    for doc in DOCS:
        text = doc.read_text()
        where = doc.relative_to(ROOT).as_posix()
        for span in re.findall(r"`(kvfabric [^`]+)`", text):
            found.setdefault(span.strip(), where)
        for block in blocks(doc):
            if block.lang not in ("bash", "sh", "console", ""):
                continue
            for raw in block.text.splitlines():
                line = re.sub(r"^uv run (--frozen )?", "", without_comment(raw.removeprefix("$ ")))
                if line.startswith("kvfabric "):
                    found.setdefault(line, f"{where}:{block.line}")
    return found


def expansions(command: str) -> list[list[str]]:
    """The argument lists a shown command stands for: ``a|b`` is each of them, ``[--x]`` is with it."""
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(command)[1:]]
    variants: list[list[str]] = [[]]
    for word in words:
        if word in ("...", "…"):
            break
        options = word.strip("[]").split("|") if re.fullmatch(r"\[?[\w-]+(\|[\w-]+)+\]?", word) else [word]
        variants = [[*v, o.strip("[]")] for v in variants for o in options]
    return variants


def parse(argv: list[str]) -> int:
    """Parse with the real CLI parser; the exit code argparse would give (0: parsed)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise AssertionError(f"kvfabric {' '.join(argv)}: {out.getvalue()}") from None
        return 0
    return 0


COMMANDS = kvfabric_commands()
# Not commands: a pattern, and the domain string of a hash (docs/cacheserver.md, "Namespaces in use").
GENERIC = {"kvfabric <subcommand> --help", "kvfabric bench ...", "kvfabric metrics label"}


def test_the_docs_show_the_commands_this_test_reads() -> None:
    # The extraction itself: the README's main commands are among what it found.
    for shown in (
        "kvfabric demo --keep",
        "kvfabric bench operator --json",
        "kvfabric cluster up --kubelets N",
    ):
        assert shown in COMMANDS, sorted(COMMANDS)
    assert len(COMMANDS) >= 40


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - GENERIC))
def test_every_kvfabric_command_shown_parses(command: str) -> None:
    for argv in expansions(command):
        subcommands = []
        for word in argv:
            if word.startswith("-"):
                break
            subcommands.append(word)
        parse([*subcommands, "--help"])  # the command exists
        if len(subcommands) < len(argv):
            parse(argv)  # and its options parse as shown


def test_a_wrong_command_fails_the_check() -> None:
    with pytest.raises(AssertionError, match="unrecognized arguments: --quik"):
        parse(["bench", "operator", "--quik"])
    with pytest.raises(AssertionError, match="invalid choice"):
        parse(["clustr", "--help"])


# --- kubectl -----------------------------------------------------------------------------------


def kubectl_lines() -> list[tuple[str, str]]:
    """``(line, where)`` of every kubectl command shown: in shell code blocks, in the order shown, then
    the inline ones that apply or create something (``kubectl apply -k manifests/default``)."""
    found = []
    for doc in DOCS:
        where = doc.relative_to(ROOT).as_posix()
        for block in blocks(doc):
            if block.lang not in ("bash", "sh"):
                continue
            for raw in block.text.splitlines():
                line = without_comment(raw)
                if line.startswith("kubectl "):
                    found.append((line, f"{where}:{block.line}"))
        for span in re.findall(r"`(kubectl (?:apply|create) [^`]+)`", doc.read_text()):
            if re.search(r" -[kf] | namespace \S", span):
                found.append((span, where))
    return found


def readme_files() -> dict[str, str]:
    """The README's YAML blocks that name their file in a first-line comment (``# pool.yaml``)."""
    files = {}
    for block in blocks(ROOT / "README.md"):
        first = block.text.splitlines()[0] if block.text else ""
        m = re.fullmatch(r"# (\S+\.yaml)", first)
        if block.lang == "yaml" and m:
            files[m.group(1)] = block.text
    return files


@pytest.fixture
def readme_tree(tmp_path: Path) -> Path:
    """A directory laid out as the README's reader has it: the checkout as ``kvfabric/`` beside
    ``my-kvfabric/`` (the image overlay), ``pool.yaml`` and ``vllm.yaml``."""
    (tmp_path / "kvfabric").symlink_to(ROOT, target_is_directory=True)
    for name, text in readme_files().items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return tmp_path


def k_paths() -> list[str]:
    return sorted({m for line, _ in kubectl_lines() for m in re.findall(r"-k (\S+)", line)})


def test_the_readme_files_and_k_paths_are_found() -> None:
    assert set(readme_files()) == {"my-kvfabric/kustomization.yaml", "pool.yaml", "vllm.yaml"}
    assert {"crds/", "manifests/default", "my-kvfabric"} <= set(k_paths())


def kubectl_binary() -> str:
    from kvfabric.localcluster import binaries

    return str(binaries.ensure(quiet=True) / "kubectl")


def kustomize(path: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [kubectl_binary(), "kustomize", str(path)], capture_output=True, text=True, check=False, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def where_shown(path: str, readme: Path) -> Path:
    """A path as the command shows it: the README's own files in its tree, the rest in the checkout."""
    own = path == "my-kvfabric" or path in readme_files()
    return readme / path if own else ROOT / path


@pytest.mark.process
@pytest.mark.parametrize("path", k_paths())
def test_every_k_path_shown_renders(path: str, readme_tree: Path) -> None:
    assert kustomize(where_shown(path, readme_tree))


def images_in(docs: list[dict[str, Any]]) -> Iterator[str]:
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            yield c["image"]
            yield from (e["value"] for e in c.get("env", []) if e["name"] == "KVFABRIC_OPERATOR_IMAGE")


@pytest.mark.process
def test_the_readme_overlay_moves_every_operator_image_to_the_registry(readme_tree: Path) -> None:
    rendered = kustomize(readme_tree / "my-kvfabric")
    images = sorted(images_in(rendered))
    kinds = {d["kind"] for d in rendered}
    assert {"CustomResourceDefinition", "Deployment", "DaemonSet", "CSIDriver"} <= kinds
    assert images == [f"{README_REGISTRY}/operator:v0.2.0"] * len(images)
    assert len(images) >= 3  # the operator, its KVFABRIC_OPERATOR_IMAGE, the CSI plugin


# --- the applies, against the real API server ------------------------------------------------------


def dry_run_args(line: str, readme: Path) -> list[str] | None:
    """The kubectl arguments of a shown apply or create, as a server-side dry run; None for others."""
    words = shlex.split(line)[1:]
    if not words or words[0] not in ("apply", "create"):
        return None
    out = []
    for i, word in enumerate(words):
        out.append(str(where_shown(word, readme)) if i and words[i - 1] in ("-k", "-f") else word)
    return [*out, "--dry-run=server"]


@pytest.mark.cluster
def test_every_apply_shown_passes_a_server_side_dry_run(cluster: ClusterHandle, readme_tree: Path) -> None:
    # A server-side dry run creates nothing: the CRD and the namespaces the commands use must exist.
    cluster.kubectl("apply", "--server-side", "--field-manager=kvfabric-tests", "-k", str(ROOT / "crds"))
    cluster.wait_crd_established("kvcachepools.kvfabric.io")
    # The monitoring overlay the operations guide applies needs the Prometheus Operator's CRDs, as a
    # cluster with the Prometheus Operator has them (this test must not rely on another test's install).
    for path in prometheus_operator_crds(quiet=True):
        kind = path.stem.removeprefix("monitoring.coreos.com_")
        if kind in ("podmonitors", "servicemonitors", "prometheusrules"):
            cluster.kubectl("apply", "--server-side", "--field-manager=kvfabric-tests", "-f", str(path))
            cluster.wait_crd_established(f"{kind}.monitoring.coreos.com")
    created = []
    for ns in ("kvfabric-system", "llm"):
        if cluster.kubectl("get", "namespace", ns, check=False).returncode:
            cluster.kubectl("create", "namespace", ns)
            created.append(ns)
    ran = []
    try:
        for line, where in kubectl_lines():
            args = dry_run_args(line, readme_tree)
            if args is None:
                continue
            if args[:2] == ["create", "namespace"]:
                args = ["create", "namespace", f"{args[2]}-dry-run", *args[3:]]  # it exists already
            result = cluster.kubectl(*args, check=False)
            assert result.returncode == 0, f"{where}: {line}\n{result.stderr}"
            ran.append(line)
    finally:
        for ns in created:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    assert {
        "kubectl apply -f pool.yaml",
        "kubectl apply -f vllm.yaml",
        "kubectl apply -k manifests/default",
    } <= set(ran)
