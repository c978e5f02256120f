"""The block socket's descriptor handling under real faults (see docs/cacheserver.md, "Same node").

A client that stops reading its answers, a server out of descriptors, a client process that forks
while descriptors arrive, and a container runtime's low descriptor limit: each would otherwise hold
a connection (and its answer's descriptors) forever, stop the accept loop, leak blocks into child
processes, or cap the DRAM tier at about a thousand blocks.
"""

from __future__ import annotations

import os
import resource
import select
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.cacheserver.transport import blocksock
from kvfabric.client.blocks import BlockChannel
from kvfabric.rpc import blockproto as bp
from kvfabric.rpc import fdpass
from kvfabric.testing.serverproc import MiB, cache_server, wait_until

NAME = "d_" + "ab" * 16
PAYLOAD = b"block bytes" * 100


def _memfd() -> int:
    fd = os.memfd_create("test-block", os.MFD_CLOEXEC)
    os.write(fd, PAYLOAD)
    return fd


@pytest.fixture
def served(tmp_path: Path) -> Iterator[blocksock.BlockSocket]:
    block = _memfd()
    # The socket closes the descriptor it is given after sending it: hand it a duplicate each time.
    sock = blocksock.BlockSocket(tmp_path / "b.sock", lambda name: (os.dup(block), len(PAYLOAD)))
    sock.start()
    try:
        yield sock
    finally:
        sock.close()
        os.close(block)


