"""The vLLM adapter: namespace from vLLM's config, role mapping, and (with vLLM) the real factory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvfabric.connector import vllm as kvvllm
from kvfabric.connector.steps import Role

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)


class _Model:
    model = "org/tiny"
    revision = "abc123"
    dtype = "torch.bfloat16"

    def get_num_layers(self, parallel: Any) -> int:
        return 2

    def get_num_kv_heads(self, parallel: Any) -> int:
        return 2

    def get_head_size(self) -> int:
        return 16


def fake_vllm_config(**extra: Any) -> Any:
    return SimpleNamespace(
        model_config=_Model(),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
    )


def test_constructs_without_vllm_and_derives_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFABRIC_SOCKET", raising=False)
    monkeypatch.delenv("KVFABRIC_REMOTE", raising=False)
    sched = kvvllm.KVFabricConnector(fake_vllm_config(chunk_tokens=40), SimpleNamespace(name="SCHEDULER"))
    worker = kvvllm.KVFabricConnector(fake_vllm_config(chunk_tokens=40), SimpleNamespace(name="WORKER"))
    assert sched.core.role is Role.SCHEDULER
    assert worker.core.role is Role.WORKER
    assert sched.core.chunk_tokens == 48  # rounded up to a multiple of the block size
    assert sched.core.spec.kv_dtype == "bfloat16"
    assert sched.core.spec.model_revision == "abc123"
    assert sched.core.namespace == worker.core.namespace
    # No server configured: every answer is "no hit", never an error.
    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(200)), lora_request=None)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None))
    assert isinstance(meta, kvvllm.KVFabricMetadata)
    assert sched.request_finished(req, [1, 2]) == (False, None)
    sched.shutdown()
    worker.shutdown()


def test_revision_and_dtype_change_namespace() -> None:
    from kvfabric.connector.settings import ConnectorSettings

    s = ConnectorSettings(chunk_tokens=32)
    a = kvvllm.namespace_spec_from_vllm(fake_vllm_config(), s, 0)
    cfg = fake_vllm_config()
    cfg.cache_config.cache_dtype = "fp8_e4m3"
    b = kvvllm.namespace_spec_from_vllm(cfg, s, 0)
    cfg2 = fake_vllm_config()
    cfg2.model_config.revision = "def456"
    c = kvvllm.namespace_spec_from_vllm(cfg2, s, 0)
    assert len({a.digest(), b.digest(), c.digest()}) == 3


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (it needs a GPU build); the connector is tested on duck-typed objects",
)
def test_constructs_under_vllm_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # pragma: no cover
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    monkeypatch.delenv("KVFABRIC_SOCKET", raising=False)
    monkeypatch.delenv("KVFABRIC_REMOTE", raising=False)
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "vocab_size": 512,
                "max_position_embeddings": 4096,
                "torch_dtype": "float32",
            }
        )
    )
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVFabricConnector",
            kv_connector_module_path="kvfabric.connector.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"chunk_tokens": 32},
        ),
    )
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
    assert isinstance(connector, kvvllm.KVFabricConnector)
    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(100)), lora_request=None)
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
    connector.update_state_after_alloc(
        req, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3, 4, 5, 6],)), 0
    )
    assert connector.request_finished(req, [0, 1]) == (False, None)
    connector.shutdown()


class _TinyModel(_Model):
    model = "kvfabric/ref-llama"
    revision = "seed-0"
    dtype = "torch.float32"


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="with vLLM installed the adapter subclasses the real base, covered by the factory test",
)
def test_adapter_drives_a_real_server_through_the_reference_engine(tmp_path: Path) -> None:
    import torch

    from kvfabric.refengine.engine import Engine
    from kvfabric.refengine.model import RefModel
    from kvfabric.refengine.testing import TINY, prompt
    from kvfabric.testing.memtransport import CacheServerProcess

    model = RefModel(TINY)
    tokens = prompt(200, 31)
    ref = Engine(TINY, num_blocks=64, model=model).generate(tokens, 3)
    with CacheServerProcess(tmp_path, name="v") as srv:
        extra = {"socket": str(srv.socket), "shm_dir": str(srv.shm_dir), "chunk_tokens": 32}
        results = []
        for _ in range(2):
            cfg = fake_vllm_config(**extra)
            cfg.model_config = _TinyModel()
            cfg.cache_config.cache_dtype = "float32"
            halves = (
                kvvllm.KVFabricConnector(cfg, SimpleNamespace(name="SCHEDULER"), None),
                kvvllm.KVFabricConnector(cfg, SimpleNamespace(name="WORKER"), None),
            )
            eng = Engine(TINY, num_blocks=64, model=model, connectors=halves)
            results.append(eng.generate(tokens, 3))
            assert halves[1].worker_half.wait_for_stores(60)
            eng.close()
    cold, warm = results
    assert (cold.hit_tokens, warm.hit_tokens, warm.tier) == (0, 192, "dram")
    for r in results:
        assert torch.max(torch.abs(r.first_logits - ref.first_logits)).item() <= 1e-5
        assert r.output_token_ids == ref.output_token_ids
