"""Names after a block's payload are never served wrongly, whatever single byte of the file is damaged.

For any payload, any names (the chunk's residency metadata, as the feed keeps it) and any one byte
of the block file flipped: the header either fails its checksum or reads as written; the names read
back exactly or not at all; the payload reads back exactly or is a corrupt block. A damage to the
names alone leaves the payload serving.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.cacheserver.engine.blockfile import (
    HEADER_SIZE,
    CorruptBlock,
    aligned_buffer,
    read_block_into,
    read_header,
    read_header_and_meta,
    write_block,
)
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.testing.serverproc import digest

BID = BlockId(digest("ns"), digest("key"))
# A version-3 header's fields and its checksum (magic ... meta_len, meta_sum, header_sum); zeros follow.
HEADER_FIELDS = 8 + 2 + 2 + 32 + 32 + 8 + 16 + 8 + 8 + 8 + 4 + 8 + 8


def _payload(path: Path, length: int) -> bytes | None:
    """The payload read back verified, or None for a corrupt block."""
    buf = aligned_buffer(length)
    try:
        read_block_into(path, BID, memoryview(buf), length=length, direct=False)
        return bytes(buf[:length])
    except CorruptBlock:
        return None
    finally:
        buf.close()


@settings(deadline=None, max_examples=150)
@given(
    payload=st.binary(min_size=1, max_size=9000),
    names=st.binary(min_size=1, max_size=5000),
    where=st.sampled_from(["header", "payload", "names"]),
    offset=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
)
def test_any_single_damaged_byte_is_a_miss_or_a_dropped_name_never_a_wrong_answer(
    payload: bytes, names: bytes, where: str, offset: int, flip: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / BID.filename
        written = write_block(Path(tmp), path, BID, payload, created_at=1.0, bucket=1, gen=3, meta=names)
        assert written is not None
        data = bytearray(path.read_bytes())
        start, end = {
            "header": (0, HEADER_FIELDS),
            "payload": (HEADER_SIZE, HEADER_SIZE + len(payload)),
            "names": (HEADER_SIZE + len(payload), len(data)),
        }[where]
        data[start + offset % (end - start)] ^= flip
        path.write_bytes(bytes(data))
        if where == "header":
            with pytest.raises(CorruptBlock):  # a damaged header is a corrupt block: a miss
                read_header(path)
            return
        header, got_names = read_header_and_meta(path)
        assert header == written
        assert got_names in (None, names)
        assert (got_names is None) == (where == "names")
        got_payload = _payload(path, len(payload))
        assert got_payload in (None, payload)
        assert (got_payload is None) == (where == "payload")
