"""A credential rotation never pairs one channel with another channel's token.

The client rebuilds its channel when a credential file changes (a Secret volume the kubelet
updates). A call that races the rebuild must go out either on the old channel with the old token or
on the new channel with the new one: a server that has rotated to the new token (and a channel that
presents the new certificate) would otherwise refuse a call that mixes them, for no reason but
timing. The race is made deterministic here: the fake stub rotates the credentials at the very
moment a call looks up its method, which is between the client's reads of stub and token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvfabric.client import CacheClient
from kvfabric.rpc.v1 import cache_pb2_grpc


class _Reply:
    json = "{}"


def test_a_call_during_a_rotation_carries_the_token_of_its_own_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("old-token")
    calls: list[tuple[str, str | None]] = []
    client: CacheClient | None = None

    def rotate() -> None:
        new = tmp_path / "token.new"
        new.write_text("new-token")
        os.replace(new, token_file)  # a new inode, as the kubelet's symlink swap gives
        assert client is not None
        client._next_check = 0.0  # due now, not in a second
        client._refresh_credentials()

    class FakeStub:
        """Knows the token that was current when its channel was built."""

        def __init__(self, _channel: object) -> None:
            self.token = token_file.read_text()
            self.rotate_on_next_lookup = True

        def __getattr__(self, method: str) -> Any:
            if self.rotate_on_next_lookup:
                self.rotate_on_next_lookup = False
                rotate()

            def call(_req: object, *, timeout: float, metadata: Any = None) -> _Reply:
                sent = dict(metadata or ()).get("authorization")
                calls.append((f"Bearer {self.token}", sent))
                return _Reply()

            return call

    monkeypatch.setattr(cache_pb2_grpc, "CacheStub", FakeStub)  # the module sync.py calls
    client = CacheClient("unix:///nonexistent/cache.sock", token_file=token_file, shared_memory=False)
    try:
        client.stats(timeout=1.0)  # rotates while looking up Stats on the old stub
        client.stats(timeout=1.0)  # the new stub (which rotates once more; it has nothing new)
    finally:
        client.close()
    assert calls[0] == ("Bearer old-token", "Bearer old-token"), "the old channel with the old token"
    assert calls[1] == ("Bearer new-token", "Bearer new-token"), "and then the new with the new"
