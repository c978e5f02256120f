"""The residency feed client never breaks its caller: a hung server or no descriptors is a lost feed.

A server that stops reading leaves the client's outbound metadata bounded and the feed lost (the
caller reconnects later); out of descriptors is an unavailable feed, not a bare OSError; one read
parses a bounded number of bytes however much arrived.
"""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.residency import MAX_OUTBOUND, MAX_READ_PER_CALL, ResidencyFeedClient
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import frame
from kvfabric.testing.serverproc import digest, temp_dir

NS = digest("client-residency")


@pytest.fixture
def silent_server() -> Iterator[tuple[Path, list[socket.socket]]]:
    """A feed socket that accepts and then never reads (a hung server)."""
    with temp_dir() as d:
        path = Path(d) / "feed.residency"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(4)
        accepted: list[socket.socket] = []
        t = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
        t.start()
        yield path, accepted
        t.join(timeout=5)
        for s in accepted:
            s.close()
        listener.close()


def test_a_server_that_stops_reading_bounds_the_client_and_loses_the_feed(
    silent_server: tuple[Path, list[socket.socket]],
) -> None:
    path, _ = silent_server
    client = ResidencyFeedClient(path, NS)
    meta = ChunkMeta((b"h" * 32,), None, tuple(range(4096)), 4096)  # ~16 KiB
    lost: CacheUnavailable | None = None
    for i in range(2 * MAX_OUTBOUND // (16 << 10)):
        try:
            client.describe(digest("k", i), meta)
        except CacheUnavailable as exc:
            lost = exc
            break
        assert len(client._out) <= MAX_OUTBOUND + (32 << 10)
    assert lost is not None
    assert "lost" in str(lost)
    with pytest.raises(CacheUnavailable):
        client.read(0.0)
    client.close()


def test_out_of_descriptors_is_an_unavailable_feed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def emfile(*args: object, **kwargs: object) -> socket.socket:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(socket, "socket", emfile)  # the module calls socket.socket(...)
    with pytest.raises(CacheUnavailable, match="Too many open files"):
        ResidencyFeedClient(tmp_path / "feed.residency", NS)


def test_one_read_parses_a_bounded_number_of_bytes(silent_server: tuple[Path, list[socket.socket]]) -> None:
    path, accepted = silent_server
    client = ResidencyFeedClient(path, NS)
    while not accepted:
        threading.Event().wait(0.01)
    server = accepted[0]
    one = frame(["stored", digest("k"), "dram", bytes(60_000)])
    n = 3 * MAX_READ_PER_CALL // len(one)
    sender = threading.Thread(target=lambda: server.sendall(one * n), daemon=True)
    sender.start()
    got: list[object] = []
    reads = 0
    while len(got) < n:
        batch = client.read(1.0)
        assert len(batch) * len(one) <= MAX_READ_PER_CALL + len(one)
        got += batch
        reads += 1
    assert len(got) == n
    assert reads >= 3
    sender.join(timeout=10)
    client.close()
