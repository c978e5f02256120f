"""Golden KV-event bytes, made by vLLM's own classes: run with the real-vLLM environment's python.

    "$(scripts/vllm-env.sh)/venv/bin/python" scripts/kvevents-golden.py > tests/rpc/kvevents_golden.json

Each case is a batch described in JSON (bytes as ``{"hex": ...}``, tuples as lists) and the bytes
vLLM's ``KVEventBatch`` encodes it to with ``msgspec.msgpack`` (what ``ZmqEventPublisher`` sends as
the payload frame). ``tests/rpc/test_kvevents.py`` checks kvfabric's encoder against the file, and
(at the ``vllm`` level) that this script still produces it. Needs vLLM only, not kvfabric.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

import vllm

H32 = bytes(range(32))


def _b(raw: bytes) -> dict[str, str]:
    return {"hex": raw.hex()}


CASES: dict[str, dict[str, Any]] = {
    "stored_minimal": {
        "ts": 1.5,
        "rank": None,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [_b(H32), _b(H32[::-1])],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            }
        ],
    },
    "stored_storage_local_extra_keys_lora": {
        "ts": 1733400000.123456,
        "rank": 3,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1],
                "parent_block_hash": 2**63,
                "token_ids": list(range(20)),
                "block_size": 2,
                "lora_id": 7,
                "medium": "STORAGE",
                "lora_name": "adapter-x",
                "extra_keys": [
                    ["adapter-x", "salt"],
                    None,
                    ["adapter-x", ["mm-id", 0]],
                    [-1, -32, -33, -128, -129, -40000, -(2**31), -(2**31) - 1, -(2**63)],
                    ["adapter-x", _b(b"\x01" * 32)],
                    None,
                    None,
                    None,
                    None,
                    None,
                ],
                "locality": "LOCAL",
            }
        ],
    },
    "removed_and_cleared": {
        "ts": 0.0,
        "rank": 0,
        "events": [
            {"type": "BlockRemoved", "block_hashes": [_b(H32)], "medium": "CPU"},
            {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "STORAGE", "locality": "LOCAL"},
            {"type": "AllBlocksCleared"},
        ],
    },
    "long_fields": {
        "ts": 2.25,
        "rank": None,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [_b(bytes(300))],
                "parent_block_hash": _b(b"\xff" * 8),
                "token_ids": list(range(300)),
                "block_size": 300,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": "l" * 31,
                "extra_keys": [["s" * 32, "t" * 255, "u" * 256, "v" * 300]],
                "group_idx": 1,
                "kv_cache_spec_kind": "full_attention",
                "kv_cache_spec_sliding_window": 4096,
                "ownership": "o",
                "session_id": "sess",
            }
        ],
    },
    "hybrid_groups": {
        "ts": 3.0,
        "rank": None,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [_b(H32), _b(H32[::-1])],
                "parent_block_hash": _b(bytes(32)),
                "token_ids": list(range(64)),
                "block_size": 32,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "sliding_window",
                "kv_cache_spec_sliding_window": 200,
            },
            {
                "type": "BlockStored",
                "block_hashes": [_b(H32)],
                "parent_block_hash": None,
                "token_ids": list(range(16)),
                "block_size": 16,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "group_idx": 1,
                "kv_cache_spec_kind": "full_attention",
            },
            {"type": "BlockRemoved", "block_hashes": [_b(H32)], "medium": "CPU", "group_idx": 0},
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU", "group_idx": 3},
        ],
    },
}


def _value(raw: Any) -> Any:
    if isinstance(raw, dict) and set(raw) == {"hex"}:
        return bytes.fromhex(raw["hex"])
    if isinstance(raw, list):
        return [_value(v) for v in raw]
    return raw


def _event(spec: dict[str, Any]) -> Any:
    fields = {k: _value(v) for k, v in spec.items() if k != "type"}
    if "extra_keys" in fields and fields["extra_keys"] is not None:
        fields["extra_keys"] = [None if k is None else tuple(_tuples(k)) for k in fields["extra_keys"]]
    cls = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}[
        spec["type"]
    ]
    return cls(**fields)


def _tuples(items: list[Any]) -> list[Any]:
    return [tuple(_tuples(i)) if isinstance(i, list) else i for i in items]


def main() -> None:
    """Print every case with the bytes vLLM encodes it to, as JSON."""
    out = {"vllm": vllm.__version__, "msgspec": msgspec.__version__, "cases": {}}
    for name, case in CASES.items():
        batch = KVEventBatch(
            ts=case["ts"], events=[_event(e) for e in case["events"]], data_parallel_rank=case["rank"]
        )
        out["cases"][name] = {"batch": case, "hex": msgspec.msgpack.encode(batch).hex()}
    json.dump(out, sys.stdout, indent=None)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
