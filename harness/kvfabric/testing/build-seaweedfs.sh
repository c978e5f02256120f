#!/usr/bin/env bash
# Builds SeaweedFS's `weed` binary (master + volume + filer + S3 gateway in one) from the Go module
# proxy into $1 (a bin directory). The version comes from $SEAWEEDFS_VERSION, set by
# kvfabric.s3server.versions (the one pin).
#
# SeaweedFS's go.mod carries a `replace` directive (go-bip39 -> cosmos/go-bip39), so
# `go install pkg@version` refuses it; we build from a small wrapper module that requires the pinned
# version and repeats the replace.
set -euo pipefail

BIN=${1:?usage: build-seaweedfs.sh BIN_DIR}
: "${SEAWEEDFS_VERSION:?}"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-buildvcs=false CGO_ENABLED=0 GOWORK=off
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfabric-seaweedfs-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$BIN"
step() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
# shellcheck source=../localcluster/go-progress.sh
. "$(dirname "$(readlink -f "$0")")/../localcluster/go-progress.sh"

cd "$WORK"
go mod init local/weedbin >/dev/null 2>&1
go mod edit -go=1.26.0 -require="github.com/seaweedfs/seaweedfs@$SEAWEEDFS_VERSION"
step "resolving github.com/seaweedfs/seaweedfs $SEAWEEDFS_VERSION"
GOMOD=$(go mod download -json "github.com/seaweedfs/seaweedfs@$SEAWEEDFS_VERSION" \
  | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
# Repeat upstream's non-local replace directives (a local path replace is a developer's leftover).
grep -E '^replace ' "$GOMOD" | grep -v '=> [./]' | while read -r _ from _ to ver; do
  go mod edit "-replace=$from=$to@$ver"
done
cat > tools.go <<'G'
//go:build tools

package tools

import _ "github.com/seaweedfs/seaweedfs/weed"
G
step "go mod tidy (downloads a few hundred modules on a cold cache)"
GOFLAGS=-mod=mod go mod tidy
# Minutes on a cold Go cache (3.5 min here with the module downloads cached): progress every 15 s.
mkdir -p "$WORK/out"
go_build_progress weed "$WORK/out/weed" github.com/seaweedfs/seaweedfs/weed

# Publish at once, so an interrupted build never leaves a half-filled cache.
mv "$WORK/out/weed" "$BIN/weed"
step "done: $BIN/weed"
