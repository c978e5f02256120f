"""The product wheel holds the product and nothing of the development harness."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # builds wheels with uv (test level, see kvfabric.testing.levels)

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = {
    "kvfabric.cli",
    "kvfabric.operator",
    "kvfabric.cacheserver",
    "kvfabric.rpc",
    "kvfabric.client",
    "kvfabric.connector",
    "kvfabric.contract",
    "kvfabric.csi",
}
HARNESS = {
    "kvfabric.localcluster",
    "kvfabric.refengine",
    "kvfabric.demo",
    "kvfabric.bench",
    "kvfabric.testing",
    "kvfabric.containers",
    "kvfabric.kind",
}


def _packages(wheel: Path) -> set[str]:
    names = zipfile.ZipFile(wheel).namelist()
    return {".".join(n.split("/")[:2]) for n in names if n.endswith(".py")}


def _build(tmp_path: Path, *args: str) -> list[Path]:
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH (scripts/bootstrap.sh installs it)")
    subprocess.run(
        [uv, "build", "--wheel", "--out-dir", str(tmp_path), *args], cwd=ROOT, check=True, capture_output=True
    )
    return sorted(tmp_path.glob("*.whl"))


def test_product_wheel_has_exactly_the_product(tmp_path: Path) -> None:
    (wheel,) = _build(tmp_path)
    assert wheel.name.startswith("kvfabric-")
    assert _packages(wheel) == PRODUCT
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("tests/", "e2e/", "harness/")) or "/testing" in n]
    assert not [n for n in names if n.endswith("__init__.py") and n.count("/") == 1], (
        "kvfabric stays a namespace"
    )


def test_harness_wheel_has_only_the_harness(tmp_path: Path) -> None:
    wheels = _build(tmp_path, "--package", "kvfabric-dev")
    (wheel,) = [w for w in wheels if w.name.startswith("kvfabric_dev-")]
    assert _packages(wheel) == HARNESS
    entry_points = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[kvfabric.commands]" in text
    for command in ("cluster", "engine", "bench", "demo"):
        assert f"{command} = " in text
