"""vLLM's KV-event publisher for injected engines: the ``--kv-events-config`` a pool asks for.

Pure functions of a container and the pool's ``spec.consumers.routingEvents``. The injected
configuration publishes over ZMQ on ``tcp://*:<port>`` with a replay socket on
``tcp://*:<replayPort>`` (llm-d's per-endpoint discovery dials both), under the topic
``kv@$(POD_IP):<serving port>@<model>``: the kubelet expands ``$(POD_IP)`` from the environment
entry added beside it (the pod's IP, from the downward API). A ``--kv-events-config`` the pod sets
itself is left alone. See docs/routing.md.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

KV_EVENTS_FLAG: Final = "--kv-events-config"
POD_IP_VAR: Final = "POD_IP"
LLMD_LABEL: Final = "llm-d.ai/inference-serving"
DEFAULT_SERVING_PORT: Final = 8000


@dataclass(frozen=True)
class RoutingEventsSettings:
    """What a pool's ``spec.consumers.routingEvents`` asks of every injected engine."""

    port: int = 5556
    replay_port: int = 5557
    model_name: str | None = None
    llmd_label: bool = True


def _words(container: Mapping[str, Any]) -> list[str]:
    words = [str(w) for w in (container.get("command") or []) + (container.get("args") or [])]
    out: list[str] = []
    for w in words:  # a `sh -c "vllm serve ..."` script is one word: split it too
        if " " in w and "vllm" in w:
            try:
                out += shlex.split(w)
            except ValueError:  # unbalanced quotes: still a pod we must not fail on
                out += w.split()
        else:
            out.append(w)
    return out


def _flag(words: Sequence[str], name: str) -> str | None:
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w[len(name) + 1 :]
    return None


def served_model(container: Mapping[str, Any]) -> str | None:
    """The model name requests carry: ``--served-model-name``, else the model vLLM serves."""
    words = _words(container)
    named = _flag(words, "--served-model-name") or _flag(words, "--model")
    if named:
        return named
    if "serve" in words:
        rest = words[words.index("serve") + 1 :]
        if rest and not rest[0].startswith("-"):
            return rest[0]
    args = [str(a) for a in container.get("args") or []]
    if not container.get("command") and args and not args[0].startswith("-"):
        return args[0]  # the vllm-openai image's entrypoint is `vllm serve`: args start with the model
    return None


def serving_port(container: Mapping[str, Any]) -> int:
    """The port vLLM's API server listens on (``--port``, default 8000)."""
    value = _flag(_words(container), "--port")
    return int(value) if value is not None and value.isdigit() else DEFAULT_SERVING_PORT


def has_kv_events_config(container: Mapping[str, Any]) -> bool:
    """Whether the container configures vLLM's KV events itself."""
    return any(KV_EVENTS_FLAG in w for w in _words(container))


def kv_events_config(settings: RoutingEventsSettings, container: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``--kv-events-config`` for ``container``, or None when no model name can be found."""
    model = settings.model_name or served_model(container)
    if not model or "@" in model:
        return None
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{settings.port}",
        "replay_endpoint": f"tcp://*:{settings.replay_port}",
        "topic": f"kv@$({POD_IP_VAR}):{serving_port(container)}@{model}",
    }


def add_kv_events_config(container: dict[str, Any], settings: RoutingEventsSettings) -> str:
    """Add the flag (and ``POD_IP``) to a vLLM container; return a note of what was done."""
    name = str(container.get("name", ""))
    if has_kv_events_config(container):
        return f"{name}:user-set"
    config = kv_events_config(settings, container)
    if config is None:
        return f"{name}:no-model-name"
    value = json.dumps(config, separators=(",", ":"))
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    shell = bool(command) and command[0] in ("sh", "bash", "/bin/sh", "/bin/bash") and "-c" in command[1:3]
    if shell:
        holder, index = (args, 0) if len(command) <= 2 and args else (command, 2)
        if index >= len(holder) or "\n" in str(holder[index]).strip() or "vllm" not in str(holder[index]):
            return f"{name}:shell-not-modified"
        holder[index] = f"{str(holder[index]).rstrip()} {KV_EVENTS_FLAG} {shlex.quote(value)}"
        container["args" if holder is args else "command"] = holder
    else:
        container["args"] = [*args, KV_EVENTS_FLAG, value]
    env = container.get("env") or []
    if not any(e.get("name") == POD_IP_VAR for e in env):
        # Before any entry that might refer to it: $(VAR) expands only variables defined earlier.
        env.insert(0, {"name": POD_IP_VAR, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    container["env"] = env
    return f"{name}:kv-events"


def label_for_llmd(labels: dict[str, str], settings: RoutingEventsSettings) -> None:
    """Label an engine pod the way llm-d's default endpoint selector finds it (unless the pool opts out)."""
    if settings.llmd_label:
        labels.setdefault(LLMD_LABEL, "true")
