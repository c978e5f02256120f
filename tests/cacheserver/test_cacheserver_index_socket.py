"""The index socket of a real server process under a busy node and hostile same-node clients.

* More than 1,024 descriptors open in the server (every DRAM block is a memfd): tables are still
  handed out, hung-up clients leave no descriptor behind, and an idle server burns no CPU.
* Made-up namespaces, asked for by the thousand, create no table and no descriptor; described ones
  are bounded; an engine whose namespace holds blocks still gets its table.
* A client that trickles its request a byte at a time delays no other client.
* Processes hoarding held connections past every bound cannot keep an engine from its table; the
  readiness probe takes the engine's path.
* Blocks stored under a table's worth of made-up namespaces cannot either, and a table made again
  lists every block its namespace holds.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.cacheserver import health
from kvfabric.cacheserver.transport import indexpub
from kvfabric.client import CacheClient
from kvfabric.contract.namespace import KEY_SCHEME_VERSION, canonical, namespace_digest
from kvfabric.rpc import indextable as it
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]


def index_path(srv: ServerProcess) -> str:
    return str(it.index_socket_for(srv.config.listen.unix_socket.absolute()))


def pid_of(srv: ServerProcess) -> int:
    assert srv.proc is not None
    return srv.proc.pid


def open_fds(pid: int) -> list[int]:
    """The descriptor numbers the process holds open."""
    return sorted(int(n) for n in os.listdir(f"/proc/{pid}/fd"))


def settled_fds(pid: int) -> int:
    """Descriptors the process holds, not counting transient ones: the fewest seen over 1.2 s.

    The server probes its own listeners once a second (``kvfabric.cacheserver.health``): each probe
    holds a few descriptors for a moment.
    """
    end = time.monotonic() + 1.2
    fewest = len(open_fds(pid))
    while time.monotonic() < end:
        time.sleep(0.02)
        fewest = min(fewest, len(open_fds(pid)))
    return fewest


def index_fds(pid: int, path: str) -> int:
    """Descriptors of the process that belong to the index socket: its connections and its tables.

    A connection the listener accepted is bound to the listener's name (``/proc/net/unix`` shows it),
    so the count leaves out what the server's other listeners, probes and clients hold meanwhile.
    """
    bound = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            # The listener is bound under a unique name and renamed into place.
            if len(fields) >= 8 and (fields[7] == path or fields[7].startswith(path + ".")):
                bound.add(f"socket:[{fields[6]}]")
    return sum(link in bound or link.startswith("/memfd:kvfabric-index") for link in fd_links(pid))


def settled_index_fds(pid: int, path: str) -> int:
    """:func:`index_fds`, the fewest seen over 1.2 s (a connection being closed is not kept)."""
    end = time.monotonic() + 1.2
    fewest = index_fds(pid, path)
    while time.monotonic() < end:
        time.sleep(0.02)
        fewest = min(fewest, index_fds(pid, path))
    return fewest


def fd_links(pid: int) -> list[str]:
    """What each open descriptor of the process is (``/proc/<pid>/fd`` links; gone ones skipped)."""
    out = []
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{n}"))
        except FileNotFoundError:
            continue
    return out


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of the process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request(path: str, namespace: str, *, timeout: float = 5.0) -> tuple[socket.socket, bytes, list[int]]:
    """Ask for ``namespace``'s table: (the connection, the answer's bytes, descriptors received)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    s.sendall(it.REQUEST_PREFIX + namespace.encode() + b"\n")
    msg, fds, _, _ = socket.recv_fds(s, 128, 1)
    return s, msg, fds


def got_table(path: str, namespace: str) -> bool:
    s, msg, fds = request(path, namespace)
    for fd in fds:
        os.close(fd)
    s.close()
    return msg[:1] == b"\x00" and len(fds) == 1


def describe(c: CacheClient, model: str) -> str:
    doc: dict[str, str | int] = {"scheme": KEY_SCHEME_VERSION, "model_id": model}
    ns = namespace_digest(doc)
    c.describe(ns, canonical(doc).decode(), timeout=5)
    return ns


