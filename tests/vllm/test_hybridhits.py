"""The hybrid-model predictor the real-vLLM tests compare against (pure functions, unit level)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfabric.testing.hybridhits import (
    Kind,
    loaded_bytes,
    object_bytes,
    objects_read,
    predicted_hit,
    read_bytes,
    stored_bytes,
    stored_units,
)

C, B = 256, 128
PAGE = 1000
FULL = Kind("full", B, 2, PAGE)


def swa(w: int, block: int = B) -> Kind:
    return Kind("sliding_window", block, 2, PAGE, window=w)


def local(a: int) -> Kind:
    return Kind("chunked_local", B, 3, PAGE, attention_chunk=a)


def llama_loadable(n: int, generated: int) -> int:
    """The full-attention rule the serving tests use: whole chunks and tail blocks below ``n``."""
    computed = n + generated - 1
    best = 0
    for end in range(B, computed // B * B + 1, B):
        is_chunk_end = end % C == 0 and end <= computed // C * C
        is_tail = end > computed // C * C
        if end <= n - 1 and (is_chunk_end or is_tail):
            best = end
    return best


@given(st.integers(2, 3000), st.integers(1, 300))
def test_full_attention_only_is_the_plain_rule(n: int, generated: int) -> None:
    """With full attention alone the hit is the last unit end below the prompt's last token."""
    units = stored_units(n + generated - 1, C, B)
    assert predicted_hit(n, units, [FULL]) == llama_loadable(n, generated)


def test_a_missing_window_object_drops_the_hit_to_the_previous_boundary() -> None:
    units = stored_units(1011, C, B)  # chunks to 768, one tail unit 768-896
    assert units[-1] == (768, 896)
    kinds = [swa(200), FULL]
    assert predicted_hit(1000, units, kinds) == 896
    assert predicted_hit(1000, units, kinds, missing={("sliding_window", (768, 896))}) == 768
    gone = {("sliding_window", (768, 896)), ("sliding_window", (512, 768))}
    assert predicted_hit(1000, units, kinds, missing=gone) == 512
    # A window object the boundary's window does not reach is not needed.
    assert predicted_hit(1000, units, kinds, missing={("sliding_window", (0, 256))}) == 896
    # A full-attention object is needed by every later boundary.
    assert predicted_hit(1000, units, kinds, missing={("full", (256, 512))}) == 256


def test_a_window_larger_than_a_chunk_needs_two_units() -> None:
    units = stored_units(1200, C, C)  # Gemma 4-like: S = 256, no 128-token tails
    kinds = [swa(300, 256), Kind("full", B, 2, PAGE)]
    assert predicted_hit(1100, units, kinds) == 1024
    # A hit at 1024 sees [725, 1024): two chunks; one at 768 sees [469, 768).
    assert predicted_hit(1100, units, kinds, missing={("sliding_window", (256, 512))}) == 1024
    assert predicted_hit(1100, units, kinds, missing={("sliding_window", (768, 1024))}) == 768
    assert predicted_hit(1100, units, kinds, missing={("sliding_window", (512, 768))}) == 512


def test_chunked_local_needs_only_the_open_attention_chunk() -> None:
    units = stored_units(1011, C, B)
    kinds = [local(384), FULL]
    assert predicted_hit(1000, units, kinds) == 896
    # 768 is a multiple of 384: a hit at 896 needs only the 768-896 unit's local part.
    assert predicted_hit(1000, units, kinds, missing={("chunked_local", (512, 768))}) == 896
    assert predicted_hit(1000, units, kinds, missing={("chunked_local", (768, 896))}) == 768
    # A hit at 768 needs no local object at all.
    assert (
        predicted_hit(
            1000, units, kinds, missing={("chunked_local", (768, 896)), ("chunked_local", (512, 768))}
        )
        == 768
    )


def test_the_engine_hit_bounds_what_is_needed_and_loaded() -> None:
    units = stored_units(1011, C, B)
    kinds = [swa(128), FULL]
    assert predicted_hit(1000, units, kinds, local=512) == 896
    assert predicted_hit(1000, units, kinds, local=896) == 896
    assert loaded_bytes(512, 896, FULL) == 3 * 2 * PAGE
    assert loaded_bytes(512, 896, swa(128)) == 1 * 2 * PAGE
    assert loaded_bytes(768, 896, swa(300)) == 1 * 2 * PAGE
    assert loaded_bytes(896, 896, FULL) == 0


def test_bytes_per_kind_follow_the_table() -> None:
    units = stored_units(1011, C, B)  # 3 chunks and one tail unit
    assert stored_bytes(units, FULL) == 7 * 2 * PAGE
    assert stored_bytes(units, swa(128)) == 4 * 2 * PAGE  # one trailing block per unit
    assert stored_bytes(units, swa(200)) == 7 * 2 * PAGE  # two: the whole chunk
    # Local 384: chunk 0 whole (2), chunk 1 [384,512) (1), chunk 2 nothing (768 = 2A), tail (1).
    assert stored_bytes(units, local(384)) == 4 * 3 * PAGE
    assert stored_bytes(units, local(256)) == 1 * 3 * PAGE  # only the tail: A divides every chunk end
    assert loaded_bytes(0, 896, swa(200)) == 2 * 2 * PAGE
    assert loaded_bytes(0, 896, local(384)) == 1 * 3 * PAGE
    assert loaded_bytes(0, 768, local(384)) == 0


def test_a_hit_reads_whole_objects_of_the_units_it_needs() -> None:
    units = stored_units(1011, C, B)
    header = 128
    # Window 200 at a tail boundary: [697, 896) reads chunk 512-768 (two blocks, one needed) and the tail.
    assert objects_read(units, 0, 896, swa(200)) == [(512, 768), (768, 896)]
    assert read_bytes(units, 0, 896, swa(200), header) == (2 + 1) * 2 * PAGE + 2 * header
    assert loaded_bytes(0, 896, swa(200)) == 2 * 2 * PAGE
    # Local 384 at 768 reads nothing; full reads every unit below the hit.
    assert objects_read(units, 0, 768, local(384)) == []
    assert read_bytes(units, 256, 768, FULL, header) == 4 * 2 * PAGE + 2 * header
    assert stored_bytes(units, swa(128), header) == 4 * 2 * PAGE + 4 * header
    assert object_bytes((512, 768), local(384), header) == 0  # 768 = 2A: nothing stored, no object
