"""A small HTTP JSON server around the reference engine: the "inference pod" of end-to-end tests.

``POST /generate {"prompt_token_ids": [...], "max_tokens": N}`` answers
``{"output_token_ids", "ttft_ms", "hit_tokens", "tier", "fallback_reason"}``; ``GET /healthz`` answers
200 while the engine is up; ``GET /stats`` returns the connector's counters. Requests are served one
at a time (the engine has one KV cache); the cache can never fail a request, only bad input can.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvfabric.refengine.engine import Engine, GenerateResult, OutOfBlocksError

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20


def result_json(r: GenerateResult) -> dict[str, Any]:
    """The JSON form of one request's outcome."""
    return {
        "output_token_ids": r.output_token_ids,
        "ttft_ms": round(r.ttft_s * 1000, 3),
        "hit_tokens": r.hit_tokens,
        "tier": r.tier,
        "fallback_reason": r.fallback_reason,
    }


def parse_request(body: Any, vocab_size: int) -> tuple[list[int], int]:
    """Validate a /generate body; raise ``ValueError`` with a readable message."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    ids = body.get("prompt_token_ids")
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise ValueError("prompt_token_ids must be a non-empty list of integers")
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"token ids must be in [0, {vocab_size})")
    max_tokens = body.get("max_tokens", 1)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 4096:
        raise ValueError("max_tokens must be an integer in [1, 4096]")
    return ids, max_tokens


class _Handler(BaseHTTPRequestHandler):
    server: EngineHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: HTTPStatus, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, {"status": "ok"})
        elif self.path == "/stats":
            self._send(HTTPStatus.OK, self.server.stats())
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": "not found"})

    def do_POST(self) -> None:
        if self.path != "/generate":
            self._send(HTTPStatus.NOT_FOUND, {"error": "not found"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_BODY:
                raise ValueError("missing or oversized body")
            ids, max_tokens = parse_request(json.loads(self.rfile.read(length)), self.server.vocab_size)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        try:
            result = self.server.engine.generate(ids, max_tokens)
        except OutOfBlocksError as exc:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": str(exc)})
            return
        except Exception as exc:  # a bug must not kill the server; report it
            log.exception("generate failed")
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": repr(exc)})
            return
        self._send(HTTPStatus.OK, result_json(result))


class EngineHTTPServer(ThreadingHTTPServer):
    """HTTP server owning one engine."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: Engine) -> None:
        super().__init__(address, _Handler)
        self.engine = engine
        self.vocab_size = engine.config.vocab_size
        self._lock = threading.Lock()

    def stats(self) -> dict[str, Any]:
        """Connector counters and the engine's identity."""
        conn = self.engine.scheduler_conn
        return {
            "model": self.engine.config.as_dict(),
            "namespace": conn.namespace if conn else None,
            "counters": conn.counters.snapshot() if conn else {},
        }
