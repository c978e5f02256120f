"""Fixtures of the real-vLLM tests: the pinned environment, the tiny model, the reference outputs.

Every test here is at the ``vllm`` level of the test ladder (``make test-vllm``) and skips, saying
why, only when the environment that ``scripts/bootstrap.sh`` builds is absent. vLLM start-up costs
one to two minutes per process on this machine, so processes are shared: one offline reference run
(no connector, no prefix caching) produces the expected tokens of every prompt in
:mod:`tests.vllm.workload` for the whole session.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.vllm import workload

from kvfabric.testing.vllmenv import OfflineRun, VllmEnv, find_env, make_tiny_model, skip_reason


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    """The pinned vLLM environment (skip when it is not built)."""
    env = find_env()
    if env is None:
        pytest.skip(skip_reason())
    return env


@pytest.fixture(scope="session")
def vllm_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Logs, specs and outputs of the session's vLLM processes."""
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def tiny_model(vllm_env: VllmEnv, vllm_workdir: Path) -> Path:
    """A random-weight Llama and WordLevel tokenizer generated locally (no hub), once per session."""
    return make_tiny_model(vllm_env, vllm_workdir / "tiny-llama")


def reference_spec(model: Path) -> dict[str, Any]:
    """The run without any cache: no connector and vLLM's own prefix caching off."""
    return {
        "model": str(model),
        "kv_transfer": None,
        "llm": {"enable_prefix_caching": False},
        "requests": workload.requests(),
        "conversations": workload.conversations(),
    }


@pytest.fixture(scope="session")
def reference_run(vllm_env: VllmEnv, tiny_model: Path, vllm_workdir: Path) -> Iterator[OfflineRun]:
    """The reference run, started but not awaited: ``run.result()`` waits for its outputs.

    Deliberately not a fixture that waits: pytest sets up session fixtures before module ones, so
    a waiting one would serialise the reference run before every other vLLM start-up.
    """
    run = OfflineRun(vllm_env, reference_spec(tiny_model), vllm_workdir, name="reference").start()
    yield run
    if run.proc is not None and run.proc.poll() is None:
        run.proc.kill()
