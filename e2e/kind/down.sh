#!/usr/bin/env bash
# Delete the kind cluster that e2e/kind/up.sh created. The host directory (NVMe stand-ins, shared
# tier, kubeconfig) is removed too unless KEEP_HOST_DIR=1, and only if up.sh created it (its marker
# file is there and it is this user's): KVFABRIC_KIND_HOST_DIR may name any directory.
#
# Environment: KIND_CLUSTER_NAME (default: kvfabric), KVFABRIC_KIND_HOST_DIR (default: /tmp/kvfabric-kind).
set -euo pipefail

CLUSTER="${KIND_CLUSTER_NAME:-kvfabric}"
HOST_DIR="${KVFABRIC_KIND_HOST_DIR:-/tmp/kvfabric-kind}"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

command -v kind >/dev/null 2>&1 ||
  { echo "error: 'kind' is not on PATH (install it: go install sigs.k8s.io/kind@v0.33.0)" >&2; exit 1; }

if kind get clusters 2>/dev/null | grep -qx "${CLUSTER}"; then
  say "deleting the kind cluster '${CLUSTER}'"
  kind delete cluster --name "${CLUSTER}"
else
  say "no kind cluster named '${CLUSTER}'"
fi

if [ "${KEEP_HOST_DIR:-0}" = 1 ] || [ ! -e "${HOST_DIR}" ]; then
  :
elif [ -L "${HOST_DIR}" ] || [ ! -d "${HOST_DIR}" ] || [ ! -O "${HOST_DIR}" ] ||
  [ ! -f "${HOST_DIR}/.kvfabric-kind-host-dir" ] || [ ! -O "${HOST_DIR}/.kvfabric-kind-host-dir" ]; then
  say "leaving ${HOST_DIR}: e2e/kind/up.sh did not create it (no .kvfabric-kind-host-dir marker of this user's)"
else
  say "removing ${HOST_DIR}"
  # Files written by the cache servers inside the nodes may belong to another uid.
  rm -rf "${HOST_DIR}" 2>/dev/null ||
    echo "warning: could not remove all of ${HOST_DIR} (files owned by the containers' users); remove it with sudo" >&2
fi
