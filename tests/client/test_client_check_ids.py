"""Key validation (``check_ids``) accepts exactly 64-character lower-case hex keys, in a few C passes.

The fast path validates all keys at once (joined by spaces, decoded, the separators and the
letters checked); the property here is that it decides exactly as a regular expression per key
would, on keys mutated in the ways that could slip through a joined check: a character moved from
one key to the next, whitespace ``bytes.fromhex`` would skip, a space inside a key, upper case,
non-ASCII digits, non-strings.
"""

from __future__ import annotations

import re

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvfabric.client._common import check_ids, check_raw_ids
from kvfabric.client.errors import InvalidRequest

NS = "ab" * 32
KEY = re.compile(r"[0-9a-f]{64}")

valid = st.text("0123456789abcdef", min_size=64, max_size=64)
odd = st.sampled_from([" ", "\t", "\n", "\x0b", "A", "F", "g", "G", "é", "٣", "0", "00", "  "])


@st.composite
def mutated(draw: st.DrawFn) -> object:
    key = draw(valid)
    what = draw(st.sampled_from(["insert", "delete", "replace", "upper", "cut", "other"]))
    at = draw(st.integers(0, 63))
    if what == "insert":
        return key[:at] + draw(odd) + key[at:]
    if what == "delete":
        return key[:at] + key[at + 1 :]
    if what == "replace":
        return key[:at] + draw(odd) + key[at + 1 :]
    if what == "upper":
        return key.upper()
    if what == "cut":
        return key[: draw(st.integers(0, 70))]
    return draw(st.sampled_from([b"\x00" * 32, 7, None, "", key + " ", " " + key]))


@st.composite
def key_lists(draw: st.DrawFn) -> list[object]:
    keys: list[object] = draw(st.lists(st.one_of(valid, valid, mutated()), max_size=8))
    if len(keys) >= 2 and draw(st.booleans()):
        # Move characters from one key to the next: the joined keys stay the same length.
        i = draw(st.integers(0, len(keys) - 2))
        a, b = keys[i], keys[i + 1]
        if isinstance(a, str) and isinstance(b, str):
            k = draw(st.integers(1, max(1, len(a))))
            keys[i], keys[i + 1] = a[:-k], a[-k:] + b
    return keys


@given(key_lists())
@settings(max_examples=800, deadline=None)
def test_check_ids_accepts_exactly_lower_case_hex_keys_of_64(keys: list[object]) -> None:
    ok = all(isinstance(k, str) and KEY.fullmatch(k) for k in keys)
    if ok:
        assert check_ids(NS, keys) == bytes.fromhex("".join(keys))  # type: ignore[arg-type]
    else:
        with pytest.raises(InvalidRequest, match="must be 64 lower-case hex"):
            check_ids(NS, keys)  # type: ignore[arg-type]


def test_a_character_moved_between_keys_is_refused() -> None:
    """Together the keys are 128 hex digits, but one has 63 and the other 65."""
    a, b = "0" * 64, "1" * 64
    with pytest.raises(InvalidRequest, match="key must be 64"):
        check_ids(NS, [a[:62], a[62:] + b])  # (an odd split bytes.fromhex refuses by itself)
    with pytest.raises(InvalidRequest, match="key must be 64"):
        check_ids(NS, [a[:63], a[63:] + b])
    with pytest.raises(InvalidRequest, match="key must be 64"):
        check_ids(NS, [a + " " + b[:31], b[31:]])  # a space inside a key, where a separator would be
    for letter in "ABCDEF":  # upper case, any one letter
        with pytest.raises(InvalidRequest, match="key must be 64"):
            check_ids(NS, [b, "0" * 63 + letter])
    assert check_ids(NS, []) == b""
    with pytest.raises(InvalidRequest, match="namespace"):
        check_ids("AB" * 32, [a])


def test_raw_keys_must_be_the_keys_digests() -> None:
    keys = ["0" * 64, "1" * 64, "2" * 64]
    raw = bytes.fromhex("".join(keys))
    assert check_raw_ids(NS, keys, raw) is raw
    assert check_raw_ids(NS, [], b"") == b""
    with pytest.raises(InvalidRequest, match="one per key"):
        check_raw_ids(NS, keys, raw[:-1])
    with pytest.raises(InvalidRequest, match="one per key"):
        check_raw_ids(NS, keys[:2], raw)
    with pytest.raises(InvalidRequest, match="not the digests"):
        check_raw_ids(NS, keys[::-1], raw)
    with pytest.raises(InvalidRequest, match="namespace"):
        check_raw_ids("x", keys, raw)
