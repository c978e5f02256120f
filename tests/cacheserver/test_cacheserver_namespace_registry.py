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
