from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [
    f"cacheserver/kvfabric/rpc/v1/cache_{suffix}" for suffix in ("pb2.py", "pb2.pyi", "pb2_grpc.py")
] + [
    f"operator/kvfabric/csi/v1/{proto}_{suffix}"
    for proto in ("csi", "pluginregistration")
    for suffix in ("pb2.py", "pb2.pyi", "pb2_grpc.py")
]


@pytest.mark.process
def test_committed_stubs_equal_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run([str(ROOT / "scripts" / "gen-proto.sh"), str(tmp_path)], check=True, cwd=ROOT)
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / name).read_text()
        assert fresh == committed, f"{name} is stale: run scripts/gen-proto.sh"


def test_generated_modules_import_under_this_runtime() -> None:
    from kvfabric.rpc.v1 import cache_pb2, cache_pb2_grpc

    assert cache_pb2.DESCRIPTOR.package == "kvfabric.rpc.v1"
    assert hasattr(cache_pb2_grpc, "CacheStub")
    from kvfabric.csi.v1 import csi_pb2, csi_pb2_grpc, pluginregistration_pb2

    # The wire names the kubelet calls (/csi.v1.Node/..., /pluginregistration.Registration/...).
    assert csi_pb2.DESCRIPTOR.package == "csi.v1"
    assert pluginregistration_pb2.DESCRIPTOR.package == "pluginregistration"
    assert hasattr(csi_pb2_grpc, "NodeStub")
