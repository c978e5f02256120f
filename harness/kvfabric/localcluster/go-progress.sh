#!/usr/bin/env bash
# Sourced by the build scripts: `go_build_progress NAME OUT PKG...` runs `go build -v` for PKG and
# prints, every 15 s, how many packages it has compiled out of the most it may compile, the time
# spent and a rough time left (from the rate so far). Packages already in the Go build cache are not
# compiled again, so a warm build ends well before the count says (and then only links).
go_build_progress() {
  local name=$1 out=$2; shift 2
  local total start counted ticker rc
  total=$(go list -deps "$@" | wc -l)
  counted=$(mktemp "${TMPDIR:-/tmp}/kvfabric-go-progress.XXXXXX")
  start=$SECONDS
  printf '[build %s] %s: compiling up to %d packages\n' "$(date +%H:%M:%S)" "$name" "$total"
  (
    # Ends with the script that sourced this (a Ctrl-C does not reach a background job).
    while sleep 15 && kill -0 $$ 2>/dev/null; do
      n=$(wc -l <"$counted"); el=$((SECONDS - start)); left=""
      if [ "$n" -gt 0 ] && [ "$n" -lt "$total" ]; then
        eta=$((el * (total - n) / n)); left=", at most ~$((eta / 60))m$(printf %02d $((eta % 60)))s left"
      fi
      printf '[build %s] %s: %d/%d packages compiled, %dm%02ds elapsed%s%s\n' "$(date +%H:%M:%S)" \
        "$name" "$n" "$total" $((el / 60)) $((el % 60)) "$left" "$( [ "$n" -eq 0 ] && echo ' (cached; linking)')"
    done
  ) &
  ticker=$!
  # -v prints each package's import path (no spaces) as it is compiled; everything else
  # (compiler and linker diagnostics, `go:` errors) passes through.
  set +e
  go build -v -trimpath -ldflags "${GO_LDFLAGS:--s -w}" -o "$out" "$@" 2>&1 | while IFS= read -r line; do
    case $line in
      ""|*" "*|*.go:*) printf '%s\n' "$line" ;;
      *) printf '%s\n' "$line" >>"$counted" ;;
    esac
  done
  rc=${PIPESTATUS[0]}
  set -e
  kill "$ticker" 2>/dev/null || true; wait "$ticker" 2>/dev/null || true
  printf '[build %s] %s: %d packages compiled, finished in %ds (exit %d)\n' "$(date +%H:%M:%S)" "$name" \
    "$(wc -l <"$counted")" $((SECONDS - start)) "$rc"
  rm -f "$counted"
  return "$rc"
}
