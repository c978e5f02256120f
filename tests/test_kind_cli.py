"""``kvfabric kind`` leaves the host as it found it: the ``/lib/modules`` Docker creates for kind's bind."""

from __future__ import annotations

from pathlib import Path

from kvfabric.kind.cli import host_lib_modules


def test_an_empty_lib_modules_created_during_the_run_is_removed(tmp_path: Path) -> None:
    modules = tmp_path / "modules"
    with host_lib_modules(modules):
        modules.mkdir()  # what Docker does for kind's read-only bind of /lib/modules
    assert not modules.exists()


def test_a_lib_modules_that_was_there_or_holds_anything_is_kept(tmp_path: Path) -> None:
    there = tmp_path / "there"
    there.mkdir()
    with host_lib_modules(there):
        pass
    assert there.is_dir()
    filled = tmp_path / "filled"
    with host_lib_modules(filled):
        filled.mkdir()
        (filled / "6.18.44").mkdir()  # someone installed modules meanwhile: not ours to remove
    assert (filled / "6.18.44").is_dir()
