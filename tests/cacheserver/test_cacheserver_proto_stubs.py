from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("cache_pb2.py", "cache_pb2.pyi", "cache_pb2_grpc.py")


def test_committed_stubs_equal_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run([str(ROOT / "scripts" / "gen-proto.sh"), str(tmp_path)], check=True, cwd=ROOT)
    for name in GENERATED:
        fresh = (tmp_path / "kvfabric" / "rpc" / "v1" / name).read_text()
        committed = (ROOT / "cacheserver" / "kvfabric" / "rpc" / "v1" / name).read_text()
        assert fresh == committed, f"{name} is stale: run scripts/gen-proto.sh"


def test_generated_modules_import_under_this_runtime() -> None:
    from kvfabric.rpc.v1 import cache_pb2, cache_pb2_grpc

    assert cache_pb2.DESCRIPTOR.package == "kvfabric.rpc.v1"
    assert hasattr(cache_pb2_grpc, "CacheStub")