@pytest.fixture
def busy_server() -> Iterator[ServerProcess]:
    with cache_server(
        server_id="busy", dram_bytes=64 * MiB, local_disk_bytes=None, tcp=False, metrics=False
    ) as srv:
        yield srv


def test_tables_are_served_with_more_than_1024_descriptors_open_and_hung_up_clients_leak_nothing(
    busy_server: ServerProcess,
) -> None:
    srv, pid = busy_server, pid_of(busy_server)
    ns = digest("busy")
    keys = [digest("b", i) for i in range(1100)]
    with CacheClient(srv.unix_target) as c:
        for i in range(0, len(keys), 50):
            batch = keys[i : i + 50]
            assert c.store(ns, batch, [payload_for(k, 4096) for k in batch], timeout=30).accepted == len(
                batch
            )
    fds = open_fds(pid)
    assert len(fds) > 1100, "every DRAM block is an open memfd"
    assert fds[-1] >= 1100
    path = index_path(srv)
    # A client hung up before asking, one asks and hangs up: 100 of each; and as many holding their
    # table as one process may hold (this one).
    before = settled_fds(pid)
    for _ in range(100):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.close()
        assert got_table(path, ns)
    holding = indexpub.MAX_CONNECTIONS_PER_PEER
    held = [request(path, ns) for _ in range(holding)]
    for _, msg, fds_ in held:
        assert msg == it.REPORTS_ACCEPTED
        assert len(fds_) == 1
        os.close(fds_[0])
    wait_until(
        lambda: len(open_fds(pid)) == before + holding, 10, 0.01, what="one descriptor per held connection"
    )
    for s, _, _ in held:
        s.close()
    wait_until(lambda: len(open_fds(pid)) == before, 10, 0.01, what="hung-up connections closed")
    # Idle, the server does not spin (select() on a descriptor >= 1024 used to fail in a loop).
    used = cpu_seconds(pid)
    time.sleep(1.0)
    assert cpu_seconds(pid) - used < 0.2
    assert got_table(path, ns)


def test_made_up_namespaces_create_no_table_and_engines_still_get_theirs(busy_server: ServerProcess) -> None:
    srv, pid = busy_server, pid_of(busy_server)
    path = index_path(srv)
    real = digest("real-engine")
    with CacheClient(srv.unix_target) as c:
        c.store(real, [digest("r")], [payload_for(digest("r"), 4096)], timeout=10)
        before, before_index = settled_fds(pid), settled_index_fds(pid, path)
        # Made up, never described, holding no block: refused, nothing created, nothing kept.
        for i in range(2000):
            s, msg, fds = request(path, digest("made-up", i))
            assert (msg, fds) == (b"\x04unknown namespace\n", [])
            s.close()
        # Counted on the index socket's own descriptors: the server's other listeners and probes
        # open and close theirs meanwhile. A descriptor kept would stay; one still closing goes.
        wait_until(
            lambda: settled_index_fds(pid, path) <= before_index,
            20,
            0.1,
            what="no descriptor kept for made-up namespaces",
        )
        # Described (anyone on the node may describe anything), asked for and held open: bounded.
        held = []
        for i in range(indexpub.MAX_TABLES + 40):
            ns = describe(c, f"made-up-{i}")
            s, msg, fds = request(path, ns)
            for fd in fds:
                os.close(fd)
            held.append(s)
        # Each table is a memfd the server keeps twice (its own descriptor and the mapping's).
        tables = sum(link.startswith("/memfd:kvfabric-index") for link in fd_links(pid)) // 2
        assert tables <= indexpub.MAX_TABLES + 8  # + the retired tables growth keeps for readers
        wait_until(
            lambda: settled_fds(pid) <= before + 2 * tables + len(held), 20, 0.1, what="descriptors bounded"
        )
        # The engine whose namespace holds blocks outranks every empty table, held or not.
        assert got_table(path, real)
        # So does one that stores its first block now.
        late = digest("late-engine")
        c.store(late, [digest("l")], [payload_for(digest("l"), 4096)], timeout=10)
        assert got_table(path, late)
        for s in held:
            s.close()


