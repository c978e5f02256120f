"""``kvfabric engine``: run the torch reference engine on token-id prompts.

- ``kvfabric engine run [--prompts FILE]``: one prompt per line (a JSON list of token ids, or an
  object ``{"prompt_token_ids": [...], "max_tokens": N}``); prints one JSON line per request with
  its TTFT, hit tokens, source tier and fallback reason.
- ``kvfabric engine serve --host H --port P``: the HTTP JSON server (see ``refengine.server``).

Connector settings come from the ``KVFABRIC_*`` environment (what the operator injects); without a
socket or remote the engine runs without a cache. Only the standard library is imported until a
subcommand runs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

# Shown by `kvfabric --help`; this module is registered under the kvfabric.commands entry points.
SUMMARY = "run the torch reference engine on token-id prompts"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``run`` and ``serve`` subcommands."""
    sub = parser.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    for name, text in (("run", "run prompts from a file or stdin"), ("serve", "serve HTTP /generate")):
        p = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        p.add_argument("--preset", default="tiny", help="model size: tiny or bench (default: tiny)")
        p.add_argument("--seed", type=int, default=0, help="weight seed (the model revision)")
        p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
        p.add_argument("--max-model-len", type=int, default=32768, help="longest prompt + output")
        p.add_argument("--no-cache", action="store_true", help="ignore KVFABRIC_* and never use a cache")
        p.add_argument(
            "--max-prefill-tokens",
            type=int,
            default=None,
            help="prefill in steps of this many tokens (chunked prefill)",
        )
        p.add_argument(
            "--kv-transfer-config",
            metavar="JSON",
            help="vLLM-style connector config; its kv_connector_extra_config overrides KVFABRIC_* settings "
            "(accepted so that a pod injected like a vLLM pod runs unchanged)",
        )
        if name == "run":
            p.add_argument("--prompts", default="-", help="file of prompts, one per line ('-': stdin)")
            p.add_argument("--max-tokens", type=int, default=1, help="tokens to generate per prompt")
        else:
            p.add_argument("--host", default="127.0.0.1", help="address to bind")
            p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")


def _engine(args: argparse.Namespace) -> Any:
    from kvfabric.connector.settings import ConnectorSettings
    from kvfabric.refengine.engine import Engine
    from kvfabric.refengine.presets import preset

    extra: dict[str, Any] = {}
    if args.kv_transfer_config:
        doc = json.loads(args.kv_transfer_config)
        extra = dict(doc.get("kv_connector_extra_config") or {}) if isinstance(doc, dict) else {}
    settings = None if args.no_cache else ConnectorSettings.load(extra)
    blocks = -(-args.max_model_len // args.block_size) + 1
    return Engine(
        preset(args.preset, args.seed),
        num_blocks=blocks,
        block_size=args.block_size,
        settings=settings,
        max_prefill_tokens=args.max_prefill_tokens,
    )


def _run(args: argparse.Namespace) -> int:
    from kvfabric.refengine.server import parse_request, result_json

    engine = _engine(args)
    stream = sys.stdin if args.prompts == "-" else open(args.prompts, encoding="utf-8")  # noqa: SIM115
    try:
        for i, line in enumerate(stream):
            if not line.strip():
                continue
            doc = json.loads(line)
            if isinstance(doc, list):
                doc = {"prompt_token_ids": doc, "max_tokens": args.max_tokens}
            ids, max_tokens = parse_request(doc, engine.config.vocab_size)
            out = result_json(engine.generate(ids, max_tokens))
            print(json.dumps({"request": i, "prompt_tokens": len(ids), **out}), flush=True)
        if engine.worker_conn is not None:
            engine.worker_conn.wait_for_stores(30.0)
    finally:
        if stream is not sys.stdin:
            stream.close()
        engine.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging
    import threading

    from kvfabric.refengine.server import EngineHTTPServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    engine = _engine(args)
    httpd = EngineHTTPServer((args.host, args.port), engine)

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    host, port = httpd.server_address[:2]
    print(json.dumps({"listening": f"http://{host!s}:{port}"}), flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        httpd.server_close()
        engine.close()
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the chosen action."""
    if args.engine_command == "run":
        return _run(args)
    return _serve(args)
