#!/usr/bin/env bash
# Makes sure a Go toolchain >= 1.26 is on the PATH (the Kubernetes, kubelet, kind-validator and
# SeaweedFS builds need it). Debian 12's golang-go is Go 1.19, too old and too old to switch toolchains
# by itself (GOTOOLCHAIN came with 1.21), so when the go on the PATH is missing or older, this script
# takes the official toolchain the way the go command itself does: the module
# golang.org/toolchain@v0.0.1-go<version>.linux-<arch> from the Go module proxy, checked against the
# checksum database (`go mod download`, run by Debian's go), copied to $KVFABRIC_GO_ROOT
# (/usr/local/go) and linked as /usr/local/bin/go. Without any go or a reachable proxy it stops with a
# message that says what to install.
set -euo pipefail
say() { printf '[bootstrap] %s\n' "$*" >&2; }
MIN_MINOR=26
VERSION="${KVFABRIC_GO_VERSION:-1.26.8}"
GOROOT_DIR="${KVFABRIC_GO_ROOT:-/usr/local/go}"
BIN_DIR="${KVFABRIC_GO_BIN_DIR:-/usr/local/bin}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

minor_of() {  # go1.19.8 -> 19; prints nothing for a version it cannot read
  sed -n 's/^go1\.\([0-9][0-9]*\).*/\1/p' <<<"$1"
}
go_minor() { minor_of "$(go env GOVERSION 2>/dev/null || true)"; }

if command -v go >/dev/null; then
  minor="$(go_minor)"
  if [ -n "$minor" ] && [ "$minor" -ge "$MIN_MINOR" ]; then exit 0; fi
  say "$(command -v go) is $(go env GOVERSION 2>/dev/null || echo 'of an unknown version'); the builds need Go >= 1.$MIN_MINOR"
else
  say "no Go on the PATH: installing Debian's golang-go to fetch Go $VERSION with"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq golang-go >/dev/null
fi

case "$(uname -m)" in
  x86_64) arch=amd64 ;;
  aarch64|arm64) arch=arm64 ;;
  *) arch="" ;;
esac
fail() {
  say "cannot install Go $VERSION here ($1)."
  say "Install Go >= 1.$MIN_MINOR yourself (https://go.dev/doc/install: unpack the official tarball into"
  say "/usr/local/go and put /usr/local/go/bin on the PATH), then run this again."
  exit 1
}
[ -n "$arch" ] || fail "no official toolchain for $(uname -m)"
module="golang.org/toolchain@v0.0.1-go$VERSION.linux-$arch"
say "fetching Go $VERSION as the module $module (about 70 MB)"
cache="$(mktemp -d)"
trap 'chmod -R u+w "$cache" 2>/dev/null || true; rm -rf "$cache"' EXIT
# GOTOOLCHAIN=local: a go that could switch toolchains must not do it for this command.
dir="$(cd "$cache" && GOTOOLCHAIN=local GOFLAGS=-modcacherw GOMODCACHE="$cache/mod" \
  go mod download -json "$module" 2>"$cache/err" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')" || true
if [ -z "$dir" ] || [ ! -f "$dir/bin/go" ]; then
  fail "go mod download $module: $(tail -n 3 "$cache/err" 2>/dev/null | tr '\n' ' ')"
fi
# Module zips carry no file modes: the executables get theirs back, as the go command does for them.
chmod -R u+w,a+rX "$dir"
chmod a+x "$dir"/bin/* "$dir"/pkg/tool/*/*
$SUDO rm -rf "$GOROOT_DIR"
$SUDO mkdir -p "$(dirname "$GOROOT_DIR")" "$BIN_DIR"
$SUDO cp -a "$dir" "$GOROOT_DIR"
$SUDO ln -sf "$GOROOT_DIR/bin/go" "$GOROOT_DIR/bin/gofmt" "$BIN_DIR/"
hash -r
if [ "$(minor_of "$("$BIN_DIR/go" env GOVERSION)")" -lt "$MIN_MINOR" ]; then
  fail "$BIN_DIR/go does not run as Go $VERSION"
fi
if [ "$(command -v go)" != "$BIN_DIR/go" ]; then
  say "installed Go $VERSION as $BIN_DIR/go, but $(command -v go) comes first on the PATH: put $BIN_DIR before it"
  exit 1
fi
say "installed Go $VERSION in $GOROOT_DIR ($BIN_DIR/go)"
