"""The previous release's code, from its git tag, for version-skew tests.

>>> tag = previous_release()                                      # doctest: +SKIP
>>> with release_tree(tag) as old:
...     cache_server(env={"PYTHONPATH": old.pythonpath})         # the previous release's server

A release is a ``v*`` tag. :func:`previous_release` is the newest one that HEAD contains and that is
not HEAD itself; :func:`release_tree` extracts that tag's product source roots (``git archive``) into a
temporary directory. Python code run with :attr:`ReleaseTree.pythonpath` imports the release's
``kvfabric`` packages instead of this checkout's: ``kvfabric`` is a namespace package, and
``PYTHONPATH`` entries come before the editable install's source roots, so every subpackage
(``kvfabric.cacheserver``, ``kvfabric.client``, ...) resolves to the release's copy. Third-party
dependencies come from the current environment.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["PRODUCT_ROOTS", "ReleaseTree", "previous_release", "release_tree", "repo_root"]

PRODUCT_ROOTS: Final = ("cacheserver", "connector", "operator")
"""The source roots of the product distribution (the harness is not part of a release)."""


@dataclass(frozen=True)
class ReleaseTree:
    """A release's source roots extracted into a directory."""

    tag: str
    root: Path

    @property
    def pythonpath(self) -> str:
        """``PYTHONPATH`` under which ``import kvfabric.…`` is the release's code."""
        return os.pathsep.join(str(self.root / r) for r in PRODUCT_ROOTS)


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def repo_root() -> Path:
    """The checkout this harness runs from."""
    return Path(_git("rev-parse", "--show-toplevel", cwd=Path(__file__).parent))


def previous_release(repo: Path | None = None) -> str | None:
    """The newest ``v*`` tag HEAD contains whose commit is not HEAD's (None when there is none)."""
    repo = repo or repo_root()
    head = _git("rev-parse", "HEAD", cwd=repo)
    for tag in _git("tag", "--merged", "HEAD", "--sort=-v:refname", "--list", "v*", cwd=repo).split():
        if _git("rev-parse", f"{tag}^{{commit}}", cwd=repo) != head:
            return tag
    return None


@contextlib.contextmanager
def release_tree(tag: str, repo: Path | None = None) -> Iterator[ReleaseTree]:
    """Extract ``tag``'s product source roots into a temporary directory, removed afterwards."""
    repo = repo or repo_root()
    with tempfile.TemporaryDirectory(prefix=f"kvf-{tag}-") as tmp:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", tag, *PRODUCT_ROOTS], cwd=repo, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield ReleaseTree(tag, Path(tmp))
