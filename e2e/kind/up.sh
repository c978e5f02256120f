#!/usr/bin/env bash
# Run kvfabric's e2e suite on a kind cluster: create the cluster (e2e/kind/kind-config.yaml), make its
# workers look like GPU nodes, build and load the images (images/), install the operator
# (manifests/overlays/kind) and the shared-tier volumes, then run the e2e tests meant for an existing
# cluster (`pytest e2e -m fabric`; the real-kubelet and vLLM levels run their own nodes and engines on
# this host, so they are not selected, and a guard in e2e/conftest.py refuses any kubelet, container
# runtime, control-plane or pod-runner process the run would start on the host).
#
#   e2e/kind/up.sh                 # everything; extra arguments go to pytest (e.g. -k hit -x)
#   SKIP_BUILD=1 e2e/kind/up.sh    # reuse images already loaded into the cluster
#   SKIP_TESTS=1 e2e/kind/up.sh    # leave a ready cluster, run nothing
#   KIND_NODE_IMAGE=kvfabric.local/kind-node:v1.36.3-… e2e/kind/up.sh   # a locally built node image
#   e2e/kind/down.sh               # delete the cluster
#
# Needs: Docker (a running engine), kind v0.33.x, kubectl, uv, and network access for the base images,
# PyPI and the PyTorch CPU index (and cert-manager's release with CERT_MANAGER=1). Re-running it
# reuses the cluster.
#
# Environment:
#   KIND_CLUSTER_NAME         cluster name (default: kvfabric)
#   KIND_NODE_IMAGE           the node image (default: kindest/node:<the Kubernetes pin of
#                             harness/kvfabric/localcluster/versions.py>, pulled from Docker Hub);
#                             `kvfabric kind image` builds one with no registry at all
#   IMAGES                    image directories of images/images.txt to build and load (default: all)
#   KVFABRIC_KIND_HOST_DIR    host directory for the NVMe stand-ins and the shared tier
#                             (default: /tmp/kvfabric-kind; it must be shared with Docker). up.sh
#                             creates it private (0700) with a marker file, the only kind down.sh
#                             deletes; an existing one must be this user's and writable by no one else
#   KVFABRIC_KIND_KUBECONFIG  kubeconfig written for the cluster (default: $KVFABRIC_KIND_HOST_DIR/kubeconfig);
#                             ~/.kube/config is not touched
#   CERT_MANAGER              0 (default): the operator generates its webhook certificate and registers
#                             the webhook itself (manifests/overlays/kind, from manifests/default);
#                             1: install cert-manager $CERT_MANAGER_VERSION (unless the cluster has it)
#                             and let it issue the certificate (manifests/overlays/kind/cert-manager)
#   OPERATOR_NAMESPACE        namespace of the operator in manifests/ (default: kvfabric-system)
#   GPUS_PER_NODE             advertised nvidia.com/gpu capacity of each GPU worker (default: 8)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"

CLUSTER="${KIND_CLUSTER_NAME:-kvfabric}"
HOST_DIR="${KVFABRIC_KIND_HOST_DIR:-/tmp/kvfabric-kind}"
KUBECONFIG_FILE="${KVFABRIC_KIND_KUBECONFIG:-${HOST_DIR}/kubeconfig}"
CERT_MANAGER="${CERT_MANAGER:-0}"
CERT_MANAGER_VERSION="${CERT_MANAGER_VERSION:-v1.21.2}"
OPERATOR_NAMESPACE="${OPERATOR_NAMESPACE:-kvfabric-system}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
KIND_VERSION_WANTED="v0.33."
# The Kubernetes version everything else is tested with (the local control plane, the kubelet tier).
KUBERNETES_PIN="$(sed -n 's/^KUBERNETES_VERSION: Final = "\(.*\)"$/\1/p' "${root}/harness/kvfabric/localcluster/versions.py")"
NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:${KUBERNETES_PIN}}"
GPU_LABEL="nvidia.com/gpu.present"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

need() {
  local cmd="$1" hint="$2"
  command -v "${cmd}" >/dev/null 2>&1 || die "'${cmd}' is not on PATH. ${hint}"
}

preflight() {
  need docker "Install Docker Engine or Docker Desktop (https://docs.docker.com/get-docker/)."
  docker info >/dev/null 2>&1 ||
    die "the docker client cannot reach a Docker engine (is Docker running, and may this user use its socket?)."
  need kind "Install kind ${KIND_VERSION_WANTED}x: 'go install sigs.k8s.io/kind@v0.33.0' (puts it in \$(go env GOPATH)/bin)."
  need kubectl "Install kubectl (https://kubernetes.io/docs/tasks/tools/)."
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    need uv "Install uv (pip install uv) or run scripts/bootstrap.sh; or set SKIP_TESTS=1."
  fi
  local version
  version="$(kind version 2>/dev/null | awk '{print $2}')"
  case "${version}" in
    "${KIND_VERSION_WANTED}"*) ;;
    *) say "warning: kind ${version:-?} found; up.sh is tested with kind ${KIND_VERSION_WANTED}x" ;;
  esac
  [ -n "${KUBERNETES_PIN}" ] || die "cannot read KUBERNETES_VERSION from harness/kvfabric/localcluster/versions.py"
}

