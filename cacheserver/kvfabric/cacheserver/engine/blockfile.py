r"""The on-disk block format: a 4 KiB header, the payload, then the chunk's names (optional).

Layout (little-endian), padded with zeros to :data:`HEADER_SIZE` so the payload starts on an
O_DIRECT-aligned offset::

    magic      8s   b"KVFBLK\\x00\\x01"
    version    H    FORMAT_VERSION
    flags      H    0 (reserved)
    namespace  32s  raw digest
    key        32s  raw digest
    length     Q    payload bytes
    checksum   16s  xxh3-128 of the payload
    created_at d    shared-volume time (seconds) when the block was written
    bucket     q    TTL bucket at write time (the directory is authoritative after a refresh)
    generation Q    the copy's generation (version 2; see ordering.py) — version 1 headers read as 0
    meta_len   I    bytes of the names after the payload (version 3 only)
    meta_sum   Q    xxh3-64 of those bytes (version 3 only)
    header_sum Q    xxh3-64 of every header byte before this field

A block written with names (the residency metadata a connector attached: the engine's block hashes,
tokens, extra keys; :mod:`kvfabric.rpc.residency`) carries them after the payload, at most
:data:`MAX_META_BYTES`, and a version-3 header; one without them is written exactly as version 2, so
an older server still reads it. The names are checksummed by ``meta_sum``, which the header checksum
covers: they are bound to this header (namespace, key, generation, payload checksum) and verified
apart from the payload, so names that fail their check are dropped while the payload still serves
(it has its own checksum; the names only tell routers what the block is).

Blocks are written to a temporary name, fsynced and renamed into place, so a reader never sees half a
block (payload and names alike). The payload checksum is verified on every read; the header checksum
lets the start-up scan trust a header without reading the payload.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvfabric.cacheserver.engine.ids import BlockId

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAX_META_BYTES",
    "BlockHeader",
    "CorruptBlock",
    "DestinationFailed",
    "make_dir_durable",
    "pack_header",
    "read_block_into",
    "read_block_to_fd",
    "read_header",
    "read_header_and_meta",
    "unpack_header",
    "write_at",
    "write_block",
]

MAGIC = b"KVFBLK\x00\x01"
FORMAT_VERSION = 3
"""The newest version this code writes (only for a block with names; version 2 otherwise)."""
HEADER_SIZE = 4096
ALIGN = 4096
MAX_META_BYTES = 64 << 10
"""The most names one block carries (the residency feed's bound on one chunk's metadata)."""
_FMT_V1 = struct.Struct("<8sHH32s32sQ16sdq")
_FMT_V2 = struct.Struct("<8sHH32s32sQ16sdqQ")
_FMT = struct.Struct("<8sHH32s32sQ16sdqQIQ")
_FORMATS = {1: _FMT_V1, 2: _FMT_V2, 3: _FMT}
_VERSION = struct.Struct("<8sH")
_SUM = struct.Struct("<Q")
# Largest single read/write request. A 32 MiB chunk is read in one O_DIRECT request, which the kernel
# splits into many queued bios (8 MiB pieces measured slower: a shallower device queue).
_PIECE = 64 << 20


class CorruptBlock(Exception):  # noqa: N818 - a condition, not a programming error
    """A block file whose header or payload does not match its checksums."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The decoded header of one block file."""

    bid: BlockId
    length: int
    checksum: bytes
    created_at: float
    bucket: int
    gen: int = 0
    meta_length: int = 0
    """Bytes of names after the payload (0: none)."""
    meta_sum: int = 0
    """xxh3-64 of the names."""

    @property
    def file_size(self) -> int:
        """Size of the whole block file."""
        return HEADER_SIZE + self.length + self.meta_length


