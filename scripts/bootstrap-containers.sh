#!/usr/bin/env bash
# The container levels of the tests (images built and smoke-tested; real kubelets), on a Debian
# machine without any container registry: Debian's docker.io (dockerd, containerd, runc), debootstrap,
# busybox-static and the CNI plugins; then `kvfabric images build`, which starts a private dockerd,
# makes the base images locally (debootstrap, a CPython 3.12 stand-in for python:3.12-slim-bookworm,
# busybox) and builds the four images. Every step is skipped when its inputs' digest is built, so a
# warm machine finishes in seconds. Called by scripts/bootstrap.sh; KVFABRIC_SKIP_IMAGES=1 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[bootstrap %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
if [ "${KVFABRIC_SKIP_IMAGES:-0}" = 1 ]; then say "KVFABRIC_SKIP_IMAGES=1: no images"; exit 0; fi

SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
need_apt=()
command -v dockerd >/dev/null || need_apt+=(docker.io)
command -v containerd >/dev/null || need_apt+=(containerd)
command -v runc >/dev/null || need_apt+=(runc)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
command -v jq >/dev/null || need_apt+=(jq)
command -v iptables >/dev/null || need_apt+=(iptables)
dpkg -s busybox-static >/dev/null 2>&1 || need_apt+=(busybox-static)
[ -x /usr/lib/cni/bridge ] || need_apt+=(containernetworking-plugins)
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing Debian packages: ${need_apt[*]}"
  for attempt in 1 2 3 4 5; do  # another apt may hold the lock for a while
    if $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
         --no-install-recommends "${need_apt[@]}" >/dev/null; then break; fi
    [ "$attempt" = 5 ] && exit 1
    say "apt-get failed (locked?); retrying in 20 s"; sleep 20
  done
fi

# Torch for the engine image: PyPI's build as uv.lock pins it (the PyTorch CPU index is unreachable
# here); KVFABRIC_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where it is reachable.
say "building the base images and kvfabric's images (skipped when current)"
uv run --frozen kvfabric images build --torch-index-url "${KVFABRIC_TORCH_INDEX_URL:-lock}"
uv run --frozen kvfabric images sizes >&2