kc() { kubectl --kubeconfig "${KUBECONFIG_FILE}" "$@"; }

# The marker that says up.sh created HOST_DIR: down.sh deletes no directory without it.
HOST_DIR_MARKER=".kvfabric-kind-host-dir"

# HOST_DIR holds kind-config.yaml and world-writable directories the nodes mount: another local user
# who made it first (the default is a fixed path under /tmp) could swap the config or the mounts.
# Create it private, or accept an existing one only if it is ours and no one else may write to it.
host_dir() {
  mkdir -p "$(dirname "${HOST_DIR}")"
  if mkdir -m 0700 "${HOST_DIR}" 2>/dev/null; then
    printf 'created by e2e/kind/up.sh for the kind cluster %s; e2e/kind/down.sh deletes it\n' "${CLUSTER}" \
      >"${HOST_DIR}/${HOST_DIR_MARKER}"
    return
  fi
  if [ -L "${HOST_DIR}" ] || [ ! -d "${HOST_DIR}" ]; then
    die "KVFABRIC_KIND_HOST_DIR=${HOST_DIR} exists and is not a directory (or is a symbolic link); remove it or choose another"
  fi
  [ -O "${HOST_DIR}" ] ||
    die "KVFABRIC_KIND_HOST_DIR=${HOST_DIR} exists and belongs to another user; remove it or choose another"
  [ -z "$(find "${HOST_DIR}" -maxdepth 0 -perm /022)" ] ||
    die "KVFABRIC_KIND_HOST_DIR=${HOST_DIR} is writable by other users (chmod go-w it, or choose another)"
}

kvfabric_version() {
  sed -n 's/^__version__ = "\(.*\)"$/\1/p' "${root}/operator/kvfabric/cli/version.py"
}

create_cluster() {
  mkdir -p "${HOST_DIR}/nvme-gpu-1" "${HOST_DIR}/nvme-gpu-2" "${HOST_DIR}/shared"
  # The cache servers run as uid 65532: let them write the node-local and shared directories.
  chmod 1777 "${HOST_DIR}/nvme-gpu-1" "${HOST_DIR}/nvme-gpu-2" "${HOST_DIR}/shared"
  local config="${HOST_DIR}/kind-config.yaml"
  sed "s#/tmp/kvfabric-kind#${HOST_DIR}#g" "${here}/kind-config.yaml" >"${config}"
  # Kubernetes >= 1.35 kubelets refuse cgroup v1 unless told otherwise; kind does not tell them.
  if [ "$(docker info --format '{{.CgroupVersion}}' 2>/dev/null)" = 1 ]; then
    say "the Docker engine runs on cgroup v1: the kubelets get failCgroupV1: false"
    cat >>"${config}" <<'YAML'
kubeadmConfigPatches:
  - |
    kind: KubeletConfiguration
    failCgroupV1: false
YAML
  fi
  if kind get clusters 2>/dev/null | grep -qx "${CLUSTER}"; then
    say "reusing the kind cluster '${CLUSTER}'"
    kind get kubeconfig --name "${CLUSTER}" >"${KUBECONFIG_FILE}"
  else
    say "creating the kind cluster '${CLUSTER}' (1 control plane, 2 GPU workers, 1 CPU worker) from ${NODE_IMAGE}"
    kind create cluster --name "${CLUSTER}" --config "${config}" --image "${NODE_IMAGE}" \
      --kubeconfig "${KUBECONFIG_FILE}" --wait 180s
  fi
  kc wait --for=condition=Ready node --all --timeout=180s >/dev/null
}

fake_gpus() {
  local nodes node
  nodes="$(kc get nodes -l "${GPU_LABEL}=true" -o jsonpath='{.items[*].metadata.name}')"
  [ -n "${nodes}" ] || die "no node is labelled ${GPU_LABEL}=true; is kind-config.yaml's 'labels' supported by this kind?"
  for node in ${nodes}; do
    say "GPU node ${node}: nvidia.com/gpu capacity ${GPUS_PER_NODE}, taint nvidia.com/gpu=present:NoSchedule"
    kc patch node "${node}" --subresource=status --type=json \
      -p "[{\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"${GPUS_PER_NODE}\"}]" >/dev/null
    kc taint node "${node}" nvidia.com/gpu=present:NoSchedule --overwrite >/dev/null
    local tries=0
    until [ "$(kc get node "${node}" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" = "${GPUS_PER_NODE}" ]; do
      tries=$((tries + 1))
      [ "${tries}" -le 60 ] || die "node ${node} does not report nvidia.com/gpu in its allocatable resources"
      sleep 1
    done
  done
}

