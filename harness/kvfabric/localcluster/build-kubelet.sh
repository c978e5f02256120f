#!/usr/bin/env bash
# Builds the real-node binaries of the local cluster's kubelet tier from the Go module proxy into $1:
# kubelet at the pinned Kubernetes version (the same wrapper-module approach as build-binaries.sh:
# k8s.io/kubernetes maps its staging modules with monorepo-relative replaces) and a static pause
# binary for the sandbox image (no registry serves registry.k8s.io/pause here).
# containerd, runc and the CNI plugins come from Debian's packages (scripts/container-host.sh).
set -euo pipefail

BIN=${1:?usage: build-kubelet.sh BIN_DIR}
: "${KUBERNETES_VERSION:?}"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-buildvcs=false CGO_ENABLED=0 GOWORK=off
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=go-progress.sh
. "$HERE/go-progress.sh"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfabric-kubelet-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$BIN" "$WORK/out"
step() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

V=${KUBERNETES_VERSION#v}; MINOR=${V#1.}
mkdir -p "$WORK/k8s" && cd "$WORK/k8s"
go mod init local/kubeletbin >/dev/null 2>&1
go mod edit -go=1.26.0 -require=k8s.io/kubernetes@v$V
step "resolving k8s.io/kubernetes v$V staging modules"
GOMOD=$(go mod download -json "k8s.io/kubernetes@v$V" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
grep -oE '^\s*k8s\.io/[a-z0-9-]+ v0\.0\.0\s*$' "$GOMOD" | awk '{print $1}' | sort -u \
  | while read -r m; do go mod edit "-replace=$m=$m@v0.$MINOR"; done
cat > tools.go <<'G'
//go:build tools

package tools

import _ "k8s.io/kubernetes/cmd/kubelet"
G
step "go mod tidy (downloads modules on a cold cache)"
GOFLAGS=-mod=mod go mod tidy 2>&1 | { grep -v '^go: downloading' || true; }
LD="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LD="$LD -X $p.gitVersion=v$V -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean"
done
GO_LDFLAGS=$LD go_build_progress kubelet "$WORK/out/" k8s.io/kubernetes/cmd/kubelet

# The sandbox ("pause") container only has to sleep until it is killed.
mkdir -p "$WORK/pause" && cd "$WORK/pause"
go mod init local/pause >/dev/null 2>&1
cat > main.go <<'G'
// Command pause holds a pod's namespaces open until it is signalled.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM)
	<-c
}
G
step "building the pause binary"
go build -trimpath -ldflags "-s -w" -o "$WORK/out/pause" .

mv "$WORK"/out/* "$BIN"/
step "done: $(ls "$BIN" | tr '\n' ' ')"
