"""The client half of the block socket: trade handle names for memfd descriptors, copy through them.

The server names blocks and staging memfds on its gRPC socket (``ShmLoad``, ``ShmStoreBegin``); a
:class:`BlockChannel` sends the names on the block socket (:mod:`kvfabric.rpc.blockproto`) and gets
descriptors back. A load's descriptor is a sealed memfd: it cannot be written, resized or mapped
writable by this process, so a copy straight out of a read-only mapping is safe (never SIGBUS).
One connection per client, opened on first use and again after the server restarted or closed it
(an idle connection makes room for a newcomer at the server's connection bound): a request that
meets a closed connection is sent once more on a fresh one, so a closed connection costs a reconnect,
never a failed load. Requests are tiny and serialized under a lock. The blocks a load names together
(one ``ShmLoad`` message) that are not mapped here yet are fetched in one request of up to
:data:`~kvfabric.rpc.blockproto.MAX_NAMES` names, not one each (:class:`_Ahead`). Each request names
the client (its gRPC ``kvfabric-client`` id), so the server budgets its holds and connections per
client; a server too old to know ids is asked again without one, until the next reconnect.
With a :class:`~kvfabric.client.suspicion.ReplyClock`, a fetch's answer not there within its reply
bound fails the request at once as :class:`~kvfabric.client.errors.CacheSuspect` (milliseconds, not
the load's deadline), and the connection is closed: a late answer is never read as another request's.

Same-node stores go through the same kind of connection (:meth:`BlockChannel.store_begin`,
:meth:`BlockChannel.store_end`): the begin's answer carries the writable staging memfds, so a store
is two exchanges here and no gRPC call. A server that serves no stores on the socket (older) is
stored to over gRPC instead, until the next reconnect. Stores wait for their deadline, not the reply
bound (a begin may allocate pages: milliseconds per MiB).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from kvfabric.client import errors
from kvfabric.client.mappings import Lease, MappingCache, charged
from kvfabric.client.suspicion import ReplyClock
from kvfabric.rpc import blockproto as bp
from kvfabric.rpc import fdpass

__all__ = ["BlockChannel", "BlockRef", "close_all", "copy_into", "read_all", "write_all"]

_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

Fetched = tuple[int | None, bool, int]
"""A block fetched on a hold request: ``(descriptor or None if gone, held, the mappings' epoch)``."""


class BlockRef(NamedTuple):
    """A block a load named: its handle name, its payload's length, and what it is the payload of.

    ``key`` (namespace and key, any stable string) lets a kept mapping of the key's older block go
    as soon as the key names a new one (:meth:`MappingCache.named`).
    """

    name: str
    length: int
    key: str | None = None


class BlockChannel:
    """A connection to a server's block socket (thread-safe, reconnects after a hang-up).

    With ``mapping_budget`` bytes, loaded blocks are held and their mappings kept across loads
    (:mod:`kvfabric.client.mappings`); 0 maps each block afresh per load.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mapping_budget: int = 0,
        client_id: str | None = None,
        clock: ReplyClock | None = None,
    ) -> None:
        self.path = Path(path)
        self.client_id = client_id
        self.clock = clock
        """Bounds the wait for each answer (None: only the request's deadline does)."""
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._maps = MappingCache(mapping_budget) if mapping_budget > 0 else None
        self._holds_refused = False  # the server answering now knows no hold requests (older)
        self._id_refused = False  # the server answering now knows no client ids (older)
        self._stores_refused = False  # the server answering now serves no stores here (older)

    @property
    def maps(self) -> MappingCache | None:
        """The kept mappings; None when none are kept (no budget, or a server that knows no holds)."""
        return None if self._holds_refused else self._maps

    def copy_block(
        self, name: str, length: int, target: memoryview, *, deadline: float, key: str | None = None
    ) -> bool:
        """Copy the loaded block ``name`` into ``target`` (one copy); False if it is gone.

        See :meth:`copy_blocks`; ``key`` identifies what the block is the payload of.
        """
        return self.copy_blocks([BlockRef(name, length, key)], [target], deadline=deadline) == 1

    def copy_blocks(self, refs: Sequence[BlockRef], targets: Sequence[memoryview], *, deadline: float) -> int:
        """Copy the leading blocks of ``refs`` into ``targets`` (one copy each); how many were copied.

        Stops at the first block that is gone (the blocks before it are copied). A kept mapping
        serves a block without any request; the others are fetched together (held, when mappings
        are kept), one request for up to :data:`~kvfabric.rpc.blockproto.MAX_NAMES` of them, and
        each one's mapping kept if the server let this client hold it.
        """
        ahead = _Ahead(self, refs, deadline, hold=True)
        done = 0
        try:
            for i, target in enumerate(targets[: len(refs)]):
                if not self._copy_one(ahead, i, target):
                    break
                done += 1
        finally:
            ahead.close()
        return done

    def _copy_one(self, ahead: _Ahead, i: int, target: memoryview) -> bool:
        name, length, key = ahead.refs[i]
        maps = self.maps
        if maps is not None and length:
            if key is not None:
                maps.named(key, name)
            if maps.copy(name, length, target):
                return True
            got = ahead.held(i)
            if got is not None:
                return self._copy_held(maps, name, length, target, key=key, fetched=got)
        fd = ahead.plain(i)
        if fd is None:
            return False
        copy_into(fd, length, target, name)
        return True

    def borrow_block(
        self, name: str, length: int, *, deadline: float, key: str | None = None
    ) -> Lease | None:
        """Lend the loaded block ``name``'s bytes, read-only, until the lease is released; None if gone.

        See :meth:`borrow_blocks`.
        """
        got = self.borrow_blocks([BlockRef(name, length, key)], deadline=deadline)
        return got[0] if got else None

    def borrow_blocks(self, refs: Sequence[BlockRef], *, deadline: float) -> list[Lease]:
        """Lend the leading blocks of ``refs``, read-only and in order, up to the first that is gone.

        No copy when a block's mapping is (or can be) kept: the lease pins the sealed mapping
        itself. A block this client cannot hold is copied once into memory the lease owns. The
        blocks not mapped yet are fetched together, one request for up to
        :data:`~kvfabric.rpc.blockproto.MAX_NAMES` of them. Every lease must be released
        (:func:`~kvfabric.client.mappings.release_all`), or its block stays held and charged to
        this client; on an error nothing stays lent.
        """
        ahead = _Ahead(self, refs, deadline, hold=True)
        out: list[Lease] = []
        try:
            for i in range(len(refs)):
                lease = self._borrow_one(ahead, i)
                if lease is None:
                    break
                out.append(lease)
        except BaseException:
            for lease in out:
                lease.release()
            raise
        finally:
            ahead.close()
        return out

    def _borrow_one(self, ahead: _Ahead, i: int) -> Lease | None:
        name, length, key = ahead.refs[i]
        maps = self.maps
        if maps is not None and length:
            if key is not None:
                maps.named(key, name)
            lease = maps.borrow(name, length)
            if lease is not None:
                return lease
            got = ahead.held(i)
            if got is not None:
                return self._lend_held(maps, name, length, key=key, fetched=got)
        fd = ahead.plain(i)
        if fd is None:
            return None
        return _private_copy(fd, length, name)

    def read_blocks(self, refs: Sequence[BlockRef], *, deadline: float) -> list[bytes]:
        """The bytes of the leading blocks of ``refs``, up to the first that is gone (nothing kept).

        One request for up to :data:`~kvfabric.rpc.blockproto.MAX_NAMES` blocks.
        """
        ahead = _Ahead(self, refs, deadline, hold=False)
        out: list[bytes] = []
        try:
            for i, ref in enumerate(refs):
                fd = ahead.plain(i)
                if fd is None:
                    break
                out.append(read_all(fd, ref.length, ref.name))
        finally:
            ahead.close()
        return out

    def _lend_held(
        self,
        maps: MappingCache,
        name: str,
        length: int,
        *,
        key: str | None,
        fetched: Fetched,
    ) -> Lease | None:
        fd, held, epoch = fetched
        if fd is None:
            return None
        if not held:
            maps.give_up_one()  # as in _copy_held: holds keep turning over
            return _private_copy(fd, length, name)
        try:
            sealed = is_sealed(fd)
            mapping = _map_block(fd, length, name)
        except BaseException:
            maps.release_later(name, epoch)
            raise
        finally:
            os.close(fd)
        lease: Lease | None = None
        try:
            # Lent bytes are verified first and read later, so they must not be able to change in
            # between: only a block sealed against writes is read in place (the server seals every
            # block; one that did not is copied privately, and verified there).
            if sealed:
                lease = maps.keep_lent(name, mapping, length, key=key, epoch=epoch)
            if lease is not None:
                return lease
            private = bytearray(length)
            private[:] = memoryview(mapping)[:length]
            return Lease(memoryview(private))
        finally:
            if lease is None:
                mapping.close()
                maps.release_later(name, epoch)

    def _copy_held(
        self,
        maps: MappingCache,
        name: str,
        length: int,
        target: memoryview,
        *,
        key: str | None,
        fetched: Fetched,
    ) -> bool:
        fd, held, epoch = fetched
        if fd is None:
            return False
        if not held:
            # Lent, not held: the server's share of held blocks is full. Give one back, so that
            # holds keep turning over instead of pinning the first blocks ever loaded.
            maps.give_up_one()
            copy_into(fd, length, target, name)
            return True
        try:
            sealed = is_sealed(fd)
            mapping = _map_block(fd, length, name)
        except BaseException:
            maps.release_later(name, epoch)
            raise
        finally:
            os.close(fd)
        kept = False
        try:
            target[:length] = memoryview(mapping)[:length]
            kept = maps.keep(name, mapping, length, key=key, epoch=epoch, sealed=sealed)
        finally:
            if not kept:
                mapping.close()
                maps.release_later(name, epoch)
        return True

    def _fetch_held(self, names: Sequence[str], deadline: float) -> list[Fetched] | None:
        """Fetch and hold the blocks ``names`` (at most ``MAX_NAMES``) in one exchange.

        One :data:`Fetched` per name, in order; the caller closes every descriptor. The caller made
        room for them all first (:meth:`MappingCache.make_room`): the releases that made it ride on
        this request (the server applies them first), those beyond what one request carries go just
        before it, so the server never refuses a hold this client made room for. None: the server
        does not know hold requests (an older version); mappings are not kept from then on, and the
        caller fetches the plain way.
        """
        maps = self.maps
        assert maps is not None
        left = deadline - time.monotonic()
        if left <= 0 or not self._lock.acquire(timeout=left):
            raise errors.CacheTimeout("block socket: deadline passed")
        try:
            while maps.pending_releases() > bp.MAX_NAMES:
                self._send_releases(maps, deadline)
            # Releases ride on the next request: no message of their own on the load path. Taken
            # per attempt: after a reconnect, the closed connection's releases are gone with it.
            msg, fds = self._exchange(
                lambda client: bp.encode_hold_request(names, maps.take_releases(bp.MAX_NAMES), client),
                len(names),
                deadline,
            )
            if msg[:1] == bytes([bp.BAD_REQUEST]):
                close_all(fds)
                id_refused = self._id_refused  # learnt from this same server, just now
                self._drop()  # the server closes the connection after a bad request
                self._holds_refused = True  # until the next reconnect (that server may be upgraded)
                self._id_refused = id_refused
                return None
            # Read after the exchange: a reconnect inside it cleared the mappings and bumped it.
            epoch = maps.epoch
            return [(fd, held, epoch) for fd, held in _assign_held(names, msg, fds)]
        finally:
            self._lock.release()

    def fetch(self, names: Sequence[str], *, deadline: float) -> list[int | None]:
        """One descriptor per name (None: gone), in order; the caller closes every descriptor.

        Raises :class:`~kvfabric.client.errors.CacheUnavailable` when the socket cannot be reached
        and :class:`~kvfabric.client.errors.CacheTimeout` past ``deadline`` (``time.monotonic()``).
        """
        out: list[int | None] = []
        try:
            for start in range(0, len(names), bp.MAX_NAMES):
                out.extend(self._fetch_batch(names[start : start + bp.MAX_NAMES], deadline))
        except BaseException:
            close_all(out)
            raise
        return out

    def flush_releases(self, *, deadline: float) -> None:
        """Send every queued release now (they otherwise ride on the next fetch)."""
        maps = self.maps
        if maps is None:
            return
        left = deadline - time.monotonic()
        if left <= 0 or not self._lock.acquire(timeout=left):
            raise errors.CacheTimeout("block socket: deadline passed")
        try:
            while maps.pending_releases():
                self._send_releases(maps, deadline)
        finally:
            self._lock.release()

    def _send_releases(self, maps: MappingCache, deadline: float) -> None:
        """Send one request of queued releases only (under the lock)."""
        release = maps.take_releases(bp.MAX_NAMES)
        if not release:
            return
        msg, fds = self._exchange(functools.partial(bp.encode_hold_request, [], release), 1, deadline)
        close_all(fds)
        if msg != bytes([bp.RELEASED]):
            self._drop()
            raise errors.CacheCorrupt(f"block socket answered {msg[:80]!r} to a release")

    def _fetch_batch(self, names: Sequence[str], deadline: float) -> list[int | None]:
        left = deadline - time.monotonic()
        if left <= 0 or not self._lock.acquire(timeout=left):
            raise errors.CacheTimeout("block socket: deadline passed")
        try:
            msg, fds = self._exchange(functools.partial(bp.encode_request, names), len(names), deadline)
            return _assign(names, msg, fds)
        finally:
            self._lock.release()

    def store_begin(
        self, namespace: str, keys: Sequence[str], lengths: Sequence[int], *, deadline: float
    ) -> tuple[str, bool, list[int | None]] | None:
        """Begin storing ``keys`` (at most ``MAX_NAMES``): ``(lease, describe, descriptors)``.

        One writable staging descriptor per key the server staged (None: already stored, or
        dropped); the caller writes and closes them, then calls :meth:`store_end`. ``describe``: the
        server lacks the namespace's description. None when this server serves no stores on the block
        socket (store over gRPC). Raises as :meth:`fetch`, and
        :class:`~kvfabric.client.errors.InvalidRequest` for a request the server refuses.
        """
        if self._stores_refused:
            return None
        left = deadline - time.monotonic()
        if left <= 0 or not self._lock.acquire(timeout=left):
            raise errors.CacheTimeout("block socket: deadline passed")
        try:
            encode = functools.partial(bp.encode_store_begin, namespace, keys, lengths)
            msg, fds = self._exchange(
                encode, len(keys), deadline, answer_bytes=_STORE_ANSWER, bounded=False, resend=False
            )
            if msg[:1] == bytes([bp.BAD_REQUEST]):
                close_all(fds)
                self._drop()
                self._stores_refused = True  # until the next reconnect
                return None
            _raise_store_error(msg, fds)
            begun = bp.parse_store_begun(msg, len(keys))
            if begun is None or begun[2].count(bp.STAGED) != len(fds):
                close_all(fds)
                self._drop()
                raise errors.CacheCorrupt(f"block socket answered {msg[:80]!r} to a store's begin")
        finally:
            self._lock.release()
        lease, describe, statuses = begun
        it = iter(fds)
        return lease, describe, [next(it) if b == bp.STAGED else None for b in statuses]

    def store_end(self, lease: str, *, abort: bool = False, deadline: float) -> tuple[int, int]:
        """Commit (or abort) a store begun here: ``(accepted, dropped)``.

        Raises :class:`~kvfabric.client.errors.NotFound` when the lease is unknown or expired.
        """
        left = deadline - time.monotonic()
        if left <= 0 or not self._lock.acquire(timeout=left):
            raise errors.CacheTimeout("block socket: deadline passed")
        try:
            encode = functools.partial(_encode_store_end, lease, abort)
            msg, fds = self._exchange(
                encode, 1, deadline, answer_bytes=_STORE_ANSWER, bounded=False, resend=False
            )
            close_all(fds)
            _raise_store_error(msg, [])
            done = bp.parse_store_done(msg)
            if done is None:
                self._drop()
                raise errors.CacheCorrupt(f"block socket answered {msg[:80]!r} to a store's commit")
            return done
        finally:
            self._lock.release()

    def _exchange(
        self,
        request: Callable[[str | None], bytes],
        most_fds: int,
        deadline: float,
        *,
        answer_bytes: int = bp.MAX_NAMES + 1,
        bounded: bool = True,
        resend: bool = True,
    ) -> tuple[bytes, list[int]]:
        """Send one request and receive its answer (under the lock; reconnects once after a hang-up).

        ``request(client id or None)`` builds the message for each attempt (a reconnect may change
        what it carries). A refusal (the server serves no more connections) raises
        :class:`~kvfabric.client.errors.CacheOverloaded`. ``bounded``: the answer is due within the
        reply clock's bound (fetches); False for stores, whose begin may allocate pages first.
        ``resend``: whether a request sent before a hang-up may be sent again on a fresh connection
        (fetches); False for stores, which the server may have served (a begin's lease, a commit
        done): the hang-up raises :class:`~kvfabric.client.errors.CacheUnavailable` instead. A
        request the server never took (the send itself failed) is always sent again once.
        """
        clock = self.clock if bounded else None
        attempts = 0
        while True:
            attempts += 1
            client = None if self._id_refused else self.client_id
            sock = self._connected(deadline)
            left = deadline - time.monotonic()
            bound = clock.bound() if clock is not None else left
            delivered = False
            try:
                sock.settimeout(max(1e-3, min(left, bound)))
                sent = time.monotonic()
                sock.send(request(client))
                delivered = True
                # Close-on-exec from the start: another thread of the engine may fork meanwhile.
                msg, fds, flags = fdpass.recv_fds(sock, answer_bytes, most_fds)
                took = time.monotonic() - sent
            except TimeoutError as exc:
                self._drop()  # a late answer must never be read as the next request's
                if bound < left:
                    raise errors.CacheSuspect(
                        f"block socket: no answer within {bound * 1e3:.1f} ms (the server is suspect)"
                    ) from exc
                raise errors.CacheTimeout("block socket: no answer before the deadline") from exc
            except OSError as exc:
                refused = _refusal(sock)  # refused at accept: the reason waits, the request failed
                self._drop()
                if refused is not None:
                    raise errors.CacheOverloaded(f"block socket refused: {refused}") from exc
                if attempts > 1 or (delivered and not resend):
                    raise errors.CacheUnavailable(f"block socket {self.path}: {exc}") from exc
                continue  # the server restarted or closed this idle connection: reconnect once
            if clock is not None and msg:
                clock.record(took)
            if flags & socket.MSG_CTRUNC:
                # Out of descriptors here: the kernel dropped some. Not the server's fault.
                close_all(fds)
                self._drop()
                raise errors.CacheUnavailable(
                    "block socket: no descriptors left in this process (raise its open-files limit, "
                    "`ulimit -n` or the container runtime's nofile, or load fewer keys per call)"
                )
            if not msg:
                self._drop()
                if attempts > 1 or not resend:
                    raise errors.CacheUnavailable(f"block socket {self.path} hung up")
                continue
            if msg[:1] == bytes([bp.REFUSED]):
                close_all(fds)
                self._drop()
                raise errors.CacheOverloaded(f"block socket refused: {_reason(msg)}")
            if client is not None and msg[:1] == bytes([bp.BAD_REQUEST]) and attempts <= 2:
                # A server older than client ids refuses the id (and closes): ask it without one. (A
                # server that knows ids never finds a request of this client's malformed for it.)
                close_all(fds)
                self._drop()
                self._id_refused = True  # until the next reconnect (that server may be upgraded)
                continue
            return msg, fds

    def _connected(self, deadline: float) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                sock.connect(str(self.path))
            except OSError as exc:
                sock.close()
                raise errors.CacheUnavailable(f"block socket {self.path}: {exc}") from exc
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        # The server released this connection's holds when it closed: nothing kept is accounted now.
        if self._maps is not None:
            self._maps.clear()
        self._holds_refused = False  # the next server may know holds (an upgrade restarted it)
        self._id_refused = False  # and client ids
        self._stores_refused = False  # and stores

    def close(self) -> None:
        """Close the connection (a later fetch reopens it)."""
        with self._lock:
            self._drop()

    def __enter__(self) -> BlockChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ahead:
    """The blocks of one load, fetched ahead: one block-socket exchange for up to ``MAX_NAMES``.

    A load's first blocks after an engine restart are mapped nowhere here; fetching them one
    exchange each cost a round trip per block, each waiting for the server's thread to be
    scheduled (the largest stage of a hit on a busy machine). So the first block that needs a
    fetch brings the next ones that will need one too: held in one hold request (after making room
    for all of them, within the mapping budget), or in one plain request. What was fetched and not
    used — the load stopped at a gone block, or failed — is closed and its holds released by
    :meth:`close`; the descriptors are close-on-exec from their arrival (:mod:`kvfabric.rpc.fdpass`).
    """

    def __init__(
        self, channel: BlockChannel, refs: Sequence[BlockRef], deadline: float, *, hold: bool
    ) -> None:
        self.channel = channel
        self.refs = refs
        self.deadline = deadline
        self.hold = hold
        self._held: dict[str, Fetched] = {}
        self._plain: dict[str, int | None] = {}

    def _holds(self, maps: MappingCache | None, ref: BlockRef) -> bool:
        """Whether ``ref`` is fetched on a hold request (else the plain way)."""
        return self.hold and maps is not None and ref.length > 0 and charged(ref.length) <= maps.budget

    def _fetched(self, name: str) -> bool:
        return name in self._held or name in self._plain

    def held(self, i: int) -> Fetched | None:
        """Block ``i`` fetched on a hold request (with the next ones); None: fetch it the plain way.

        None when it never fits the mapping budget, or the server knows no hold requests.
        """
        ref = self.refs[i]
        got = self._held.pop(ref.name, None)
        if got is not None:
            return got
        maps = self.channel.maps
        if maps is None or not self._holds(maps, ref):
            return None
        # The keys' older blocks go first (as each would when reached): their mappings must not take
        # the room this batch makes.
        for later in self.refs[i:]:
            if later.key is not None:
                maps.named(later.key, later.name)
        names = [ref.name]
        room = charged(ref.length)
        for nxt in self.refs[i + 1 :]:
            if len(names) == bp.MAX_NAMES:
                break
            if not self._holds(maps, nxt) or nxt.name in names or self._fetched(nxt.name):
                continue
            if maps.kept(nxt.name, nxt.length):
                continue  # served from its mapping
            if room + charged(nxt.length) > maps.budget:
                break
            names.append(nxt.name)
            room += charged(nxt.length)
        # Room first, for all of them, so the releases ride on the hold request itself (the server
        # applies them first): the server never refuses a hold this client has room for.
        if not maps.make_room(room):
            return None
        fetched = self.channel._fetch_held(names, self.deadline)
        if fetched is None:
            return None
        self._held.update(zip(names, fetched, strict=True))
        return self._held.pop(ref.name)

    def plain(self, i: int) -> int | None:
        """Block ``i``'s descriptor fetched the plain way (with the next ones); None: it is gone."""
        ref = self.refs[i]
        if ref.name in self._plain:
            return self._plain.pop(ref.name)
        held = self._held.pop(ref.name, None)
        if held is not None:
            # Fetched held, read the plain way (the server stopped knowing holds meanwhile).
            self._release(ref.name, held)
            return held[0]
        maps = self.channel.maps
        names = [ref.name]
        for nxt in self.refs[i + 1 :]:
            if len(names) == bp.MAX_NAMES:
                break
            if not self._holds(maps, nxt) and nxt.name not in names and not self._fetched(nxt.name):
                names.append(nxt.name)
        fds = self.channel.fetch(names, deadline=self.deadline)
        self._plain.update(zip(names, fds, strict=True))
        return self._plain.pop(ref.name)

    def _release(self, name: str, got: Fetched) -> None:
        _fd, held, epoch = got
        maps = self.channel._maps
        if held and maps is not None:
            maps.release_later(name, epoch)

    def close(self) -> None:
        """Close what was fetched and not used, and release its holds (idempotent).

        Releases of blocks fetched and never used are sent at once (within the load's deadline):
        queued, they would wait for this client's next block request, and an engine that goes idle
        after a load stopped at a gone block would keep up to a batch of them pinned in the server's
        DRAM. Best effort: a release that cannot go now rides on the next request as usual.
        """
        held, self._held = self._held, {}
        plain, self._plain = self._plain, {}
        for name, got in held.items():
            self._release(name, got)
        close_all([got[0] for got in held.values()])
        close_all(list(plain.values()))
        if any(got[1] for got in held.values()):
            with contextlib.suppress(Exception):
                self.channel.flush_releases(deadline=self.deadline)


_STORE_ANSWER = 256
"""Room for any answer to a store request (a begin's is 34 bytes and one per key; a refusal's < 210)."""


def _encode_store_end(lease: str, abort: bool, client: str | None) -> bytes:
    return bp.encode_store_end(lease, abort=abort, client=client)


def _raise_store_error(msg: bytes, fds: list[int]) -> None:
    """Raise the client's error for a refused store request (closing ``fds``); nothing otherwise."""
    refused = bp.store_error(msg)
    if refused is None:
        return
    close_all(fds)
    kind, reason = refused
    if kind == bp.INVALID:
        raise errors.InvalidRequest(f"store refused: {reason}")
    if kind == bp.UNKNOWN_LEASE:
        raise errors.NotFound(f"store refused: {reason}")
    if kind == bp.BUSY:
        raise StoreBusy(f"store refused: {reason}")
    raise errors.CacheUnavailable(f"store refused: {reason}")


class StoreBusy(errors.CacheError):
    """The server dropped a store request at once: too many stores queued (its keys are dropped).

    Not :class:`~kvfabric.client.errors.CacheUnavailable`: the server is up and said so at once, so
    it is no failure of the server's (no breaker failure, no retry), as a commit without a free
    store slot is answered "dropped".
    """


def _reason(msg: bytes) -> str:
    return msg[1:80].decode("ascii", "replace")


def _refusal(sock: socket.socket) -> str | None:
    """The reason the server refused this connection with, if that is what waits on it."""
    try:
        sock.setblocking(False)
        msg = sock.recv(256)
    except OSError:
        return None
    return _reason(msg) if msg[:1] == bytes([bp.REFUSED]) else None


def _assign(names: Sequence[str], msg: bytes, fds: list[int]) -> list[int | None]:
    # A plain request's answer is a hold request's without LENT (the server never lends to KVBK1).
    if bytes([bp.LENT]) in msg:
        close_all(fds)
        raise errors.CacheCorrupt(f"block socket answered {msg[:80]!r} to {len(names)} names")
    return [fd for fd, _ in _assign_held(names, msg, fds)]


def _assign_held(names: Sequence[str], msg: bytes, fds: list[int]) -> list[tuple[int | None, bool]]:
    sent = (bp.FOUND, bp.LENT)
    known = all(b in (*sent, bp.GONE) for b in msg)
    if not known or len(msg) != len(names) or sum(b in sent for b in msg) != len(fds):
        for fd in fds:
            os.close(fd)
        raise errors.CacheCorrupt(f"block socket answered {msg[:80]!r} to {len(names)} names")
    it = iter(fds)
    return [(next(it), b == bp.FOUND) if b in sent else (None, False) for b in msg]


def _map_block(fd: int, length: int, name: str) -> mmap.mmap:
    """A read-only mapping of a sealed block's ``length`` bytes (it can never shrink: no SIGBUS)."""
    if os.fstat(fd).st_size < length:
        raise errors.CacheCorrupt(f"block {name} is shorter than {length}")
    return mmap.mmap(fd, length, prot=mmap.PROT_READ, flags=_MAP_FLAGS)


def copy_into(fd: int, length: int, target: memoryview, name: str) -> None:
    """Copy a sealed block's ``length`` bytes into ``target`` (one copy) and close ``fd``."""
    try:
        if not length:
            return
        # A mapping per load costs more than the copy; preadv and faulting the pages in measure
        # within 25 % of this, and none of them near memcpy (kvfabric.bench.profile.copy_paths,
        # docs/performance.md): kept mappings (kvfabric.client.mappings) avoid it for repeated loads.
        with _map_block(fd, length, name) as m:
            target[:length] = m
    finally:
        os.close(fd)


SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
"""The seals that make a block's bytes immutable for every holder (the server's own block seals)."""


def is_sealed(fd: int) -> bool:
    """Whether no holder of ``fd`` can ever write, shrink or grow it (False for any non-memfd)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    except OSError:
        return False


def _private_copy(fd: int, length: int, name: str) -> Lease:
    """A lease of a private copy of a sealed block (closes ``fd``)."""
    private = bytearray(length)
    copy_into(fd, length, memoryview(private), name)
    return Lease(memoryview(private))


def read_all(fd: int, length: int, name: str) -> bytes:
    """A sealed block's ``length`` bytes, and close ``fd``."""
    try:
        data = os.pread(fd, length, 0)
    finally:
        os.close(fd)
    if len(data) != length:
        raise errors.CacheCorrupt(f"block {name} is {len(data)} bytes, expected {length}")
    return data


def write_all(fd: int, payload: memoryview) -> None:
    """Write ``payload`` at the start of a staging memfd, and close ``fd``."""
    try:
        put = 0
        while put < len(payload):
            put += os.pwritev(fd, [payload[put:]], put)
    finally:
        os.close(fd)


def close_all(fds: Sequence[int | None]) -> None:
    """Close the descriptors a fetch returned that were not used."""
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
