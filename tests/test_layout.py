"""The namespace-package layout never shadows the standard library's ``operator``."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("operator", "cacheserver", "connector", "harness")


def test_source_roots_are_not_packages() -> None:
    for root in SOURCE_ROOTS:
        assert not (ROOT / root / "__init__.py").exists(), f"{root}/__init__.py makes {root} a package"
        assert not (ROOT / root / "kvfabric" / "__init__.py").exists(), (
            "kvfabric must stay a namespace package"
        )


@pytest.mark.process
def test_stdlib_operator_is_the_stdlib_even_from_the_repo_root() -> None:
    code = "import operator, kvfabric.operator; print(operator.__file__); operator.add(1, 2)"
    for flags in ([], ["-S"]):
        out = subprocess.run(
            [sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
        )
        if flags and out.returncode != 0 and "kvfabric" in out.stderr:
            # With -S site-packages (and so the editable install) is off: kvfabric is not importable,
            # but the import of the stdlib module must still have worked first.
            out = subprocess.run(
                [sys.executable, *flags, "-c", "import operator; print(operator.__file__)"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.splitlines()[0]).parent == Path(sysconfig.get_paths()["stdlib"])


def test_kvfabric_portions_come_from_every_source_root() -> None:
    import kvfabric

    portions = {Path(p).parent.name for p in kvfabric.__path__}
    assert set(SOURCE_ROOTS) <= portions


@pytest.mark.process
def test_cli_lists_its_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "--help"], capture_output=True, text=True, check=True
    )
    for name in ("version", "cluster"):
        assert name in out.stdout


@pytest.mark.process
def test_version_command_prints_pins() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "version", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert '"kubernetes": "v1.36.3"' in out.stdout
