"""Fixtures for the cache-server tests."""

from __future__ import annotations

import pytest

from kvfabric.cacheserver.testing import digest


@pytest.fixture
def ns() -> str:
    """A namespace digest."""
    return digest("namespace")
