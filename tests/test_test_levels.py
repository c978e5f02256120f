"""Every test gets exactly one level of the test ladder (the plugin kvfabric.testing.levels)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.testing.levels import level_of


@pytest.mark.parametrize(
    ("explicit", "path", "fixtures", "expected"),
    [
        ([], "tests/x/test_a.py", [], "unit"),
        (["process"], "tests/x/test_a.py", [], "process"),
        (["process"], "tests/x/test_a.py", ["cluster"], "cluster"),
        ([], "e2e/test_fabric.py", ["cluster"], "fabric"),
        (["vllm"], "tests/vllm/test_v.py", [], "vllm"),
        (["kubelet"], "e2e/test_k.py", [], "kubelet"),
        (["images"], "tests/test_i.py", [], "images"),
    ],
)
def test_every_test_gets_the_most_expensive_level(
    explicit: list[str], path: str, fixtures: list[str], expected: str
) -> None:
    assert level_of(explicit, Path(path), fixtures) == expected
