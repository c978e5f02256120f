"""A leader whose connection to the API server stalls steps down before another replica takes over.

Two operator replicas on the real control plane; the leader reaches the API server through a TCP
proxy that, on request, stops forwarding bytes in both directions (connections stay open, requests
hang: a partition, not a refusal). The leader must stop leading by its renew deadline (7 s after its
last successful renewal began), before the standby may take the Lease (10 s after it last saw the
record change): never two leaders. Before the bound, the stalled leader went on until its HTTP
client's 30 s timeout, for about 20 s beside the new one.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tests.operator.test_operator_cluster_ha import Replica, holder

from kvfabric.localcluster.testing import ClusterHandle, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


class StallingProxy:
    """A TCP proxy to ``upstream`` that holds every byte while ``stalled``."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.flowing = threading.Event()
        self.flowing.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self._closing = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                while not self.flowing.wait(0.1):
                    if self._closing:
                        return
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closing = True
        self.flowing.set()
        self.listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()


class LogWatch:
    """Notes the moment (monotonic) each pattern first appears in a growing log file after ``arm``."""

    def __init__(self, path: Path, patterns: list[str]) -> None:
        self.path = path
        self.patterns = patterns
        self.seen: dict[str, float] = {}
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def arm(self) -> None:
        """Watch only what is written from now on."""
        self._offset = self.path.stat().st_size
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with self.path.open("rb") as f:
                f.seek(self._offset)
                text = f.read().decode(errors="replace")
            now = time.monotonic()
            for pattern in self.patterns:
                if pattern in text and pattern not in self.seen:
                    self.seen[pattern] = now

    def stop(self) -> None:
        self._stop.set()


@pytest.fixture
def stalled_pair(
    cluster: ClusterHandle, crd: None, namespace: str, tmp_path: Path
) -> Iterator[tuple[Replica, Replica, StallingProxy, str]]:
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    server = config["clusters"][0]["cluster"]["server"]
    host, port = server.removeprefix("https://").rsplit(":", 1)
    proxy = StallingProxy((host, int(port)))
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    proxied = tmp_path / "proxied.kubeconfig"
    proxied.write_text(yaml.safe_dump(config))
    lease = f"kvfabric-{uuid.uuid4().hex[:6]}"
    a = Replica(cluster, tmp_path / "a", "replica-a", namespace, lease, register=True)
    a.kubeconfig = proxied
    b = Replica(cluster, tmp_path / "b", "replica-b", namespace, lease, register=False)
    b.config_name = a.config_name
    for r in (a, b):
        r.workdir.mkdir()
    try:
        a.start()
        wait_for(lambda: holder(cluster, namespace, lease) == "replica-a", timeout=30, message="a leads")
        b.start()
        yield a, b, proxy, lease
    finally:
        proxy.flowing.set()
        for r in (a, b):
            r.stop(kill=True)
            print(f"--- {r.identity} log ---\n{r.tail(30)}")
        proxy.close()
        cluster.kubectl(
            "delete", "mutatingwebhookconfiguration", a.config_name, "--ignore-not-found", check=False
        )


def test_a_stalled_leader_steps_down_before_the_standby_takes_over(
    cluster: ClusterHandle, namespace: str, stalled_pair: tuple[Replica, Replica, StallingProxy, str]
) -> None:
    a, b, proxy, lease = stalled_pair
    wait_for(lambda: b.probes().get("leader") is False, timeout=30, message="b is a standby")
    time.sleep(4)  # a renews at least once through the proxy
    a_stops = LogWatch(a.log_path, ["replica-a stops leading", "replica-a lost the lease"])
    b_leads = LogWatch(b.log_path, ["replica-b leads"])
    a_stops.arm()
    b_leads.arm()
    stalled = time.monotonic()
    proxy.flowing.clear()
    try:
        wait_for(
            lambda: holder(cluster, namespace, lease) == "replica-b", timeout=45, message="b takes the lease"
        )
        wait_for(lambda: "replica-b leads" in b_leads.seen, timeout=10, message="b logs that it leads")
        # Give a stalled leader that did not step down time to show it (its client gives up at 30 s).
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and not a_stops.seen:
            time.sleep(0.1)
    finally:
        a_stops.stop()
        b_leads.stop()
    assert a_stops.seen, "the stalled leader never stepped down"
    a_stopped = min(a_stops.seen.values())
    b_started = b_leads.seen["replica-b leads"]
    print(
        f"stalled at 0 s: a stopped leading at {a_stopped - stalled:.1f} s, "
        f"b started at {b_started - stalled:.1f} s"
    )
    assert a_stopped < b_started, "two replicas led at once"
    # Renewed at most 3 s (the renew period) before the stall, stopped 7 s after that renewal began.
    assert a_stopped - stalled <= 7 + 1.0
