#!/usr/bin/env bash
# Assembles a kind node image with no image registry, the way kind's own builder does
# (`docker run` the base image, copy the binaries in, import the images into the node's containerd,
# `docker commit`), from:
# - the local Debian image ($DEBIAN_IMAGE, a debootstrap root file system) and Debian's packages;
# - the pinned Kubernetes binaries the local cluster builds ($K8S_BIN: kube-apiserver,
#   kube-controller-manager, kube-scheduler, kubectl, etcd; $KUBELET_BIN: kubelet, pause);
# - what build-node-binaries.sh builds ($NODE_BIN: bin/{kubeadm,kube-proxy,coredns}, kind's
#   images/base/files).
# The component images are made from those binaries under the names kubeadm asks for, and kindnetd
# (not served anywhere reachable) is replaced by images/cni-standin.sh.
# Talks to the Docker engine in $DOCKER_HOST; tags the result $NODE_IMAGE.
set -euo pipefail

: "${DOCKER_HOST:?}" "${DEBIAN_IMAGE:?}" "${K8S_BIN:?}" "${KUBELET_BIN:?}" "${NODE_BIN:?}" "${NODE_IMAGE:?}"
: "${KUBERNETES_VERSION:?}" "${INPUTS_DIGEST:?}"
DOCKER=${DOCKER:-docker}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfabric-kind-node.XXXXXX")
BUILDER=""
cleanup() {
  [ -z "$BUILDER" ] || "$DOCKER" rm -f "$BUILDER" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
step() { printf '[kind-image %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
export DOCKER_BUILDKIT=0
LABEL="io.kvfabric.inputs=$INPUTS_DIGEST"
# `docker build` prints every step and apt line; keep the steps.
build() {  # TAG CONTEXT [ARGS...]
  local tag=$1 ctx=$2; shift 2
  step "building $tag"
  "$DOCKER" build --network=host --label "$LABEL" -t "$tag" "$@" "$ctx" | { grep -E '^Step |^Successfully' || true; }
  test "${PIPESTATUS[0]}" -eq 0
}

# --- 1. kind's base image and a Debian image with the networking tools --------------------------
BASE=kvfabric.local/kind-base:bookworm
TOOLS=kvfabric.local/kind-tools:bookworm
mkdir -p "$WORK/base"
cp -r "$NODE_BIN/kind-base-files" "$WORK/base/files"
cp "$HERE/images/base.Dockerfile" "$WORK/base/Dockerfile"
build "$BASE" "$WORK/base" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
mkdir -p "$WORK/tools"
cat >"$WORK/tools/Dockerfile" <<D
FROM $DEBIAN_IMAGE
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      iptables nftables conntrack iproute2 ipset ebtables kmod \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
D
build "$TOOLS" "$WORK/tools"

# --- 2. the component images, under the names kubeadm expects -----------------------------------
images=$("$NODE_BIN/bin/kubeadm" config images list --kubernetes-version "$KUBERNETES_VERSION")
# kind's containerd config names its own sandbox image (kubeadm's pause is dropped, as kind does).
sandbox=$(sed -n 's/^ *sandbox_image = "\(.*\)"/\1/p' "$NODE_BIN/kind-base-files/etc/containerd/config.toml")
step "images for Kubernetes $KUBERNETES_VERSION: $(echo "$images" | tr '\n' ' ')sandbox $sandbox"
scratch_image() {  # TAG BINARY-PATH [ENTRYPOINT-JSON]
  local tag=$1 bin=$2 entry=${3:-} dir
  dir="$WORK/img-$(basename "$bin")"
  mkdir -p "$dir" && cp "$bin" "$dir/"
  {
    echo "FROM scratch"
    echo "COPY $(basename "$bin") /usr/local/bin/"
    echo "ENV PATH=/usr/local/bin:/usr/bin:/bin"
    [ -z "$entry" ] || echo "ENTRYPOINT $entry"
  } >"$dir/Dockerfile"
  build "$tag" "$dir"
}
node_images=()
for image in $images; do
  name=${image%:*}; name=${name##*/}
  case $name in
    kube-apiserver | kube-controller-manager | kube-scheduler) scratch_image "$image" "$K8S_BIN/$name" ;;
    etcd) scratch_image "$image" "$K8S_BIN/etcd" ;;
    coredns) scratch_image "$image" "$NODE_BIN/bin/coredns" '["/usr/local/bin/coredns"]' ;;
    pause) continue ;;
    kube-proxy)
      # kubeadm's DaemonSet runs /usr/local/bin/kube-proxy: the backend-choosing wrapper.
      mkdir -p "$WORK/img-kube-proxy"
      cp "$NODE_BIN/bin/kube-proxy" "$WORK/img-kube-proxy/kube-proxy.real"
      cp "$HERE/images/kube-proxy-wrapper.sh" "$WORK/img-kube-proxy/kube-proxy"
      printf 'FROM %s\nCOPY kube-proxy kube-proxy.real /usr/local/bin/\n' "$TOOLS" >"$WORK/img-kube-proxy/Dockerfile"
      build "$image" "$WORK/img-kube-proxy" ;;
    *) echo "error: kubeadm asks for $image, which this script does not know how to make" >&2; exit 1 ;;
  esac
  node_images+=("$image")
