"""The namespace registry against a model: bounded, least recently used first out, counts kept."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.cacheserver.namespaces import NamespaceRegistry

NAMESPACES = [f"{i:064x}" for i in range(8)]
ops = st.lists(
    st.tuples(st.sampled_from(["describe", "lookup", "store", "known"]), st.sampled_from(NAMESPACES)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 5), steps=ops)
def test_registry_matches_an_lru_model(capacity: int, steps: list[tuple[str, str]]) -> None:
    reg = NamespaceRegistry(capacity)
    model: OrderedDict[str, list[int]] = OrderedDict()  # ns -> [hits, misses, stores]
    evicted = 0
    for op, ns in steps:
        if op == "describe":
            reg.describe(ns, {"model": ns[-4:]})
            if ns in model:
                model.move_to_end(ns)
            else:
                model[ns] = [0, 0, 0]
            while len(model) > capacity:
                model.popitem(last=False)
                evicted += 1
        elif op == "lookup":
            assert reg.count_lookup(ns, 2, 1) == (ns in model)
            if ns in model:
                model.move_to_end(ns)
                model[ns][0] += 2
                model[ns][1] += 1
        elif op == "store":
            assert reg.count_stores(ns, 3) == (ns in model)
            if ns in model:
                model.move_to_end(ns)
                model[ns][2] += 3
        else:
            assert reg.known(ns) == (ns in model)
            if ns in model:
                model.move_to_end(ns)
        snap = reg.snapshot()
        assert len(snap) <= capacity
        assert list(snap) == list(model)  # same members, same recency order
        for key, (hits, misses, stores) in model.items():
            entry = snap[key]
            assert (entry.lookup_hits, entry.lookup_misses, entry.stores) == (hits, misses, stores)
            assert entry.fields == {"model": key[-4:]}
        assert reg.evicted == evicted


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    changes=st.dictionaries(
        st.sampled_from(["model_id", "scheme", "tp_rank", "kv_dtype", "new_member", "lora"]), json_values
    ),
    drop=st.sets(st.sampled_from(["scheme", "model_id", "block_size"])),
    claimed=st.sampled_from(["honest", "other"]),
)
def test_a_description_is_accepted_only_when_it_hashes_to_its_namespace(
    changes: dict[str, object], drop: set[str], claimed: str
) -> None:
    import json

    from kvfabric.connector.keys import NamespaceSpec
    from kvfabric.contract.namespace import InvalidDescriptionError, namespace_digest, parse_description

    spec = NamespaceSpec("m", "r", "float32", 2, 1, 4, 16, 32)
    doc = {k: v for k, v in {**spec.document(), **changes}.items() if k not in drop}
    text = json.dumps(doc)
    namespace = spec.digest() if claimed == "honest" else "f" * 64
    try:
        parsed = parse_description(namespace, text)
    except InvalidDescriptionError:
        return
    # Whatever is accepted hashes to the namespace it was accepted for, with the same function
    # the connector derives namespaces with.
    assert namespace_digest(parsed) == namespace
    assert parsed == doc
    assert namespace == spec.digest()
    assert not drop
    assert not changes or all(spec.document().get(k) == v for k, v in changes.items())
