#!/usr/bin/env bash
# Builds, from the Go module proxy only, the binaries a kind node image needs beyond those the local
# cluster already builds (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd,
# kubelet, pause): kubeadm and kube-proxy at the pinned Kubernetes version (the same wrapper-module
# approach as ../localcluster/build-binaries.sh), CoreDNS, and the kind CLI itself; plus kind's
# node-image files (images/base/files) copied out of kind's own module zip. Into $1.
# Versions come from the environment, set by kvfabric.kind.versions (the pin list).
set -euo pipefail

OUT=${1:?usage: build-node-binaries.sh OUT_DIR}
: "${KUBERNETES_VERSION:?}" "${KIND_VERSION:?}" "${COREDNS_VERSION:?}"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-buildvcs=false CGO_ENABLED=0 GOWORK=off
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../localcluster/go-progress.sh
. "$HERE/../localcluster/go-progress.sh"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfabric-kind-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT" "$WORK/out/bin"
step() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# --- kubeadm and kube-proxy: a wrapper module (k8s.io/kubernetes maps its staging modules with
# monorepo-relative replaces, so `go install pkg@version` refuses it) -------------------------------
V=${KUBERNETES_VERSION#v}; MINOR=${V#1.}
mkdir -p "$WORK/k8s" && cd "$WORK/k8s"
go mod init local/kindnodebin >/dev/null 2>&1
go mod edit -go=1.26.0 -require=k8s.io/kubernetes@v$V
step "resolving k8s.io/kubernetes v$V staging modules"
GOMOD=$(go mod download -json "k8s.io/kubernetes@v$V" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
grep -oE '^\s*k8s\.io/[a-z0-9-]+ v0\.0\.0\s*$' "$GOMOD" | awk '{print $1}' | sort -u \
  | while read -r m; do go mod edit "-replace=$m=$m@v0.$MINOR"; done
cat > tools.go <<'G'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubeadm"
)
G
step "go mod tidy (downloads modules on a cold cache)"
GOFLAGS=-mod=mod go mod tidy 2>&1 | { grep -v '^go: downloading' || true; }
LD="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LD="$LD -X $p.gitVersion=v$V -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean"
done
GO_LDFLAGS=$LD go_build_progress "kubeadm, kube-proxy" "$WORK/out/bin/" \
  k8s.io/kubernetes/cmd/kubeadm k8s.io/kubernetes/cmd/kube-proxy

# --- CoreDNS and kind: no replace directives; each from a module that requires only it, so the build
# resolves exactly its own go.mod's versions, and shows progress -----------------------------------
for mod in "github.com/coredns/coredns@$COREDNS_VERSION" "sigs.k8s.io/kind@$KIND_VERSION"; do
  path=${mod%@*}; name=${path##*/}
  mkdir -p "$WORK/$name" && cd "$WORK/$name"
  go mod init "local/${name}bin" >/dev/null 2>&1
  go mod edit -go=1.26.0 "-require=$mod"
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$path" >tools.go
  GOFLAGS=-mod=mod go mod tidy 2>&1 | { grep -v '^go: downloading' || true; }
  go_build_progress "$name ${mod#*@}" "$WORK/out/bin/$name" "$path"
done
# kind's node-image files (entrypoint, systemd units, containerd config) ship in its module zip.
KIND_DIR=$(go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
cp -r "$KIND_DIR/images/base/files" "$WORK/out/kind-base-files"
chmod -R u+w "$WORK/out/kind-base-files"

# Publish everything at once, so an interrupted build never leaves a half-filled cache.
mv "$WORK"/out/* "$OUT"/
step "done: $(ls "$OUT/bin" | tr '\n' ' ')"