def pack_header(h: BlockHeader) -> bytes:
    """Encode a header into exactly :data:`HEADER_SIZE` bytes (version 2 unless it has names)."""
    fields = (
        bytes.fromhex(h.bid.namespace),
        bytes.fromhex(h.bid.key),
        h.length,
        h.checksum,
        h.created_at,
        h.bucket,
        h.gen,
    )
    if h.meta_length:
        body = _FMT.pack(MAGIC, 3, 0, *fields, h.meta_length, h.meta_sum)
    else:  # what servers before names wrote, so one of them still reads it
        body = _FMT_V2.pack(MAGIC, 2, 0, *fields)
    body += _SUM.pack(xxhash.xxh3_64_intdigest(body))
    return body.ljust(HEADER_SIZE, b"\0")


def unpack_header(data: bytes | memoryview) -> BlockHeader:
    """Decode and verify a header; raises :class:`CorruptBlock` on any mismatch."""
    if len(data) < _FMT.size + _SUM.size:
        raise CorruptBlock("short header")
    magic, version = _VERSION.unpack_from(data)
    fmt = _FORMATS.get(version, _FMT)
    body = bytes(data[: fmt.size])
    (want,) = _SUM.unpack_from(data, fmt.size)
    if xxhash.xxh3_64_intdigest(body) != want:
        raise CorruptBlock("header checksum mismatch")
    if magic != MAGIC or version not in _FORMATS:
        raise CorruptBlock(f"bad magic/version {magic!r}/{version}")
    gen = meta_length = meta_sum = 0
    if version == 1:  # written before generations: older than any copy stored since
        _m, _v, _flags, ns, key, length, checksum, created_at, bucket = fmt.unpack(body)
    elif version == 2:
        _m, _v, _flags, ns, key, length, checksum, created_at, bucket, gen = fmt.unpack(body)
    else:
        *fields, meta_length, meta_sum = fmt.unpack(body)
        _m, _v, _flags, ns, key, length, checksum, created_at, bucket, gen = fields
        if meta_length > MAX_META_BYTES:
            raise CorruptBlock(f"names of {meta_length} bytes (at most {MAX_META_BYTES})")
    bid = BlockId(ns.hex(), key.hex())
    return BlockHeader(bid, length, checksum, created_at, bucket, gen, meta_length, meta_sum)


def payload_checksum(data: bytes | bytearray | memoryview | mmap.mmap) -> bytes:
    """xxh3-128 of a payload (releases the GIL for large inputs)."""
    return xxhash.xxh3_128_digest(data)