def test_a_client_asking_again_before_reading_gets_one_answer_at_a_time_and_others_are_served(
    served: blocksock.BlockSocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Answers left unread would pile up in its socket, their descriptors charged to the server's user
    # by the kernel: its next request waits until it has read the last answer.
    monkeypatch.setattr(blocksock, "SEND_TIMEOUT_SECONDS", 3)
    greedy = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        greedy.connect(str(served.path))
        greedy.settimeout(5)
        for _ in range(4):
            greedy.send(bp.encode_request([NAME]))
        wait_until(lambda: served.unread_descriptors == 1, 5, what="the first answer")
        time.sleep(3 * blocksock.TICK_SECONDS)
        assert served.unread_descriptors == 1, "a second answer was sent before the first was read"
        # Meanwhile another client is served.
        with BlockChannel(served.path) as polite:
            (fd,) = polite.fetch([NAME], deadline=time.monotonic() + 5)
        assert fd is not None
        os.close(fd)
        for _ in range(2):  # read one, and the next comes
            msg, fds, _ = fdpass.recv_fds(greedy, 256, 1)
            assert (msg, len(fds)) == (bytes([bp.FOUND]), 1)
            os.close(fds[0])
        assert served.connections == 1
        # The third is never read, the fourth request waits: the connection is dropped after the
        # send timeout, and its answer's descriptor stays counted (in flight) until the client
        # hangs up.
        wait_until(lambda: served.connections == 0, 10, what="the greedy client to be dropped")
        assert served.unread_descriptors == 1
        greedy.close()
        wait_until(lambda: served.unread_descriptors == 0, 5, what="the hang-up to free the answer")
    finally:
        greedy.close()


def test_answers_not_received_are_bounded_and_counted_until_their_client_hangs_up(tmp_path: Path) -> None:
    block = _memfd()
    limits = blocksock.BlockLimits(max_unread_fds=128)
    server = blocksock.BlockSocket(
        tmp_path / "b.sock", lambda _: (os.dup(block), len(PAYLOAD)), limits=limits
    )
    server.start()
    names = [NAME] * bp.MAX_NAMES
    idle: list[socket.socket] = []
    try:
        # One uid (this process) may have half the bound unread at most: one answer of 64 here.
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(str(server.path))
            s.send(bp.encode_request(names))
            idle.append(s)
            assert select.select([s], [], [], 5)[0], "no answer"  # answered (and not read yet)
        wait_until(lambda: server.connections == 1, 5, what="the two refused closed")
        statuses = []
        for s in idle:
            s.settimeout(5)
            msg, fds, _ = fdpass.recv_fds(s, 256, bp.MAX_NAMES)
            statuses.append((msg[:1], len(fds)))
            for fd in fds:
                os.close(fd)
        assert sorted(statuses) == sorted(
            [(bytes([bp.FOUND]), 64), (bytes([bp.REFUSED]), 0), (bytes([bp.REFUSED]), 0)]
        )
        wait_until(lambda: server.unread_descriptors == 0, 5, what="the received answer to be uncounted")
        # A client that hangs up with an answer unread frees it (the kernel drops its queue).
        quitter = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        quitter.connect(str(server.path))
        quitter.send(bp.encode_request(names))
        wait_until(lambda: server.unread_descriptors == 64, 5, what="the answer to be sent")
        quitter.close()
        with BlockChannel(server.path) as polite:
            got = polite.fetch(names, deadline=time.monotonic() + 5)
        assert len(got) == 64
        for one in got:
            assert one is not None
            os.close(one)
    finally:
        for s in idle:
            s.close()
        server.close()
        os.close(block)


def test_received_descriptors_are_close_on_exec(served: blocksock.BlockSocket) -> None:
    with BlockChannel(served.path) as channel:
        (fd,) = channel.fetch([NAME], deadline=time.monotonic() + 5)
    assert fd is not None
    try:
        # A subprocess the engine starts (a compiler, a tokenizer server) must not inherit blocks.
        assert os.get_inheritable(fd) is False
        assert os.pread(fd, len(PAYLOAD), 0) == PAYLOAD
    finally:
        os.close(fd)


def test_fdpass_receives_every_descriptor_close_on_exec() -> None:
    # The helper both the block channel and the published-index reader use (the standard library's
    # recv_fds ignores MSG_CMSG_CLOEXEC in Python 3.11 and 3.12).
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sent = [_memfd(), _memfd()]
    try:
        socket.send_fds(a, [b"xy"], sent)
        msg, fds, flags = fdpass.recv_fds(b, 16, 4)
        assert (msg, len(fds), flags & socket.MSG_CTRUNC) == (b"xy", 2, 0)
        assert [os.get_inheritable(fd) for fd in fds] == [False, False]
        for fd in fds:
            os.close(fd)
    finally:
        for fd in sent:
            os.close(fd)
        a.close()
        b.close()


EMFILE_SCRIPT = textwrap.dedent(
    """
    import logging, os, resource, socket, sys, time
    from pathlib import Path
    from kvfabric.cacheserver.transport import blocksock
    from kvfabric.client.blocks import BlockChannel

    failures = []
    class Count(logging.Handler):
        def emit(self, record):
            if record.getMessage() == "block socket accept failed":
                failures.append(record)
    logging.getLogger(blocksock.__name__).addHandler(Count())

    block = os.memfd_create("b", os.MFD_CLOEXEC)
    os.write(block, b"x" * 10)
    path = Path(sys.argv[1])
    server = blocksock.BlockSocket(path, lambda name: (os.dup(block), 10))
    server.start()
    client = BlockChannel(path)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    # Every descriptor taken, save none: the server's accept fails with EMFILE.
    client_sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fillers = []
    while True:
        try:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            break
    client_sock.connect(str(path))   # queued in the backlog; accept() cannot take it
    time.sleep(0.5)
    for fd in fillers:
        os.close(fd)
    client_sock.close()
    # The accept loop survived: a fresh client is served.
    (fd,) = client.fetch(["d_" + "cd" * 16], deadline=time.monotonic() + 5)
    print(len(failures), os.pread(fd, 10, 0) == b"x" * 10)
    """
)


@pytest.mark.process
def test_the_accept_loop_survives_running_out_of_descriptors(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", EMFILE_SCRIPT, str(tmp_path / "b.sock")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    failures, served = out.stdout.split()
    assert int(failures) >= 1, "the fault was real: accept failed while descriptors ran out"
    assert served == "True"


@pytest.mark.process
def test_the_server_raises_its_descriptor_limit_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise to")
    # What a container runtime often gives: soft 1024. The server inherits it from this process.
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        with cache_server(dram_bytes=16 * MiB, start=False) as srv:
            srv.start()
            assert srv.proc is not None
            limits = Path(f"/proc/{srv.proc.pid}/limits").read_text()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    line = next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
    got_soft, got_hard = line.split()[3:5]
    assert got_soft == got_hard, line
