"""The published index's probe as array operations: the reference probe's answer in a few numpy calls.

:func:`lookup_prefix` answers exactly as :func:`kvfabric.rpc.indextable.lookup_prefix`. A 128-key
lookup probed key by key in Python costs about 25 us of CPU (a bytecode loop, one memoryview read
per slot); here every key's home slot is read in one gather over the table's mapped words, and only
the keys whose home slot holds another key (about one in twenty at an eighth full, one in eight at
a quarter full, the most the writer allows) continue in Python from the slot after it. Same layout,
same seqlock, same answer: ``tests/client/test_client_indexprobe.py`` checks it against the
reference probe on arbitrary tables (crowded runs, full tables, fingerprint collisions) and under a
concurrent writer.

numpy comes with the connector's ``engine`` extra (and with vLLM); a client without it uses the
reference probe (:mod:`kvfabric.client.localindex` decides).
"""

from __future__ import annotations

import mmap

import numpy as np
import numpy.typing as npt

from kvfabric.rpc import indextable as it

__all__ = ["fingerprint_array", "lookup_prefix", "slots_of", "tier_names"]

Words = npt.NDArray[np.int64]
_I64 = np.dtype(np.int64)
_KEY_BYTES = 32
_NO_CODES: Words = np.zeros(0, dtype=np.int64)
_NAMES = np.array(["", *(it.TIER_NAMES[c] for c in (1, 2, 3))], dtype=object)


def slots_of(table: mmap.mmap, capacity: int) -> Words:
    """The slot words of a mapped table: a read-only view (no copy) of its ``capacity`` slots.

    Signed 64-bit words: the probe only shifts, masks and compares them, which sign does not change
    (an arithmetic shift differs from a logical one only in the top two bits, never in a home index
    or a zero test), and numpy mixes signed words with Python ints without converting them.
    """
    return np.frombuffer(table, dtype=np.int64, count=capacity, offset=8 * it.HEADER_WORDS)


def fingerprint_array(raw: bytes) -> Words:
    """The keys' fingerprints (the first 8 bytes of each 32-byte digest), a view of ``raw`` (no copy)."""
    if len(raw) % _KEY_BYTES:
        raise ValueError("raw keys must be 32 bytes each")
    # Every 4th word is the first 8 bytes of a key, in host byte order as the writer reads it.
    return np.ndarray((len(raw) // _KEY_BYTES,), _I64, raw, 0, (_KEY_BYTES,))


def lookup_prefix(words: memoryview, slots: Words, fps: Words) -> Words:
    """Tier codes of the leading present fingerprints; stops at the first absent one.

    ``words`` is the table (cast to "Q", for its header), ``slots`` its :func:`slots_of` view and
    ``fps`` from :func:`fingerprint_array`. Exactly :func:`~kvfabric.rpc.indextable.lookup_prefix`
    (as an array): raises :class:`~kvfabric.rpc.indextable.Inconsistent` if the writer was active
    during the read, ``ValueError`` if ``words`` is not a table of this version and capacity.
    """
    seq = words[it.W_SEQ]
    if seq & 1:
        raise it.Inconsistent
    if words[it.W_MAGIC] != it.MAGIC | it.VERSION << 32:
        raise ValueError("not a kvfabric index table of this version")
    if words[it.W_CAPACITY] != len(slots):
        raise ValueError("the table's capacity is not the mapped one")
    codes = _probe(words, slots, fps)
    # Every slot read above happened between the two reads of the counter (each numpy call reads
    # the mapping when it runs): an unchanged, even counter means no write overlapped them.
    if words[it.W_SEQ] != seq:
        raise it.Inconsistent
    return codes


def tier_names(codes: Words) -> list[str]:
    """The tier name of each code (what :class:`~kvfabric.client.results.LookupResult` lists)."""
    names: list[str] = _NAMES.take(codes).tolist()
    return names


def _probe(words: memoryview, slots: Words, fps: Words) -> Words:
    n = len(fps)
    if not n:
        return _NO_CODES
    mask = len(slots) - 1
    home = (fps >> 2) & mask
    at_home = slots.take(home)
    # An empty home slot: that key is absent (linear probing fills runs from the home slot on), so
    # the answer ends before the first one.
    cut = n if np.count_nonzero(at_home) == n else int((at_home == 0).argmax())
    codes = at_home[:cut] & 3
    # Keys whose home slot holds another fingerprint (its bits above the tier's two differ): they
    # may sit further along the run. One in eight or fewer, so each continues in Python, in key
    # order (the first absent one ends the answer), as the reference probe does.
    moved = ((at_home[:cut] ^ fps[:cut]) >> 2).nonzero()[0]
    if not len(moved):
        return codes
    base = it.HEADER_WORDS
    found: list[int] = []
    wanted = fps.view(np.uint64).take(moved).tolist()  # the loop compares unsigned words
    for fp, start in zip(wanted, home.take(moved).tolist(), strict=True):
        want, left, j = fp | 3, mask, start
        while True:
            j = (j + 1) & mask
            v = words[base + j]
            if v == 0 or v | 3 == want:
                break
            left -= 1
            if not left:
                # Every other slot holds another key: never with a consistent table (at most a
                # quarter full): a torn read, which the seqlock check would reject anyway.
                raise it.Inconsistent
        if v == 0:  # absent: the answer ends before it
            codes[moved[: len(found)]] = found
            return codes[: moved[len(found)]]
        found.append(v & 3)
    codes[moved] = found
    return codes