def test_a_trickling_client_delays_no_other(busy_server: ServerProcess) -> None:
    srv = busy_server
    path = index_path(srv)
    ns = digest("prompt")
    with CacheClient(srv.unix_target) as c:
        c.store(ns, [digest("p")], [payload_for(digest("p"), 4096)], timeout=10)
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(path)
    request_bytes = it.REQUEST_PREFIX + ns.encode() + b"\n"
    poller = select.poll()
    poller.register(slow, select.POLLIN | select.POLLHUP)
    try:
        slow.send(request_bytes[:1])
        time.sleep(0.1)
        slow.send(request_bytes[1:2])
        # The trickler has not finished (nor been cut off): another client is served meanwhile.
        s, msg, fds = request(path, ns, timeout=10)
        assert poller.poll(0) == [], "the trickling client was still connected when the other was served"
        assert msg == it.REPORTS_ACCEPTED
        assert len(fds) == 1
        os.close(fds[0])
        s.close()
        # The trickler's whole request has a deadline from its accept: it is cut off long before it
        # could finish at a byte every 0.3 s (it needs ~70 bytes).
        sent = 2
        while sent < len(request_bytes) and not poller.poll(0):
            time.sleep(0.3)
            try:
                slow.send(request_bytes[sent : sent + 1])
            except OSError:
                break
            sent += 1
        assert sent < 10, f"the server read {sent} trickled bytes before closing"
    finally:
        slow.close()


HOG = """
import os, select, socket, sys
path, ns, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b"KVIX1 " + ns.encode() + b"\\n")
    msg, fds, _, _ = socket.recv_fds(s, 128, 1)
    for fd in fds:
        os.close(fd)
    (held.append(s) if msg[:1] == b"\\x00" else s.close())
print(len(held), flush=True)
sys.stdin.readline()
open_, evicted = 0, 0
for s in held:
    if not select.select([s], [], [], 0)[0]:
        open_ += 1
    elif s.recv(64, socket.MSG_PEEK) == b"\\x06evicted\\n":
        evicted += 1
print(open_, evicted, flush=True)
"""


def table_lists(fd: int, keys: list[str]) -> list[int]:
    """The tier codes the table behind ``fd`` gives ``keys`` (its leading present ones)."""
    size = os.fstat(fd).st_size
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mp:
        words = memoryview(mp).cast("Q")
        try:
            assert words[it.W_STATE] == it.LIVE
            return it.lookup_prefix(words, it.fingerprints(keys))
        finally:
            words.release()


