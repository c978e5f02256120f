"""KV events of a hybrid model inside real vLLM: one event per group object, with vLLM's group fields.

One offline run of the tiny Gemma 3-shaped model (:mod:`kvfabric.testing.hybridmodels`: a
sliding-window group, window 200, beside a full-attention group, both in 128-token blocks) with
kvfabric through :mod:`tests.vllm.spyconnector` and KV events on (vLLM's ``null`` publisher: what
``take_events()`` returns is what vLLM publishes). With 512-token chunks a prompt of 1,000 tokens
and 12 generated ones stores one chunk (blocks 0-3) and three 128-token tail units (blocks 4-6).

The expectations are written from the design and from vLLM's own functions (recorded by the spy in
vLLM's process), never from the connector's code: the full-attention group announces blocks 0-6,
the sliding-window group only the ``cdiv(199, 128) = 2`` trailing blocks of each unit (blocks 2-6),
each block once per group, every event with its group's ``group_idx``, ``kv_cache_spec_kind`` and
``kv_cache_spec_sliding_window`` exactly as vLLM's ``get_kv_cache_spec_kind`` /
``get_kv_cache_spec_sliding_window`` name them, and chained by vLLM's hashes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.vllm.spyconnector import read_records, spy_environ, spy_transfer_config

from kvfabric.testing import hybridmodels
from kvfabric.testing.serverproc import cache_server
from kvfabric.testing.vllmenv import OfflineRun, VllmEnv, connector_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

CHUNK, BLOCK, MAX_TOKENS = 512, 128, 12
PROMPT = hybridmodels.prompt_tokens(7101, 1000)


def _block_of(tokens: list[int]) -> int:
    """The block of ``PROMPT`` an event's tokens start at (they are the prompt's, block-aligned)."""
    for b in range(len(PROMPT) // BLOCK):
        if PROMPT[b * BLOCK : b * BLOCK + len(tokens)] == tokens:
            return b
    raise AssertionError(f"an event's {len(tokens)} tokens are not a block-aligned run of the prompt")


@pytest.fixture(scope="module")
def records(vllm_env: VllmEnv, vllm_workdir: Path) -> list[dict[str, Any]]:
    """The spy's records of one storing run of the Gemma 3-shaped model with KV events on."""
    model = hybridmodels.MODELS["gemma3"]
    path = hybridmodels.build(vllm_env, model)
    work = vllm_workdir / "hybrid-events"
    with cache_server(server_id="hybrid-events", dram_bytes=256 << 20) as srv:
        kv = spy_transfer_config(
            connector_config(srv.config.listen.unix_socket, chunk_tokens=CHUNK, cost_model=False)
        )
        spec = {
            "model": str(path),
            "kv_transfer": kv,
            "kv_events": {"enable_kv_cache_events": True, "publisher": "null"},
            "llm": {"max_model_len": 2048, "enable_prefix_caching": True},
            "requests": [{"id": "a", "prompt": PROMPT, "max_tokens": MAX_TOKENS}],
        }
        extra = spy_environ(vllm_env, work / "spy")
        OfflineRun(vllm_env, spec, work, name="events", extra_env=extra).start().result()
    return read_records(work / "spy")


def test_each_group_announces_its_own_blocks_with_vllms_group_fields(records: list[dict[str, Any]]) -> None:
    (init,) = [r for r in records if r["what"] == "init" and r["role"] == "scheduler"]
    groups = init["groups"]
    assert [(g["type"], g["block_size"]) for g in groups] == [
        ("SlidingWindowSpec", BLOCK),
        ("FullAttentionSpec", BLOCK),
    ]
    # What vLLM's own functions call the groups (its KV cache manager puts these on its events).
    assert [(g["event_kind"], g["event_window"]) for g in groups] == [
        ("sliding_window", 200),
        ("full_attention", None),
    ]
    events = [e for r in records if r["what"] == "events" for e in r["events"]]
    assert events, "no KV events: take_events() returned nothing"
    assert {e["type"] for e in events} == {"BlockStored"}
    # Per (medium, group): block -> hash. DRAM first; the server's write-back to its local disk is
    # relayed by its residency feed as STORAGE, named the same way.
    announced: dict[tuple[str, int], dict[int, Any]] = {}
    for e in events:
        g = e["group_idx"]
        assert (e["kind"], e["window"]) == (groups[g]["event_kind"], groups[g]["event_window"])
        assert e["block_size"] == groups[g]["block_size"]
        assert len(e["token_ids"]) == len(e["block_hashes"]) * BLOCK
        first = _block_of(e["token_ids"])
        mine = announced.setdefault((e["medium"], g), {})
        for i, h in enumerate(e["block_hashes"]):
            assert first + i not in mine, f"block {first + i} announced twice in {e['medium']} group {g}"
            mine[first + i] = h
    assert {m for m, _ in announced} <= {"CPU", "STORAGE"}
    for (medium, g), blocks in announced.items():
        assert blocks.items() <= announced[("CPU", g)].items(), (medium, g)
    dram = {g: announced[("CPU", g)] for g in (0, 1)}
    # 1,011 tokens computed: chunk [0, 512) and tail units of 128 up to 896.
    assert sorted(dram[1]) == list(range(7))
    # The window group: the trailing cdiv(199, 128) = 2 blocks of the chunk, and each tail unit's one.
    assert sorted(dram[0]) == [2, 3, 4, 5, 6]
    # Both groups name a block by the same vLLM hash (equal block sizes), and chain like vLLM's events.
    assert all(dram[0][b] == dram[1][b] for b in dram[0])
    for e in events:
        first = _block_of(e["token_ids"])
        assert e["parent_block_hash"] == (dram[1][first - 1] if first else None)
