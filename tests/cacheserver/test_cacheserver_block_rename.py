"""Rewriting the names kept with a local-disk copy: same copy, new names, or nothing at all.

Names that arrive after a write-back are written by renaming a new file of the same copy over it.
It keeps the payload and generation, leaves a copy already carrying the names alone, and never
lands over a copy that was deleted or replaced while it was written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfabric.cacheserver.engine import disk as disk_module
from kvfabric.cacheserver.engine.blockfile import payload_checksum, read_header_and_meta, write_block
from kvfabric.cacheserver.engine.disk import DiskTier
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.testing.serverproc import digest, payload_for

NS = digest("rename")
NAMES = b"\x93names of the chunk" * 10


def _setup(tmp_path: Path) -> tuple[DiskTier, Generations, BlockId, bytes]:
    gens = Generations(lambda: 1.0)
    t = DiskTier("local_disk", tmp_path / "d", 1 << 24, server_id="me", generations=gens, direct_io=False)
    b = BlockId(NS, digest("k"))
    data = payload_for(b.key, 8192)
    view = memoryview(data)
    assert t.write(b, view, gen=gens.next(), bucket=1, created_at=5.0, checksum=payload_checksum(view))
    return t, gens, b, data


def _file(t: DiskTier, b: BlockId) -> Path:
    (path,) = (t.root / "buckets").glob(f"*/{b.filename}")
    return path


def test_a_rewrite_keeps_the_copy_and_adds_the_names_which_a_new_scan_reads_back(tmp_path: Path) -> None:
    t, _gens, b, data = _setup(tmp_path)
    before, _ = read_header_and_meta(_file(t, b))
    assert t.rewrite_names(b, NAMES)
    after, names = read_header_and_meta(_file(t, b))
    assert names == NAMES
    assert (after.gen, after.bucket, after.created_at, after.checksum) == (
        before.gen,
        before.bucket,
        before.created_at,
        before.checksum,
    )
    assert t.get(b) == data
    inode = _file(t, b).stat().st_ino
    assert t.rewrite_names(b, NAMES)  # already carried: left alone
    assert _file(t, b).stat().st_ino == inode
    again = DiskTier("local_disk", t.root, 1 << 24, server_id="me", direct_io=False)
    seen: list[tuple[BlockId, bytes]] = []
    again.on_meta = lambda bid, raw: seen.append((bid, raw))
    assert again.scan() == 1
    assert seen == [(b, NAMES)]
    assert again.get(b) == data


def test_a_rewrite_of_a_deleted_copy_writes_nothing(tmp_path: Path) -> None:
    t, _gens, b, _data = _setup(tmp_path)
    assert t.delete(b)
    assert not t.rewrite_names(b, NAMES)
    assert list((t.root / "buckets").glob("*/*.blk")) == []
    assert list(t.tmp_dir.iterdir()) == []


def test_a_rewrite_never_lands_over_a_copy_replaced_while_it_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t, gens, b, _data = _setup(tmp_path)
    newer = payload_for(b.key, 8192, salt=b"newer")
    real = write_block
    replaced: list[bool] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        if not replaced:  # the rewrite's own write: a newer copy commits first
            replaced.append(True)
            view = memoryview(newer)
            assert t.write(
                b, view, gen=gens.next(), bucket=2, created_at=6.0, checksum=payload_checksum(view)
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(disk_module, "write_block", racing)
    assert not t.rewrite_names(b, NAMES)
    assert t.get(b) == newer
    header, names = read_header_and_meta(_file(t, b))
    assert (header.bucket, names) == (2, None)
    assert list(t.tmp_dir.iterdir()) == []