def write_block(
    tmp_dir: Path,
    final_path: Path,
    bid: BlockId,
    payload: bytes | bytearray | memoryview | mmap.mmap,
    *,
    created_at: float,
    bucket: int,
    checksum: bytes | None = None,
    gen: int = 0,
    commit: Callable[[Path, Path], bool] | None = None,
    meta: bytes | None = None,
    direct: bool = True,
) -> BlockHeader | None:
    """Write a block atomically and durably (with ``meta``, its names, after the payload).

    With ``direct``, the payload's whole pages are written with ``O_DIRECT`` where the source and the
    filesystem allow it (see :func:`_write_payload`), as the tiers read them.

    Temp file in ``tmp_dir`` (same filesystem), fsync, rename, fsync of the directory. ``commit``
    replaces the plain rename: it renames ``tmp`` to ``final`` itself, or returns False to abandon the
    write (a tier re-checking the generation under its lock); the temp file is then removed and None
    returned.

    Returns the header written. On any error the temporary file is removed and the error re-raised.
    """
    view = memoryview(payload).cast("B")
    meta = meta or b""
    if len(meta) > MAX_META_BYTES:
        raise ValueError(f"names of {len(meta)} bytes (at most {MAX_META_BYTES})")
    header = BlockHeader(
        bid=bid,
        length=len(view),
        checksum=checksum if checksum is not None else payload_checksum(view),
        created_at=created_at,
        bucket=bucket,
        gen=gen,
        meta_length=len(meta),
        meta_sum=xxhash.xxh3_64_intdigest(meta) if meta else 0,
    )
    tmp = tmp_dir / f"{os.urandom(8).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, memoryview(pack_header(header)), 0)
        _write_payload(tmp, fd, view, direct=direct)
        if meta:
            _write_all(fd, memoryview(meta), HEADER_SIZE + len(view))
        os.fsync(fd)
        os.close(fd)
        fd = -1
        make_dir_durable(final_path.parent)
        if commit is None:
            os.rename(tmp, final_path)
        elif not commit(tmp, final_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            return None
        # The rename is durable only once the directory entry is: without this a power loss could
        # lose a block the index (and other servers' journals) already list.
        _fsync_dir(final_path.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return header


_MKDIR_LOCK = threading.Lock()


def make_dir_durable(path: Path) -> None:
    """Create directory ``path`` if needed, and make its entry in its parent durable before returning.

    A block renamed into a bucket directory that was just created is durable only once the
    directory's own entry in ``buckets/`` is: the fsync of the bucket directory after the rename
    does not cover it, so a power loss could drop the whole new bucket after ``Flush`` reported its
    blocks durable. The creator fsyncs the parent right after ``mkdir``, under a lock, so a
    concurrent writer in this process that finds the directory already there knows it is durable.
    """
    if path.is_dir():
        return
    with _MKDIR_LOCK:
        _mkdirs_durable(path)


def _mkdirs_durable(path: Path) -> None:
    if path.is_dir():
        return
    _mkdirs_durable(path.parent)
    with contextlib.suppress(FileExistsError):  # another process created it: it fsyncs its parent
        os.mkdir(path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_payload(path: Path, fd: int, view: memoryview, *, direct: bool = True) -> None:
    """Write the payload at :data:`HEADER_SIZE`: its whole pages straight to the device where possible.

    With ``O_DIRECT`` the bytes go from the caller's memory to the disk without a copy into the page
    cache (and without pushing other files out of it): a block's reads are ``O_DIRECT`` anyway, so a
    cached copy would serve no one. That needs a page-aligned source — a DRAM block's mapping, what a
    write-back writes — and a filesystem that supports it; otherwise (a ``bytes`` payload, tmpfs) it
    is written buffered. The part after the last whole page is always written buffered. ``fsync`` on
    ``fd`` then makes both durable (one file).
    """
    whole = len(view) // ALIGN * ALIGN
    offset = HEADER_SIZE
    if direct and whole and _write_direct(path, view[:whole], offset):
        view, offset = view[whole:], offset + whole
    _write_all(fd, view, offset)


def _write_direct(path: Path, view: memoryview, offset: int) -> bool:
    """Write ``view`` at ``offset`` of ``path`` with ``O_DIRECT``; False if that is not possible here.

    ``EINVAL`` (no ``O_DIRECT`` on this filesystem, or a source not aligned for it) writes nothing
    usable; the caller then writes the same range buffered, over whatever part was written.
    """
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return False
    try:
        dfd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | o_direct)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        _write_all(dfd, view, offset)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(dfd)
    return True


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done : done + _PIECE]], offset + done)


def read_header(path: Path) -> BlockHeader:
    """Read and verify only the header of a block file."""
    return read_header_and_meta(path, with_meta=False)[0]


def read_header_and_meta(path: Path, *, with_meta: bool = True) -> tuple[BlockHeader, bytes | None]:
    """The verified header of a block file and, with ``with_meta``, its names (the start-up scan).

    One open for both. The names are None when the block has none or they fail their checksum
    (dropped, never returned: the payload, which has its own checksum, still serves); a header
    that fails, or a file whose size is not the header's, is a :class:`CorruptBlock`.
    """
    with open(path, "rb", buffering=0) as f:
        header = unpack_header(f.read(HEADER_SIZE))
        size = os.fstat(f.fileno()).st_size
        if size != header.file_size:
            raise CorruptBlock(f"file is {size} bytes, header says {header.file_size}")
        if not (with_meta and header.meta_length):
            return header, None
        meta = os.pread(f.fileno(), header.meta_length, HEADER_SIZE + header.length)
    if len(meta) != header.meta_length or xxhash.xxh3_64_intdigest(meta) != header.meta_sum:
        return header, None
    return header, meta


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Return an anonymous, page-aligned buffer of ``nbytes`` rounded up to :data:`ALIGN` (for O_DIRECT)."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN))


