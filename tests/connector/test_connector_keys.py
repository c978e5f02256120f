"""Keys and namespaces: pure functions, deterministic across interpreters."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.connector import keys

SPEC = keys.NamespaceSpec(
    model_id="m",
    model_revision="r1",
    kv_dtype="float32",
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    block_size=16,
    chunk_tokens=32,
)


def test_chain_follows_design_formula() -> None:
    ns = SPEC.digest()
    tokens = list(range(100))
    got = keys.chunk_keys(ns, tokens, 32)
    assert len(got) == 3  # the partial tail (4 tokens) is never a chunk
    prev = hashlib.sha256(bytes.fromhex(ns)).digest()
    for i, key in enumerate(got):
        chunk = b"".join(t.to_bytes(4, "little") for t in tokens[i * 32 : (i + 1) * 32])
        prev = hashlib.sha256(prev + chunk).digest()
        assert key == prev.hex()
        assert keys.is_hex64(key)


def test_key_commits_to_whole_prefix() -> None:
    ns = SPEC.digest()
    a = keys.chunk_keys(ns, [1] * 64 + [2] * 32, 32)
    b = keys.chunk_keys(ns, [1] * 63 + [9] + [2] * 32, 32)
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert a[2] != b[2]  # same third chunk, different history


@pytest.mark.parametrize(
    "change",
    [
        {"model_revision": "r2"},
        {"kv_dtype": "bfloat16"},
        {"model_id": "other"},
        {"num_layers": 3},
        {"chunk_tokens": 64},
        {"tp_size": 2},
        {"lora": "adapter@1"},
        {"tenant": "acme"},
        {"layout": "other"},
        {"payload_key_id": "0123456789abcdef"},
        {"key_scope": "team-b"},
    ],
)
def test_namespace_changes_with_every_field(change: dict[str, object]) -> None:
    other = keys.NamespaceSpec(**{**SPEC.__dict__, **change})
    assert other.digest() != SPEC.digest()
    assert (
        keys.chunk_keys(other.digest(), list(range(64)), 32)[0]
        != keys.chunk_keys(SPEC.digest(), list(range(64)), 32)[0]
    )


def test_loadable_chunks_always_leave_one_token() -> None:
    assert keys.num_loadable_chunks(64, 32) == 1
    assert keys.num_loadable_chunks(65, 32) == 2
    assert keys.num_loadable_chunks(1, 32) == 0
    assert keys.num_loadable_chunks(0, 32) == 0


def test_invalid_inputs_fail_loudly() -> None:
    with pytest.raises(ValueError, match="multiple"):
        keys.NamespaceSpec(**{**SPEC.__dict__, "chunk_tokens": 40})
    with pytest.raises(ValueError, match="uint32"):
        keys.encode_tokens([1, -1])
    with pytest.raises(ValueError, match="hex"):
        keys.chunk_keys("NOT-HEX", [1, 2], 1)


_CHILD = """
import json, sys
from kvfabric.connector import keys
spec = keys.NamespaceSpec(**json.loads(sys.argv[1]))
tokens = list(range(1000, 1000 + 300))
print(json.dumps({"ns": spec.digest(), "keys": keys.chunk_keys(spec.digest(), tokens, 32), "h": hash("x")}))
"""


@pytest.mark.process
def test_keys_identical_across_interpreters_with_different_hash_seeds() -> None:
    out = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(SPEC.__dict__)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        out.append(json.loads(proc.stdout))
    assert out[0]["h"] != out[1]["h"], "the seeds must really differ for this test to mean anything"
    assert out[0]["ns"] == out[1]["ns"] == SPEC.digest()
    assert out[0]["keys"] == out[1]["keys"] == keys.chunk_keys(SPEC.digest(), list(range(1000, 1300)), 32)


@pytest.mark.parametrize(
    "change",
    [
        {"device_type": "cuda"},
        {"attn_backend": "FLASH_ATTN"},
        {"kv_layout": "LBNHC"},
        {"payload_format": 99},
        {"block_size": 8},
    ],
    ids=lambda c: next(iter(c)),
)
def test_engine_facts_change_the_namespace(change: dict[str, object]) -> None:
    """Issue 9.3: everything that decides the bytes of a block is in the namespace."""
    import dataclasses

    base = dataclasses.replace(SPEC, device_type="cpu", attn_backend="CPU_ATTN", kv_layout="LBHNC")
    assert dataclasses.replace(base, **change).digest() != base.digest()  # type: ignore[arg-type]


def test_payload_format_in_the_namespace_is_the_layout_version() -> None:
    from kvfabric.connector import layout

    assert SPEC.payload_format == layout.FORMAT_VERSION


NS = SPEC.digest()
TOKENS = list(range(128))  # four chunks of 32


def _keys(inputs: keys.RequestInputs | None) -> list[str]:
    return keys.chunk_keys(NS, TOKENS, 32, inputs=inputs)


def test_plain_inputs_keep_the_plain_chain() -> None:
    assert _keys(keys.RequestInputs()) == _keys(None)


def test_lora_adapter_changes_every_key() -> None:
    a = _keys(keys.RequestInputs(lora=("sql", "1", "/adapters/sql")))
    b = _keys(keys.RequestInputs(lora=("chat", "2", "/adapters/chat")))
    base = _keys(None)
    assert all(x != y and x != z for x, y, z in zip(a, b, base, strict=True))


def test_cache_salt_goes_into_the_first_chunk_and_the_chain_carries_it() -> None:
    salted = _keys(keys.RequestInputs(cache_salt="user-1"))
    other = _keys(keys.RequestInputs(cache_salt="user-2"))
    assert all(x != y for x, y in zip(salted, other, strict=True))
    assert keys.chunk_extras(keys.RequestInputs(cache_salt="s"), 32, 3)[1:] == [b"", b""]


def test_multimodal_item_reaches_the_chunks_it_overlaps_and_later() -> None:
    def with_image(identifier: str, offset: int) -> list[str]:
        return _keys(keys.RequestInputs(mm=(keys.MultiModalSpan(identifier, offset, 40),)))

    base = _keys(None)
    cat, dog = with_image("cat", 40), with_image("dog", 40)  # placeholders span chunks 1 and 2
    assert cat[0] == dog[0] == base[0]  # the text before the image is shared with text-only prompts
    assert all(c != d for c, d in zip(cat[1:], dog[1:], strict=True))
    assert with_image("cat", 44)[1] != cat[1]  # the same image at another position
    extras = keys.chunk_extras(keys.RequestInputs(mm=(keys.MultiModalSpan("cat", 40, 40),)), 32, 4)
    assert [bool(e) for e in extras] == [False, True, True, False]


def test_prompt_embeddings_change_keys_from_the_chunk_they_differ_in() -> None:
    row = 8
    a = bytearray(128 * row)
    b = bytearray(a)
    b[2 * 32 * row + 5] ^= 1  # a byte of a token in chunk 2
    ka = _keys(keys.RequestInputs(prompt_embeds=memoryview(a), prompt_embeds_row_bytes=row))
    kb = _keys(keys.RequestInputs(prompt_embeds=memoryview(b), prompt_embeds_row_bytes=row))
    assert ka[:2] == kb[:2]
    assert all(x != y for x, y in zip(ka[2:], kb[2:], strict=True))
    assert ka[0] != _keys(None)[0]  # embeddings are never keyed like token ids alone


@settings(max_examples=60, deadline=None)
@given(
    chunk=st.sampled_from([4, 8, 16]),
    n_chunks=st.integers(1, 6),
    data=st.data(),
)
def test_keys_agree_exactly_up_to_the_first_chunk_an_input_difference_reaches(
    chunk: int, n_chunks: int, data: st.DataObject
) -> None:
    """Two requests with the same tokens share exactly the chunks before the first one that a
    differing input reaches: nothing is shared past it (never wrong), nothing before it is lost."""
    n_tokens = chunk * n_chunks
    tokens = data.draw(st.lists(st.integers(0, 1000), min_size=n_tokens, max_size=n_tokens))
    offset = data.draw(st.integers(0, n_tokens - 1))
    length = data.draw(st.integers(1, n_tokens - offset))
    kind = data.draw(st.sampled_from(["mm", "mm-position", "salt", "lora", "embeds"]))
    span = keys.MultiModalSpan("img-a", offset, length)
    base = keys.RequestInputs(mm=(span,))
    if kind == "mm":
        other, first = keys.RequestInputs(mm=(keys.MultiModalSpan("img-b", offset, length),)), offset // chunk
    elif kind == "mm-position":
        moved = min(offset + 1, n_tokens - length)
        other = keys.RequestInputs(mm=(keys.MultiModalSpan("img-a", moved, length),))
        first = min(offset, moved) // chunk if moved != offset else n_chunks
    elif kind == "salt":
        base, other, first = keys.RequestInputs(cache_salt="a"), keys.RequestInputs(cache_salt="b"), 0
    elif kind == "lora":
        base, other, first = keys.RequestInputs(lora=("a",)), keys.RequestInputs(lora=("b",)), 0
    else:
        row = 4
        a = bytearray(n_tokens * row)
        b = bytearray(a)
        b[offset * row] ^= 1
        base = keys.RequestInputs(prompt_embeds=memoryview(a), prompt_embeds_row_bytes=row)
        other = keys.RequestInputs(prompt_embeds=memoryview(b), prompt_embeds_row_bytes=row)
        first = offset // chunk
    ka = keys.chunk_keys(NS, tokens, chunk, inputs=base)
    kb = keys.chunk_keys(NS, tokens, chunk, inputs=other)
    assert ka[:first] == kb[:first]
    assert all(x != y for x, y in zip(ka[first:], kb[first:], strict=True))