build_and_load() {
  local version tag revision dir repo image
  version="$(kvfabric_version)"
  [ -n "${version}" ] || die "cannot read the version from operator/kvfabric/cli/version.py"
  tag="v${version}"
  revision="$(git -C "${root}" rev-parse HEAD 2>/dev/null || echo unknown)"
  while read -r dir repo; do
    case "${dir}" in '' | '#'*) continue ;; esac
    case " ${IMAGES:-${dir}} " in *" ${dir} "*) ;; *) continue ;; esac
    image="${repo}:${tag}"
    if [ "${SKIP_BUILD:-0}" != 1 ]; then
      say "building ${image} (images/${dir}/Dockerfile)"
      docker build -f "${root}/images/${dir}/Dockerfile" -t "${image}" \
        --build-arg "KVFABRIC_VERSION=${version}" --build-arg "REVISION=${revision}" "${root}"
    fi
    say "loading ${image} into the cluster"
    kind load docker-image "${image}" --name "${CLUSTER}"
  done <"${root}/images/images.txt"
}

install_cert_manager() {
  [ "${CERT_MANAGER}" = 1 ] || return 0
  if kc get crd certificates.cert-manager.io >/dev/null 2>&1; then
    say "cert-manager is already installed"
  else
    say "installing cert-manager ${CERT_MANAGER_VERSION}"
    kc apply --server-side --force-conflicts \
      -f "https://github.com/cert-manager/cert-manager/releases/download/${CERT_MANAGER_VERSION}/cert-manager.yaml" >/dev/null
  fi
  kc -n cert-manager wait --for=condition=Available deployment --all --timeout=300s >/dev/null
}

install_kvfabric() {
  local overlay="manifests/overlays/kind"
  [ "${CERT_MANAGER}" = 1 ] && overlay="manifests/overlays/kind/cert-manager"
  [ -f "${root}/manifests/default/kustomization.yaml" ] ||
    die "manifests/default/kustomization.yaml is missing: the operator's kustomize tree is not in this checkout"
  say "installing the CRDs and the operator (kubectl apply -k ${overlay})"
  # cert-manager's webhook may need a few seconds after it is Available before it admits Certificates.
  local tries=0
  until kc apply --server-side --force-conflicts -k "${root}/${overlay}" >/dev/null; do
    tries=$((tries + 1))
    [ "${tries}" -le 10 ] || die "kubectl apply -k ${overlay} kept failing"
    sleep 6
  done
  kc wait --for=condition=Established crd/kvcachepools.kvfabric.io --timeout=60s >/dev/null
  kc -n "${OPERATOR_NAMESPACE}" wait --for=condition=Available deployment --all --timeout=300s >/dev/null ||
    die "the operator did not become Available; see: kubectl --kubeconfig ${KUBECONFIG_FILE} -n ${OPERATOR_NAMESPACE} logs deploy/kvfabric-operator"
}

shared_volumes() {
  local i released
  # One host directory per volume of shared-volumes.yaml (hostPath /mnt/kvfabric-shared/pv-N).
  sed -n 's#.*path: /mnt/kvfabric-shared/\(pv-[0-9]*\).*#\1#p' "${here}/shared-volumes.yaml" |
    while read -r i; do
      mkdir -p "${HOST_DIR}/shared/${i}"
      chmod 1777 "${HOST_DIR}/shared/${i}"
    done
  # Volumes left Released by deleted test namespaces: recreate them so they bind again.
  released="$(kc get pv -l kvfabric.io/test-volume=shared \
    -o jsonpath='{range .items[?(@.status.phase=="Released")]}{.metadata.name}{" "}{end}')"
  if [ -n "${released}" ]; then
    say "recreating Released shared volumes: ${released}"
    # shellcheck disable=SC2086 # one argument per volume name
    kc delete pv ${released} --wait=true >/dev/null
  fi
  say "creating the shared-tier StorageClass and PersistentVolumes (kvfabric-shared)"
  kc apply -f "${here}/shared-volumes.yaml" >/dev/null
}

run_tests() {
  if [ "${SKIP_TESTS:-0}" = 1 ]; then
    say "SKIP_TESTS=1: the cluster is ready; KUBECONFIG=${KUBECONFIG_FILE}"
    return
  fi
  say "running the e2e tests meant for an existing cluster against kind (KVFABRIC_TEST_KUBECONFIG=${KUBECONFIG_FILE})"
  cd "${root}"
  KVFABRIC_TEST_KUBECONFIG="${KUBECONFIG_FILE}" uv run pytest e2e -m fabric "$@"
}

main() {
  preflight
  host_dir
  mkdir -p "$(dirname "${KUBECONFIG_FILE}")"
  create_cluster
  fake_gpus
  build_and_load
  install_cert_manager
  install_kvfabric
  shared_volumes
  run_tests "$@"
}

main "$@"
