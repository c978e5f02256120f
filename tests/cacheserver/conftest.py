"""Fixtures for the cache-server tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvfabric.testing.s3server import S3Server, s3_server
from kvfabric.testing.serverproc import digest


@pytest.fixture
def ns() -> str:
    """A namespace digest."""
    return digest("namespace")


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) on loopback for the session; tests isolate by key prefix."""
    with s3_server() as srv:
        yield srv
