"""``kvfabric bench gpu``: the performance issue's GPU check, as one prepared script.

Run on a machine with a CUDA GPU and PyTorch (vLLM is not needed)::

    uv run kvfabric bench gpu            # or: python -m kvfabric.bench.gpu

It starts a real cache server on this machine and measures, in one run:

* ``pinned_h2d_gbps`` — the baseline: ``cudaMemcpy`` (``Tensor.copy_``) of one chunk's bytes from
  pinned host memory to the device;
* ``pageable_h2d_gbps`` — the same from ordinary (pageable) host memory;
* ``restore_h2d_gbps`` — what the connector achieves: the reference engine on the GPU loads a hit
  from the server's DRAM tier into its device KV cache (bytes restored / seconds the forward was
  blocked restoring), at 8k and 32k tokens;
* TTFT cold (recompute) and warm (hit) at 8k and 32k tokens.

Target: ``restore_h2d_gbps >= 0.8 x pinned_h2d_gbps``. Prints the target table and a JSON line.
Exit 2 when no GPU is present. Written without access to a GPU: it has not been run yet
(docs/performance.md says so, and what to look at when it is).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["configure", "run"]

SUFFIX = 32


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the options."""
    parser.add_argument("--sizes", default="8192,32768", help="prompt lengths (default 8192,32768)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per measurement (default 3)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")


def _to_device(obj: Any, device: Any) -> Any:
    """Move every tensor reachable from ``obj`` (attributes, dicts, lists) to ``device``."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    return obj


def _h2d(nbytes: int, pinned: bool, rounds: int) -> list[float]:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def run(args: argparse.Namespace) -> int:
    """Run the check; the last line printed is JSON."""
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU machine", file=sys.stderr)
        return 2

    from kvfabric.bench.report import Target, judge, spread, table
    from kvfabric.connector.settings import ConnectorSettings
    from kvfabric.refengine.engine import Engine
    from kvfabric.refengine.model import RefModel
    from kvfabric.refengine.presets import preset
    from kvfabric.refengine.testing import prompt
    from kvfabric.testing.memtransport import CacheServerProcess

    sizes = [int(x) for x in str(args.sizes).split(",")]
    chunk = args.chunk_tokens
    cfg = preset("bench")
    model = RefModel(cfg)
    for name, value in list(vars(model).items()):
        setattr(model, name, _to_device(value, "cuda"))
    blocks = (max(sizes) + SUFFIX + 16) // 16 + 2
    res: dict[str, Any] = {"bench": "gpu", "device": torch.cuda.get_device_name(0), "sizes": sizes}
    spreads = {}
    payload = cfg.kv_bytes_per_token * chunk
    spreads["pinned_h2d_gbps"] = spread(_h2d(payload * 64, True, args.rounds))
    spreads["pageable_h2d_gbps"] = spread(_h2d(payload * 64, False, args.rounds))
    with tempfile.TemporaryDirectory(prefix="kvf-gpu-") as tmp:
        srv = CacheServerProcess(Path(tmp), name="gpu", dram_bytes=8 << 30, local_disk=False)
        srv.start()
        try:
            st = ConnectorSettings(
                socket=str(srv.socket), shared_memory=True, chunk_tokens=chunk,
                lookup_deadline_ms=1000, load_deadline_ms=30000, store_deadline_ms=30000,
                cost_model=False,
            )  # fmt: skip
            # KV caches (and every tensor the forward creates) on the GPU.
            torch.set_default_device("cuda")
            try:
                off = Engine(cfg, num_blocks=blocks, model=model)
                on = Engine(cfg, num_blocks=blocks, settings=st, model=model)
            finally:
                torch.set_default_device("cpu")
            torch.set_default_device("cuda")
            try:
                for n in sizes:
                    tokens = prompt(n + SUFFIX, n, cfg.vocab_size)
                    cold = [off.generate(tokens, 1).ttft_s for _ in range(args.rounds)]
                    on.generate(tokens, 1)  # stores
                    assert on.worker_conn is not None
                    on.worker_conn.wait_for_stores(120)
                    warm, bw = [], []
                    for _ in range(args.rounds):
                        r = on.generate(tokens, 1)
                        if r.hit_tokens == 0:
                            raise RuntimeError(f"expected a hit at {n} tokens, got {r.fallback_reason}")
                        warm.append(r.ttft_s)
                        bw.append((r.hit_tokens // chunk) * payload / r.restore_s / 1e9)
                    spreads[f"ttft_cold_{n}_ms"] = spread([x * 1e3 for x in cold])
                    spreads[f"ttft_hit_{n}_ms"] = spread([x * 1e3 for x in warm])
                    spreads[f"restore_h2d_gbps_{n}"] = spread(bw)
                    ratio = [b / spreads["pinned_h2d_gbps"].median for b in bw]
                    spreads[f"restore_over_pinned_{n}"] = spread(ratio)
            finally:
                torch.set_default_device("cpu")
                on.close()
                off.close()
        finally:
            srv.close()
    targets = [
        Target(
            f"restore host->device / pinned cudaMemcpy at {n} tokens", f"restore_over_pinned_{n}", ">=", 0.8
        )
        for n in sizes
    ]
    res["spread"] = {k: v.as_dict() for k, v in spreads.items()}
    res["targets"] = judge(targets, spreads)
    for k, v in spreads.items():
        print(f"{k:<32} {v.text():>28}")
    print(table(res["targets"]))
    print(json.dumps(res), flush=True)
    return 0


def main() -> int:
    """Run as ``python -m kvfabric.bench.gpu``."""
    parser = argparse.ArgumentParser(prog="kvfabric bench gpu", description=__doc__)
    configure(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
