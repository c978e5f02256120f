"""The pod runner's port relay: a host loopback service reached at the same address inside a pod's netns."""

from __future__ import annotations

import http.server
import secrets
import subprocess
import threading
from collections.abc import Iterator

import pytest

from kvfabric.localcluster.podrunner.relay import PortRelay

pytestmark = pytest.mark.process


@pytest.fixture
def host_service() -> Iterator[tuple[int, bytes]]:
    """An HTTP server on the host's 127.0.0.1 answering a random body."""
    body = secrets.token_hex(8).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], body
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kvf-t{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _get_inside(ns: str, port: int) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "curl", "-sf", "-m", "5", f"http://127.0.0.1:{port}/"],
        capture_output=True,
        timeout=20,
        check=False,
    )


def test_a_relayed_port_reaches_the_host_service_and_nothing_else_does(
    host_service: tuple[int, bytes], netns: str
) -> None:
    port, body = host_service
    # A pod's namespace has loopback only: the host's service is not there.
    assert _get_inside(netns, port).returncode != 0
    relay = PortRelay(f"/var/run/netns/{netns}", (port,))
    try:
        for _ in range(3):  # several connections, each relayed
            got = _get_inside(netns, port)
            assert (got.returncode, got.stdout) == (0, body)
    finally:
        relay.close()
    assert _get_inside(netns, port).returncode != 0  # closed: gone again
