"""Fixtures for the cache-server tests."""

from __future__ import annotations

import pytest

from kvfabric.testing.serverproc import digest


@pytest.fixture
def ns() -> str:
    """A namespace digest."""
    return digest("namespace")
