#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC stubs of the cache-server protocol.
# Usage: scripts/gen-proto.sh [OUT_ROOT]   (OUT_ROOT defaults to cacheserver/; tests pass a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-cacheserver}"
mkdir -p "$out"
exec uv run --no-sync python -m grpc_tools.protoc -I cacheserver \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  cacheserver/kvfabric/rpc/v1/cache.proto
