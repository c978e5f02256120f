#!/usr/bin/env bash
# Builds the operations tools the chart and monitoring tests use, from the Go module proxy, into $1:
#   $1/bin/helm                      Helm ($HELM_VERSION, helm.sh/helm/v4/cmd/helm)
#   $1/prometheus-operator-crd/*.yaml the Prometheus Operator's own CRDs ($PROMETHEUS_OPERATOR_VERSION,
#                                     example/prometheus-operator-crd/ of its module zip)
# Versions come from the environment, set by kvfabric.testing.opstools (the one pin list). Everything
# is built in a temporary directory and moved into place last, so an interrupted build never leaves a
# half-filled cache.
set -euo pipefail

OUT=${1:?usage: build-opstools.sh OUT_DIR}
: "${HELM_VERSION:?}" "${PROMETHEUS_OPERATOR_VERSION:?}"
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-buildvcs=false CGO_ENABLED=0 GOWORK=off
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvfabric-opstools-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
step() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
# shellcheck source=../localcluster/go-progress.sh
. "$(dirname "$(readlink -f "$0")")/../localcluster/go-progress.sh"
mkdir -p "$WORK/stage/bin" "$WORK/stage/prometheus-operator-crd"

step "fetching github.com/prometheus-operator/prometheus-operator $PROMETHEUS_OPERATOR_VERSION (for its CRDs)"
PO_DIR=$(cd "$WORK" && go mod download -json \
  "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" \
  | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
cp "$PO_DIR"/example/prometheus-operator-crd/*.yaml "$WORK/stage/prometheus-operator-crd/"
chmod -R u+w "$WORK/stage/prometheus-operator-crd"

# A wrapper module that requires the pinned Helm (repeating any non-local replace directive of
# upstream's go.mod, which `go install pkg@version` would refuse).
mkdir -p "$WORK/helm" && cd "$WORK/helm"
go mod init local/helmbin >/dev/null 2>&1
go mod edit -go=1.26.0 -require="helm.sh/helm/v4@$HELM_VERSION"
step "resolving helm.sh/helm/v4 $HELM_VERSION"
GOMOD=$(go mod download -json "helm.sh/helm/v4@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
{ grep -E '^replace ' "$GOMOD" || true; } | { grep -v '=> [./]' || true; } | while read -r _ from _ to ver; do
  go mod edit "-replace=$from=$to@$ver"
done
cat > tools.go <<'G'
//go:build tools

package tools

import _ "helm.sh/helm/v4/cmd/helm"
G
step "go mod tidy"
GOFLAGS=-mod=mod go mod tidy
# `helm version` reports the pin (upstream's Makefile sets the same variable).
GO_LDFLAGS="-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
  go_build_progress helm "$WORK/stage/bin/helm" helm.sh/helm/v4/cmd/helm

mkdir -p "$(dirname "$OUT")"
rm -rf "$OUT"
mv "$WORK/stage" "$OUT"
step "done: $OUT"
