#!/usr/bin/env bash
# Installs everything kvfabric's demo and tests need on a fresh Debian machine, idempotently:
# Debian packages (redis-server for the storage benchmark's baseline, prometheus and promtool for the
# dashboard and alert tests), Go >= 1.26 (scripts/install-go.sh), uv, the Python environment
# (.venv, from uv.lock), the pinned Kubernetes binaries and kubelet, the pinned S3 server (SeaweedFS,
# for the object-store tier's tests) and the pinned Helm and Prometheus Operator CRDs (the chart's and
# the monitors' tests), all built from the Go module proxy into ~/.cache/kvfabric and
# reused when present, and the container engine and images (scripts/bootstrap-containers.sh). A warm
# machine finishes in seconds.
#
# `scripts/bootstrap.sh --demo` installs only what `make demo` and `kvfabric cluster` need (the Python
# environment, about 3 GB of wheels to download on a fresh machine, most of them torch's CUDA build;
# and the control-plane binaries, about 7.5 minutes to build on 2 cores), not the images, the kubelet,
# the vLLM environment or the S3 server that only the tests use.
set -euo pipefail
DEMO_ONLY=0
[ "${1:-}" = "--demo" ] && DEMO_ONLY=1
cd "$(dirname "$0")/.."
say() { printf '[bootstrap] %s\n' "$*" >&2; }

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v shellcheck >/dev/null || need_apt+=(shellcheck)
command -v curl >/dev/null || need_apt+=(curl)
command -v ip >/dev/null || need_apt+=(iproute2)
[ "$DEMO_ONLY" = 1 ] || command -v promtool >/dev/null || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

scripts/install-go.sh  # Go >= 1.26 (Debian's golang-go is 1.19: it only fetches the real one)

# uv, from PyPI. Debian's python3 refuses `pip install` outside a virtual environment (PEP 668), so
# uv gets a virtual environment of its own under ~/.cache/kvfabric and a link on the PATH.
if ! command -v uv >/dev/null; then
  say "installing uv (in its own virtual environment, ~/.cache/kvfabric/uv)"
  uv_venv="$HOME/.cache/kvfabric/uv"
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
  fi
  if ! { python3 -m venv "$uv_venv" && "$uv_venv/bin/python" -m pip install -q --disable-pip-version-check uv; }; then
    say "could not install uv; install it yourself (pipx install uv, or https://docs.astral.sh/uv/) and run this again"
    exit 1
  fi
  $SUDO ln -sf "$uv_venv/bin/uv" /usr/local/bin/uv
fi

say "syncing the Python environment (.venv)"
uv sync --all-extras --frozen --quiet

if [ "$DEMO_ONLY" = 1 ]; then
  say "building or finding the pinned control-plane binaries"
  uv run --frozen kvfabric cluster build 2>&1 >/dev/null | { grep --line-buffered -v '^go: downloading' >&2 || true; }
  say "done (demo only: images, kubelet, vLLM env and S3 server are built by 'make test')"
  exit 0
fi

# The slow steps overlap: the Go builds (control plane, then the kubelet; CPU-bound) run in the
# background while the container images build (debootstrap and PyPI downloads; mostly network).
say "building or finding the pinned control-plane and kubelet binaries (in the background)"
# Its progress lines are interleaved with the image builds' (each line says which step it is from).
(set -o pipefail; uv run --frozen kvfabric cluster build --kubelet 2>&1 >/dev/null | { grep --line-buffered -v '^go: downloading' >&2 || true; }) &
go_pid=$!
scripts/bootstrap-containers.sh

say "building or finding the pinned vLLM environment (real-vLLM tests; KVFABRIC_SKIP_VLLM=1 skips)"
scripts/vllm-env.sh >/dev/null

wait "$go_pid"

# After the other Go builds, not beside them: both are CPU-bound (a cold SeaweedFS build is ~20 min
# on two busy cores, under a minute with the Go caches warm, nothing when the binary is cached).
say "building or finding the pinned S3 server (SeaweedFS) for the object-store tier"
uv run --frozen python -m kvfabric.testing.s3server build >/dev/null
# About 3 minutes cold on two cores, nothing when cached.
say "building or finding the pinned Helm and the Prometheus Operator's CRDs"
uv run --frozen python -m kvfabric.testing.opstools build >/dev/null
# Dynamo's KV indexer, the independent router index of the routing tests (a PyPI wheel, own venv).
say "installing or finding Dynamo's KV indexer (routing tests)"
uv run --frozen python -m kvfabric.testing.dynamoindexer build >/dev/null
say "done"
