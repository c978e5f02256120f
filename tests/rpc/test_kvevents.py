"""KV events on the wire: kvfabric's encoder writes exactly the bytes vLLM's own classes write.

The golden vectors (``kvevents_golden.json``) were produced by vLLM 0.32's ``KVEventBatch`` and
msgspec (``scripts/kvevents-golden.py``); the ``vllm``-level test reruns that script so a vLLM pin
change that alters the wire shows up here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.rpc import kvevents as kv
from kvfabric.testing import vllmenv

GOLDEN = Path(__file__).with_name("kvevents_golden.json")
SCRIPT = vllmenv.ROOT / "scripts" / "kvevents-golden.py"


def _value(raw: Any) -> Any:
    if isinstance(raw, dict) and set(raw) == {"hex"}:
        return bytes.fromhex(raw["hex"])
    if isinstance(raw, list):
        return tuple(_value(v) for v in raw)
    return raw


def _event(spec: dict[str, Any]) -> kv.Event:
    cls = {
        "BlockStored": kv.BlockStored,
        "BlockRemoved": kv.BlockRemoved,
        "AllBlocksCleared": kv.AllBlocksCleared,
    }[spec["type"]]
    return cls(**{k: _value(v) for k, v in spec.items() if k != "type"})  # type: ignore[no-any-return]


def _cases() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())["cases"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(_cases()))
def test_encoder_writes_vllms_bytes(name: str) -> None:
    case = _cases()[name]
    batch = case["batch"]
    events = [_event(e) for e in batch["events"]]
    assert kv.encode_batch(batch["ts"], events, batch["rank"]).hex() == case["hex"]


@pytest.mark.parametrize("name", sorted(_cases()))
def test_decoder_reads_vllms_bytes_back(name: str) -> None:
    case = _cases()[name]
    ts, events, rank = kv.decode_batch(bytes.fromhex(case["hex"]))
    assert (ts, rank) == (case["batch"]["ts"], case["batch"]["rank"])
    assert events == [_event(e) for e in case["batch"]["events"]]


def test_decoder_reads_the_positional_form_too() -> None:
    """Older vLLMs and the reference adapters' tests send events as tagged arrays, trailing defaults cut."""
    raw = kv.msgpack_encode(
        [
            1.0,
            [["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None, "CPU"], ["BlockRemoved", [2], "CPU"]],
            None,
        ]
    )
    _, events, _ = kv.decode_batch(raw)
    assert events == [
        kv.BlockStored((1, 2), None, (5, 6, 7, 8), 2, None, "CPU", None),
        kv.BlockRemoved((2,), "CPU"),
    ]


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=70)
    | st.binary(max_size=70)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=8), inner, max_size=20),
    max_leaves=60,
)


@given(_values)
def test_msgpack_round_trips(value: Any) -> None:
    assert kv.msgpack_decode(kv.msgpack_encode(value)) == value


@pytest.mark.parametrize(
    ("value", "marker"),
    [
        (list(range(70_000)), 0xDD),
        ("x" * 70_000, 0xDB),
        (b"x" * 70_000, 0xC6),
        ({str(i): i for i in range(70_000)}, 0xDF),
    ],
)
def test_32_bit_lengths_use_msgpacks_32_bit_forms(value: Any, marker: int) -> None:
    """Lengths past 65,535 (not in the golden file, to keep it small) take the 32-bit forms."""
    raw = kv.msgpack_encode(value)
    assert raw[0] == marker
    assert kv.msgpack_decode(raw) == value


@pytest.mark.parametrize("bad", [b"", b"\x93\xcb", b"\xc1", b"\x90\x90"])
def test_bad_bytes_are_a_decode_error(bad: bytes) -> None:
    with pytest.raises(kv.DecodeError):
        kv.msgpack_decode(bad)


def test_tier_media() -> None:
    assert kv.scope_of_tier("dram") == kv.Scope("CPU")
    assert kv.scope_of_tier("local_disk") == kv.Scope("STORAGE", "LOCAL")
    assert kv.scope_of_tier("shared") is None
    assert kv.scope_of_tier("object") is None
    with pytest.raises(ValueError, match="tier must be one of"):
        kv.scope_of_tier("gpu")


@pytest.mark.vllm
def test_golden_vectors_are_what_the_pinned_vllm_writes() -> None:
    env = vllmenv.find_env()
    if env is None:
        pytest.skip(vllmenv.skip_reason())
    out = subprocess.run(
        [str(env.python), str(SCRIPT)], capture_output=True, text=True, check=True, timeout=150
    )
    assert json.loads(out.stdout) == json.loads(GOLDEN.read_text())