def read_block_into(
    path: Path, bid: BlockId, dest: memoryview, *, length: int | None = None, direct: bool = True
) -> BlockHeader:
    """Read a block's payload into ``dest`` and verify header and payload checksums.

    ``dest`` must hold the payload rounded up to :data:`ALIGN` bytes and, for O_DIRECT, start on a page
    boundary (an mmap does). With ``direct`` the read bypasses the page cache (large aligned I/O, cold
    reads honest); filesystems without O_DIRECT (tmpfs) fall back to buffered reads.
    Raises :class:`CorruptBlock` on a mismatch and ``FileNotFoundError`` if the block vanished; with
    ``length`` (what the caller's index says), a header that says otherwise is a ``ValueError``.
    """
    fd = _open_read(path, direct)
    try:
        header = _read_header_at(fd, bid, length)
        n = header.length
        padded = -(-n // ALIGN) * ALIGN
        if len(dest) < padded:
            raise ValueError(f"destination holds {len(dest)} bytes, need {padded}")
        hasher = xxhash.xxh3_128()
        got = 0
        while got < padded:
            chunk = dest[got : min(got + _PIECE, padded)]
            r = os.preadv(fd, [chunk], HEADER_SIZE + got)
            if r <= 0:
                break
            hasher.update(dest[got : min(got + r, n)])
            got += r
            if r < len(chunk):
                break
        _check_payload(header, got, hasher)
        return header
    finally:
        os.close(fd)


def _check_payload(header: BlockHeader, got: int, hasher: xxhash.xxh3_128) -> None:
    """Raise :class:`CorruptBlock` unless all ``header.length`` bytes were read and hash right."""
    if got < header.length:
        raise CorruptBlock(f"payload truncated: {got} of {header.length} bytes")
    if hasher.digest() != header.checksum:
        raise CorruptBlock("payload checksum mismatch")


_PIPE_PIECE = 4 << 20
"""Piece of a pipelined read (:func:`read_block_to_fd`): one is read while the previous is written."""
_PIPE_DEPTH = 3
_SPARE_MAX = 12
_spare_pieces: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()


def read_block_to_fd(
    path: Path, bid: BlockId, fd: int, *, length: int | None = None, direct: bool = True
) -> BlockHeader:
    """Read a block's payload into the start of file ``fd`` (a fresh memfd) and verify it.

    Like :func:`read_block_into`, but the payload is read in :data:`_PIPE_PIECE` pieces into warm,
    reused buffers by one thread while this one checksums each piece and writes it into ``fd``
    (``pwrite``: the memfd's pages are allocated by the write, never zeroed first). Read, checksum
    and page allocation overlap instead of running one after another: 1.3-1.4x faster than reading
    into a fresh mapping (``python -m kvfabric.bench.profile``, part 5; docs/performance.md).
    Raises like :func:`read_block_into`, and :class:`DestinationFailed` when writing into ``fd``
    fails; ``fd`` then holds an unspecified prefix. With ``length`` (what the caller's index says),
    a header that says otherwise is a ``ValueError`` before any payload is read: a file never makes
    the destination bigger than its caller sized it.
    """
    src = _open_read(path, direct)
    try:
        header = _read_header_at(src, bid, length)
        n = header.length
        padded = -(-n // ALIGN) * ALIGN
        hasher = xxhash.xxh3_128()
        if padded <= _PIPE_PIECE:
            got = _read_pieces_in_turn(src, fd, n, padded, hasher)
        else:
            got = _read_pieces_overlapped(src, fd, n, padded, hasher)
        _check_payload(header, got, hasher)
        return header
    finally:
        os.close(src)


def _read_header_at(fd: int, bid: BlockId, length: int | None) -> BlockHeader:
    """The verified header of the block file open as ``fd``; it must be ``bid``'s, of ``length`` if given."""
    head = aligned_buffer(HEADER_SIZE)
    try:
        if os.preadv(fd, [head], 0) < HEADER_SIZE:
            raise CorruptBlock("short header")
        header = unpack_header(memoryview(head))
    finally:
        head.close()
    if header.bid != bid:
        raise CorruptBlock(f"file holds {header.bid}, expected {bid}")
    if length is not None and header.length != length:
        raise ValueError(f"file holds {header.length} bytes, index says {length}")
    return header


def _piece() -> mmap.mmap:
    try:
        return _spare_pieces.get_nowait()
    except queue.Empty:
        return aligned_buffer(_PIPE_PIECE)


def _give_back(pieces: list[mmap.mmap]) -> None:
    # Kept warm for the next read, up to _SPARE_MAX of them (48 MiB): enough for four promotions
    # at once, the rest unmapped (memory outside the DRAM budget stays small).
    for b in pieces:
        if _spare_pieces.qsize() < _SPARE_MAX:
            _spare_pieces.put(b)
        else:
            b.close()


def _read_pieces_in_turn(src: int, dst: int, n: int, padded: int, hasher: xxhash.xxh3_128) -> int:
    """Read, checksum and write one piece after another (small blocks, or no thread to read)."""
    buf = _piece()
    try:
        got = 0
        while got < padded:
            want = min(_PIPE_PIECE, padded - got)
            view = memoryview(buf)[:want]
            try:
                r = max(os.preadv(src, [view], HEADER_SIZE + got), 0)
                take = max(0, min(r, n - got))
                hasher.update(view[:take])
                write_at(dst, view[:take], got)
            finally:
                view.release()
            got += take
            if r < want:
                break
        return min(got, n)
    finally:
        _give_back([buf])


def _read_pieces_overlapped(src: int, dst: int, n: int, padded: int, hasher: xxhash.xxh3_128) -> int:
    pieces = [_piece() for _ in range(_PIPE_DEPTH)]
    free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
    for b in pieces:
        free.put(b)
    full: queue.SimpleQueue[tuple[int, int, mmap.mmap] | BaseException | None] = queue.SimpleQueue()
    stop = threading.Event()

    def reader() -> None:
        try:
            off = 0
            while off < padded and not stop.is_set():
                b = free.get()
                if stop.is_set():
                    break
                want = min(_PIPE_PIECE, padded - off)
                r = os.preadv(src, [memoryview(b)[:want]], HEADER_SIZE + off)
                full.put((off, max(r, 0), b))
                if r < want:
                    break  # short: the file ends here (truncated); the caller sees got < n
                off += r
            full.put(None)
        except BaseException as exc:  # handed to the caller, who raises it
            full.put(exc)

    t = threading.Thread(target=reader, name="kvfabric-block-read", daemon=True)
    try:
        t.start()
    except RuntimeError:  # no thread to be had (the process is at its thread limit): one by one
        _give_back(pieces)
        return _read_pieces_in_turn(src, dst, n, padded, hasher)
    got = 0
    try:
        while True:
            item = full.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            off, r, b = item
            take = max(0, min(r, n - off))
            view = memoryview(b)[:take]
            try:
                hasher.update(view)
                write_at(dst, view, off)
            finally:
                view.release()
            got = off + take
            free.put(b)
    finally:
        stop.set()
        for b in pieces:
            free.put(b)  # wake a reader waiting for a buffer
        t.join()
        _give_back(pieces)
    return got


class DestinationFailed(Exception):  # noqa: N818 - a condition of the destination, not of the block
    """Writing into the destination failed (e.g. the memfd's memory ran out): the block is fine.

    Not an ``OSError``, so a tier never mistakes it for a failed read of its own copy.
    """


def write_at(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of ``fd`` (a promotion's memfd).

    Raises :class:`DestinationFailed` if that fails.
    """
    done = 0
    try:
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    except OSError as exc:
        raise DestinationFailed(str(exc)) from exc


def _open_read(path: Path, direct: bool) -> int:
    flags = os.O_RDONLY | os.O_CLOEXEC
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        try:
            return os.open(path, flags | o_direct)
        except OSError as exc:
            # EINVAL: the filesystem (tmpfs, some FUSE) does not support O_DIRECT; read buffered.
            if exc.errno != 22:
                raise
    return os.open(path, flags)
