"""The index-socket readiness probe takes an engine's path: it fails whenever engines would be refused.

The probe asks for the table of ``health.PROBE_NAMESPACE`` (which the server counts as described) and
checks that a live table with a fresh heartbeat comes back. An answer that only proves the socket
parses requests (the old probe sent a malformed one) would stay "up" while every engine is refused.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.cacheserver import health
from kvfabric.cacheserver.transport.indexpub import IndexPublisher, IndexSocket, Peer


class Server:
    def __init__(self, where: Path) -> None:
        self.refuse = False
        self.pub = IndexPublisher(lambda bid: None, known=lambda ns: ns == health.PROBE_NAMESPACE)
        self.sock = IndexSocket(where / "i.sock", self.pub, authorize=self._authorize)
        self.pub.start()
        self.sock.start()

    def _authorize(self, namespace: str, peer: Peer) -> bool:
        return not self.refuse

    def close(self) -> None:
        self.sock.close()
        self.pub.close()


@pytest.fixture
def server() -> Iterator[Server]:
    where = Path(tempfile.mkdtemp(prefix="kvf-probe-", dir="/tmp"))
    srv = Server(where)
    yield srv
    srv.close()
    shutil.rmtree(where, ignore_errors=True)


def test_the_index_probe_is_up_only_while_the_socket_hands_out_tables(server: Server) -> None:
    probe = health.probe_index(server.sock.path)
    probe(2.0)  # a live table with a fresh heartbeat
    server.refuse = True  # every request refused, as engines would be
    with pytest.raises(health.ProbeFailedError, match="refuses a table: permission denied"):
        probe(2.0)
    server.refuse = False
    probe(2.0)


def test_a_bug_answering_one_request_closes_that_connection_and_the_socket_serves_on(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    # Any exception, not only an OSError, used to end the one loop that serves every engine's table.
    def broken(namespace: str, peer: Peer) -> bool:
        raise KeyError(namespace)

    probe = health.probe_index(server.sock.path)
    server.sock.authorize = broken
    with pytest.raises(health.ProbeFailedError):
        probe(2.0)
    server.sock.authorize = server._authorize
    probe(2.0)  # the loop is alive: the next request gets its table
    assert any("answering a request failed" in r.getMessage() for r in caplog.records)
