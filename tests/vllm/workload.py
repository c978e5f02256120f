"""The prompts every real-vLLM test sends, fixed in advance so one reference run covers them all.

Token ids are drawn from the tiny model's word vocabulary (``3..8191``) by seeded generators, so the
prompts are the same on every machine. Chunks are 256 tokens and the CPU backend's blocks 128.
"""

from __future__ import annotations

import random
from typing import Any

VOCAB = 8192


def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic word token ids."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# A hit after a vLLM restart: stored by an offline LLM run, hit by the server started after it.
RESTART = {"restart-a": tokens(1, 700), "restart-b": tokens(2, 1300)}
# Stored by the same offline run, first asked for while two other requests decode. Three of them:
# whether a loader overlaps the decoders is up to the machine's scheduling (the whole decode takes
# about 3 s), so the test tries a fresh one (never in vLLM's own cache) until one does.
LOADER = {"loader": tokens(3, 1100), "loader-2": tokens(3101, 1100), "loader-3": tokens(3102, 1100)}
DECODERS = {"decoder-0": tokens(4, 200), "decoder-1": tokens(5, 220)}
# Long enough that a request sent after their first tokens finishes well before them, even on a
# loaded 2-core machine (160, then 480, were not: both decoders finished first in one CI run each;
# 480 tokens stream in about 1.5 s here). 960 keeps decoders and loader within the 32-block KV
# cache (10 + 10 + 9 blocks of 128 tokens).
DECODE_TOKENS = 960
# Sent while the cache server is killed, restarted and hung.
FAULTS = {f"fault-{i}": tokens(1000, 512) + tokens(100 + i, 300) for i in range(8)}
# Round 1 on one server, round 2 on another that shares the first one's volume.
SHARED_CONV: dict[str, Any] = {"id": "shared", "turns": [tokens(7, 900), tokens(8, 120)], "max_tokens": 16}
# No lost tail: round 1 (stored by the offline run) is a 650-token prompt and a 260-token answer, so
# round 1 computed the KV of 909 tokens: 3 chunks (the third spans prompt and answer) and one whole
# 128-token block of answer tokens. Round 2, on a server that never saw round 1, reuses all 896.
TAIL_CONV: dict[str, Any] = {"id": "tail", "turns": [tokens(11, 650), tokens(12, 200)], "max_tokens": 260}
# Chats whose total context exceeds a deliberately small KV cache (evictions and preemptions).
SYSTEM = tokens(9, 512)
PRESSURE_CONVS: list[dict[str, Any]] = [
    {
        "id": f"pressure-{u}",
        "turns": [SYSTEM + tokens(20 + u, 400), tokens(40 + u, 300), tokens(60 + u, 300)],
        "max_tokens": 24,
    }
    for u in range(4)
]
# Four prompts that together fill the 32-block KV cache exactly (8 blocks each); every decoded token
# then needs a block that is not there, so vLLM must preempt (and resume by recomputing or loading).
PREEMPT = {f"preempt-{i}": tokens(80 + i, 1000) for i in range(4)}
PREEMPT_TOKENS = 400
# Stored by the offline run too, first asked for one by one after a cache-server restart: the
# first one the server serves tells how long hits took to come back.
RECOVERY = {f"recovery-{i}": tokens(500 + i, 600) for i in range(48)}
# Sent while the cache server is down (new prompts, so every one looks up and fails).
OUTAGE = {f"outage-{i}": tokens(700 + i, 600) for i in range(3)}
MAX_TOKENS = 12


def requests() -> list[dict[str, Any]]:
    """Every single-shot request, with its output length."""
    short = {**RESTART, **LOADER, **FAULTS, **RECOVERY, **OUTAGE}
    out = [{"id": k, "prompt": v, "max_tokens": MAX_TOKENS} for k, v in short.items()]
    out += [{"id": k, "prompt": v, "max_tokens": DECODE_TOKENS} for k, v in DECODERS.items()]
    out += [{"id": k, "prompt": v, "max_tokens": PREEMPT_TOKENS} for k, v in PREEMPT.items()]
    return out


def conversations() -> list[dict[str, Any]]:
    """Every multi-round conversation."""
    return [SHARED_CONV, TAIL_CONV, *PRESSURE_CONVS]
