"""Issue 4's GPU check, as one prepared script (run only on a machine with a GPU and vLLM).

    uv pip install vllm && uv run python tests/connector/gpu_check_vllm.py

It starts a real cache server, then runs vLLM (dummy weights, a tiny local Llama config, token-id
prompts, local prefix caching off so that any cached token must come from kvfabric) twice:

1. without the connector: the reference output tokens;
2. with ``KVFabricConnector``: a first request stores the prefix, a second identical request must
   report external cache hits (``num_cached_tokens`` > 0) and produce the same tokens.

Exit code 0 means the check passed; the last line is a JSON summary. Written without access to a
GPU or to vLLM: it has not been run yet (see docs/connector.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
PROMPT = [(i * 7919) % 1000 + 1 for i in range(1000)]

_CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
model, use_connector = sys.argv[1], sys.argv[2] == "1"
kw = {}
if use_connector:
    kw["kv_transfer_config"] = {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": "kvfabric.connector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
          enable_prefix_caching=False, gpu_memory_utilization=0.3, max_model_len=2048, seed=0, **kw)
params = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
prompt = {"prompt_token_ids": json.loads(sys.argv[3])}
outs = []
for _ in range(2 if use_connector else 1):
    o = llm.generate([prompt], params)[0]
    outs.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0})
    time.sleep(2.0)  # let the asynchronous store land
print("RESULT " + json.dumps(outs))
"""


def _run(model: Path, use_connector: bool, env: dict[str, str]) -> list[dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), "1" if use_connector else "0", json.dumps(PROMPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: list[dict[str, object]] = json.loads(line[len("RESULT ") :])
            return result
    raise RuntimeError(f"vLLM run failed (rc {out.returncode}):\n{out.stderr[-6000:]}")


def main() -> int:
    """Run the check; print a JSON summary; return 0 when it passed."""
    from kvfabric.testing.memtransport import CacheServerProcess

    with tempfile.TemporaryDirectory(prefix="kvf-gpu-") as tmp:
        root = Path(tmp)
        model = root / "tiny-llama"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(CONFIG))
        with CacheServerProcess(root, name="gpu-node") as srv:
            env = {**os.environ, **srv.settings_env(), "KVFABRIC_CHUNK_TOKENS": "256"}
            t0 = time.time()
            baseline = _run(model, False, env)
            cached = _run(model, True, env)
    first, second = cached
    summary = {
        "gpu_check": "vllm+kvfabric",
        "baseline_tokens": baseline[0]["tokens"],
        "first_cached_tokens": first["cached"],
        "second_cached_tokens": second["cached"],
        "outputs_equal": baseline[0]["tokens"] == first["tokens"] == second["tokens"],
        "elapsed_s": round(time.time() - t0, 1),
    }
    ok = summary["outputs_equal"] and int(str(second["cached"])) > 0
    summary["passed"] = bool(ok)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
