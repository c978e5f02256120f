#!/usr/bin/env bash
# Builds the local control plane's binaries from the Go module proxy into $1 (a bin directory).
#
# k8s.io/kubernetes and etcd's server module carry monorepo-relative `replace` directives, so
# `go install pkg@version` refuses them. We build each from a small wrapper module that requires the
# pinned version and maps every staging module (k8s.io/* v0.0.0) to its published v0.X.Y tag.
# Versions come from the environment, set by kvfabric.localcluster.versions (the one pin list).
set -euo pipefail

BIN=${1:?usage: build-binaries.sh BIN_DIR}
: "${KUBERNETES_VERSION:?}" "${ETCD_VERSION:?}" "${KWOK_VERSION:?}"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-buildvcs=false CGO_ENABLED=0 GOWORK=off
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=go-progress.sh
. "$HERE/go-progress.sh"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfabric-k8s-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$BIN"
step() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# --- Kubernetes: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl -----------------
V=${KUBERNETES_VERSION#v}; MINOR=${V#1.}
mkdir -p "$WORK/k8s" && cd "$WORK/k8s"
go mod init local/k8sbin >/dev/null 2>&1
go mod edit -go=1.26.0 -require=k8s.io/kubernetes@v$V
step "resolving k8s.io/kubernetes v$V staging modules"
GOMOD=$(go mod download -json "k8s.io/kubernetes@v$V" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
grep -oE '^\s*k8s\.io/[a-z0-9-]+ v0\.0\.0\s*$' "$GOMOD" | awk '{print $1}' | sort -u \
  | while read -r m; do go mod edit "-replace=$m=$m@v0.$MINOR"; done
cat > tools.go <<'G'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
G
step "go mod tidy (downloads modules on a cold cache)"
GOFLAGS=-mod=mod go mod tidy 2>&1 | { grep -v '^go: downloading' || true; }
LD="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LD="$LD -X $p.gitVersion=v$V -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean"
done
GO_LDFLAGS=$LD go_build_progress "kube-apiserver, kube-controller-manager, kube-scheduler, kubectl" "$WORK/out/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl

# --- etcd: a copy of upstream server/main.go in a wrapper module -----------------------------------
mkdir -p "$WORK/etcd" && cd "$WORK/etcd"
go mod init local/etcdbin >/dev/null 2>&1
go mod edit -go=1.26.0 -require=go.etcd.io/etcd/server/v3@$ETCD_VERSION
cat > main.go <<'G'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
G
GOFLAGS=-mod=mod go mod tidy 2>&1 | { grep -v '^go: downloading' || true; }
go_build_progress "etcd $ETCD_VERSION" "$WORK/out/etcd" .

# --- kwok: no replace directives, a plain install works --------------------------------------------
step "building kwok $KWOK_VERSION"
GOBIN="$WORK/out" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
# kwok needs Stage definitions; take the "fast" set (nodes Ready at once, heartbeats through Leases,
# pods Running and Ready at once, deleted pods finalized) from the same pinned module.
KWOK_DIR=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
S="$KWOK_DIR/kustomize/stage"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  printf -- '---\n'; cat "$S/$f"
done > "$WORK/out/kwok-stages.yaml"

# Publish all binaries at once, so an interrupted build never leaves a half-filled cache.
mv "$WORK"/out/* "$BIN"/
step "done: $(ls "$BIN" | tr '\n' ' ')"
