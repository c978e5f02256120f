"""No lost tail, end to end: the reference engine, the connector and a real cache-server process.

Round 1 of a chat stores its whole chunks and its partial last chunk as tail blocks; round 2 (round
1's prompt, its answer and a new message), in a fresh engine, loads both: every whole block of
round 1's prompt, with the logits and tokens of an engine without any cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.client import CacheClient
from kvfabric.connector import keys, layout
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.refengine.engine import Engine, GenerateResult
from kvfabric.refengine.model import RefModel
from kvfabric.refengine.testing import TINY, prompt
from kvfabric.testing.memtransport import CacheServerProcess
from kvfabric.testing.serverproc import wait_until

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)

BLOCK, CHUNK = 16, 64
TOL = 1e-5


@pytest.fixture
def server(tmp_path: Path) -> Iterator[CacheServerProcess]:
    s = CacheServerProcess(tmp_path, name="tail").start()
    yield s
    s.close()


def _settings(server: CacheServerProcess, **update: object) -> ConnectorSettings:
    return ConnectorSettings(
        socket=str(server.socket),
        shared_memory=True,
        chunk_tokens=CHUNK,
        lookup_deadline_ms=2000,
        load_deadline_ms=5000,
        cost_model=False,
    ).model_copy(update=update)


def _run(
    model: RefModel,
    settings: ConnectorSettings | None,
    tokens: list[int],
    max_tokens: int,
    max_prefill_tokens: int | None = None,
) -> tuple[GenerateResult, dict[str, int]]:
    e = Engine(
        TINY,
        num_blocks=64,
        block_size=BLOCK,
        settings=settings,
        model=model,
        max_prefill_tokens=max_prefill_tokens,
    )
    try:
        r = e.generate(tokens, max_tokens)
        counters: dict[str, int] = {}
        if e.worker_conn is not None:
            assert e.worker_conn.wait_for_stores(60)
            counters = e.worker_conn.counters.snapshot()
        return r, counters
    finally:
        e.close()


def _same(r: GenerateResult, ref: GenerateResult) -> None:
    diff = (r.first_logits - ref.first_logits).abs().max().item()
    assert diff <= TOL, f"max abs logit diff {diff}"
    assert r.output_token_ids == ref.output_token_ids


@pytest.mark.parametrize("prefill_step", [None, 48], ids=["one-step", "chunked-prefill"])
def test_round_two_reuses_round_one_tail_with_identical_outputs(
    tiny_model: RefModel, server: CacheServerProcess, prefill_step: int | None
) -> None:
    round1 = prompt(2 * CHUNK + 2 * BLOCK + 5, 71)  # two chunks, a tail of two whole blocks and 5 tokens
    first, counters1 = _run(tiny_model, _settings(server), round1, 3, prefill_step)
    assert first.hit_tokens == 0
    assert counters1.get("tail_saved_blocks") == 2
    _same(first, _run(tiny_model, None, round1, 3)[0])

    round2 = [*round1, *first.output_token_ids, *prompt(20, 72)]
    ref = _run(tiny_model, None, round2, 4)[0]
    second, counters2 = _run(tiny_model, _settings(server), round2, 4, prefill_step)
    # Every whole block of round 1's prompt: 2 chunks + 2 tail blocks (vLLM's own prefix cache
    # would reuse the same, at its block size); without tails only the 2 chunks.
    assert second.hit_tokens == 2 * CHUNK + 2 * BLOCK
    assert counters2.get("loaded_tail_blocks") == 2
    assert counters2.get("tail_hit_blocks") == 2
    assert second.fallback_reason is None
    _same(second, ref)

    whole_only, _ = _run(tiny_model, _settings(server, tail=False), round2, 4)
    assert whole_only.hit_tokens == 2 * CHUNK
    _same(whole_only, ref)


def test_a_corrupt_tail_block_is_recomputed_never_served(
    tiny_model: RefModel, server: CacheServerProcess
) -> None:
    """A tail block whose bytes are damaged fails verification: the engine recomputes it, and
    the whole chunks before it are still used."""
    round1 = prompt(CHUNK + 3 * BLOCK + 1, 81)
    settings = _settings(server)
    first, _ = _run(tiny_model, settings, round1, 2)
    spec = Engine.namespace_spec(TINY, settings, BLOCK)
    ns = dataclasses.replace(spec, payload_key_id=layout.key_id(settings.mac_key)).digest()
    parent = keys.chunk_keys(ns, round1, CHUNK)[0]
    tail = keys.tail_keys(ns, round1, CHUNK, BLOCK, chunk=1, parent=parent)
    assert len(tail) == 3
    with CacheClient(server.unix_target) as c:
        (payload,) = c.load(ns, [tail[1]], timeout=10)
        bad = bytearray(payload)
        bad[-1] ^= 0xFF
        c.delete(ns, [tail[1]], timeout=10)
        # A deleted key takes no store for the delete margin (engine/ordering.py): wait it out.
        wait_until(
            lambda: c.store(ns, [tail[1]], [bytes(bad)], timeout=10).accepted == 1,
            timeout=60,
            what="the store after the delete margin",
        )
    round2 = [*round1, *first.output_token_ids, *prompt(10, 82)]
    ref = _run(tiny_model, None, round2, 2)[0]
    second, counters = _run(tiny_model, settings, round2, 2)
    # Promised CHUNK + 3 blocks; used the chunk and the first tail block, recomputed from the damaged one.
    assert second.hit_tokens == CHUNK + BLOCK
    assert second.recomputed_after_load_error
    assert second.fallback_reason == "corrupt"
    assert counters.get("loaded_chunks") == 1
    assert counters.get("fallback_tail_blocks.corrupt") == 2
    _same(second, ref)


def test_round_two_reuses_round_one_answer(tiny_model: RefModel, server: CacheServerProcess) -> None:
    """Round 1's generated tokens are stored as they are computed (a chunk that spans prompt and
    answer whole, then a tail block of answer tokens): round 2 reuses every whole block whose KV
    round 1 computed, with identical logits and tokens."""
    round1 = prompt(2 * CHUNK + 2 * BLOCK + 5, 91)  # 165 tokens
    first, counters1 = _run(tiny_model, _settings(server), round1, 50)  # KV of 165 + 49 = 214 tokens
    _same(first, _run(tiny_model, None, round1, 50)[0])
    round2 = [*round1, *first.output_token_ids, *prompt(20, 92)]
    ref = _run(tiny_model, None, round2, 3)[0]
    second, _ = _run(tiny_model, _settings(server), round2, 3)
    computed = len(round1) + len(first.output_token_ids) - 1
    assert second.hit_tokens == computed // BLOCK * BLOCK == 3 * CHUNK + BLOCK
    _same(second, ref)
    # The tail blocks of round 1: its prompt's two, the answer's one in chunk 2 (before the chunk
    # was whole), and one in chunk 3.
    assert counters1.get("tail_saved_blocks") == 4
