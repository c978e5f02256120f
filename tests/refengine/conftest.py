"""Fixtures of the reference-engine tests."""

from __future__ import annotations

import pytest

from kvfabric.refengine.model import RefModel
from kvfabric.refengine.testing import TINY


@pytest.fixture(scope="session")
def tiny_model() -> RefModel:
    """The tiny model, built once (weights depend only on the seed)."""
    return RefModel(TINY)