def test_processes_hoarding_held_connections_cannot_keep_an_engine_from_its_table(
    busy_server: ServerProcess,
) -> None:
    srv, path = busy_server, index_path(busy_server)
    real = digest("real-engine")
    cap, per_peer = indexpub.MAX_CONNECTIONS, indexpub.MAX_CONNECTIONS_PER_PEER
    with CacheClient(srv.unix_target) as c:
        c.store(real, [digest("r")], [payload_for(digest("r"), 4096)], timeout=10)
        hog_ns = describe(c, "hog")  # described once: every hog may ask for its table
    # More processes than the total bound divides into, each asking past its own bound: 1,296 tries.
    hogs = []
    try:
        for _ in range(cap // per_peer + 2):
            hog = subprocess.Popen(
                [sys.executable, "-c", HOG, path, hog_ns, str(per_peer + 8)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            hogs.append(hog)
            assert hog.stdout is not None
            hog.stdout.readline()  # its requests were answered (one hog after another: all hold at once)
        # Every held place is taken by the hogs, yet an engine asking is served, and so is the probe.
        s, msg, fds = request(path, real)
        try:
            assert msg == it.REPORTS_ACCEPTED, f"the engine was refused: {msg!r}"
            assert len(fds) == 1
            assert table_lists(fds[0], [digest("r")]) == [it.TIER_CODES["dram"]]
        finally:
            for fd in fds:
                os.close(fd)
        health.probe_index(Path(path))(5.0)
        # The hogs together hold no more than the total bound less the engine's, each no more than its own.
        outcomes = []
        for hog in hogs:
            out, _ = hog.communicate("\n", timeout=30)
            opened, evicted = map(int, out.split())
            outcomes.append((opened, evicted))
        assert all(opened <= per_peer for opened, _ in outcomes), outcomes
        assert sum(opened for opened, _ in outcomes) <= cap - 1, outcomes
        assert sum(evicted for _, evicted in outcomes) > 0  # told, not hung up on
        # The engine's held connection was never the one to go: it holds one, the hogs 64 each.
        assert select.select([s], [], [], 0)[0] == []
        s.close()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_blocks_under_a_tables_worth_of_made_up_namespaces_keep_no_engine_from_its_table(
    busy_server: ServerProcess,
) -> None:
    srv, path = busy_server, index_path(busy_server)
    made_up = [digest("made-up", i) for i in range(indexpub.MAX_TABLES)]
    with CacheClient(srv.unix_target) as c:
        for i, ns in enumerate(made_up):  # one 4 KiB block each: every table place lists blocks
            key = digest("m", i)
            assert c.store(ns, [key], [payload_for(key, 4096)], timeout=10).accepted == 1
        # An engine whose namespace was described (empty), and one that stored before asking.
        described = describe(c, "engine-model")
        stored = digest("engine-with-blocks")
        keys = [digest("e", i) for i in range(3)]
        assert c.store(stored, keys, [payload_for(k, 4096) for k in keys], timeout=10).accepted == 3
    assert got_table(path, described), "an engine that asks for its described namespace gets a table"
    s, msg, fds = request(path, stored)
    assert msg == it.REPORTS_ACCEPTED, f"refused: {msg!r}"
    # Its table lists the blocks stored while it had none: no false negative.
    assert table_lists(fds[0], keys) == [it.TIER_CODES["dram"]] * 3
    os.close(fds[0])
    s.close()
    # A made-up namespace evicted meanwhile lists its block again when asked for: nothing was lost.
    for i, ns in enumerate(made_up[:4]):
        s, msg, fds = request(path, ns)
        assert msg == it.REPORTS_ACCEPTED
        assert table_lists(fds[0], [digest("m", i)]) == [it.TIER_CODES["dram"]]
        os.close(fds[0])
        s.close()


def _metric(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples carrying ``label`` (e.g. ``reason="rate"``) in an exposition."""
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and label in sample:
            total += float(value)
    return total


def test_forged_lookup_reports_are_dropped_counted_and_bounded_by_what_rpc_could_look_up() -> None:
    """A process holding a table may claim only what it could have looked up: each line at most
    ``max_keys_per_request`` keys per lookup, all lines at most the connection's rate budget."""
    import urllib.request

    limit = 64  # limits.max_keys_per_request: what one RPC lookup may ask for
    with cache_server(
        dram_bytes=8 * MiB, local_disk_bytes=None, tcp=False, overrides={"limits.max_keys_per_request": limit}
    ) as srv:
        with CacheClient(srv.unix_target) as c:
            ns = describe(c, "reporting-model")
        s, msg, fds = request(index_path(srv), ns)
        assert msg == it.REPORTS_ACCEPTED
        os.close(fds[0])
        lines = [
            it.encode_report(0, (1 << 48) - 1, 0),  # no lookups, 2^48 hits
            it.encode_report(1, limit + 1, 0),  # more keys than one lookup may ask for
            it.encode_report(1_000_000, 0, 1_000_000),  # more lookups than any second's budget
            it.encode_report(2, 3, limit * 2 - 3),  # plausible, within the budget: counted
        ]
        s.sendall(b"".join(lines))

        def scrape() -> str:
            with urllib.request.urlopen(f"{srv.metrics_url}/metrics", timeout=10) as r:
                return str(r.read().decode())

        dropped = "kvfabric_cache_lookup_reports_dropped_total"
        wait_until(lambda: _metric(scrape(), "kvfabric_cache_lookups_total") == 2, what="the good line")
        text = scrape()
        assert _metric(text, dropped, 'reason="implausible"') == 2
        assert _metric(text, dropped, 'reason="rate"') == 1
        assert _metric(text, "kvfabric_cache_lookup_keys_total", 'result="hit"') == 3
        assert _metric(text, "kvfabric_cache_lookup_keys_total", 'result="miss"') == limit * 2 - 3
        s.sendall(it.encode_report(1, 1, 0))  # the connection is kept: it still reports
        wait_until(lambda: _metric(scrape(), "kvfabric_cache_lookups_total") == 3, what="a later line")
        s.close()
