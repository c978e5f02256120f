#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC stubs: the cache-server protocol (cacheserver/) and the
# CSI node plugin's vendored CSI and kubelet plugin-registration protocols (operator/).
# Usage: scripts/gen-proto.sh [OUT_ROOT]   (OUT_ROOT defaults to the repository root; tests pass a
# temp dir and find the stubs under OUT_ROOT/cacheserver and OUT_ROOT/operator)
set -euo pipefail
cd "$(dirname "$0")/.."
root="${1:-.}"
gen() {  # gen SOURCE_ROOT PROTO...
  local src="$1"; shift
  mkdir -p "$root/$src"
  uv run --no-sync python -m grpc_tools.protoc -I "$src" \
    --python_out="$root/$src" --pyi_out="$root/$src" --grpc_python_out="$root/$src" "$@"
}
gen cacheserver cacheserver/kvfabric/rpc/v1/cache.proto
gen operator operator/kvfabric/csi/v1/csi.proto operator/kvfabric/csi/v1/pluginregistration.proto