done
scratch_image "$sandbox" "$KUBELET_BIN/pause" '["/usr/local/bin/pause"]'
node_images+=("$sandbox")
CNI_IMAGE=$(sed -n 's/^ *image: \(.*\)$/\1/p' "$HERE/images/default-cni.yaml")
mkdir -p "$WORK/img-cni"
cp "$K8S_BIN/kubectl" "$HERE/images/cni-standin.sh" "$WORK/img-cni/"
printf 'FROM %s\nCOPY kubectl cni-standin.sh /usr/local/bin/\nENTRYPOINT ["/usr/local/bin/cni-standin.sh"]\n' \
  "$TOOLS" >"$WORK/img-cni/Dockerfile"
build "$CNI_IMAGE" "$WORK/img-cni"
node_images+=("$CNI_IMAGE")

# --- 3. the node: binaries, /kind/version, manifests, images in containerd, commit ---------------
step "assembling $NODE_IMAGE"
BUILDER=$("$DOCKER" run -d --privileged --entrypoint=sleep "$BASE" infinity)
for b in kubeadm kubelet kubectl; do
  src="$NODE_BIN/bin/$b"; [ -f "$src" ] || src="$K8S_BIN/$b"; [ -f "$src" ] || src="$KUBELET_BIN/$b"
  "$DOCKER" cp "$src" "$BUILDER:/usr/bin/$b"
done
"$DOCKER" exec "$BUILDER" sh -c "mkdir -p /kind/manifests && echo $KUBERNETES_VERSION >/kind/version"
"$DOCKER" cp "$HERE/images/default-cni.yaml" "$BUILDER:/kind/manifests/default-cni.yaml"
# No default-storage.yaml: kind then makes a `standard` StorageClass with the in-tree hostPath
# provisioner (kvfabric's e2e binds its own hostPath volumes).
"$DOCKER" exec -d "$BUILDER" containerd
"$DOCKER" exec "$BUILDER" sh -c 'for i in $(seq 50); do ctr version >/dev/null 2>&1 && exit 0; sleep 0.2; done; exit 1'
step "importing ${#node_images[@]} images into the node's containerd"
"$DOCKER" save "${node_images[@]}" |
  "$DOCKER" exec -i "$BUILDER" ctr --namespace=k8s.io images import --all-platforms --no-unpack --digests -
"$DOCKER" exec "$BUILDER" ctr --namespace=k8s.io images ls -q | sort >"$WORK/imported"
for image in "${node_images[@]}"; do
  grep -qx "$image" "$WORK/imported" || { echo "error: $image is not in the node's containerd" >&2; exit 1; }
done
"$DOCKER" exec "$BUILDER" sh -c 'pkill containerd; while pgrep -x containerd >/dev/null; do sleep 0.2; done'
"$DOCKER" commit \
  --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' --change 'CMD []' \
  --change "LABEL $LABEL" "$BUILDER" "$NODE_IMAGE" >/dev/null
"$DOCKER" rm -f "$BUILDER" >/dev/null && BUILDER=""
# The images above live on inside the node image: drop the copies (about 1.4 GB) from the engine.
"$DOCKER" image rm "${node_images[@]}" "$BASE" "$TOOLS" >/dev/null
step "done: $NODE_IMAGE ($("$DOCKER" image inspect -f '{{.Size}}' "$NODE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
