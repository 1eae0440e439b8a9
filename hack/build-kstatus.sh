#!/usr/bin/env bash
# Build hack/kstatus (kstatus from sigs.k8s.io/cli-utils, the status library of Flux and
# kpt) from the Go module proxy into a folder keyed by its sources, so a second run costs
# nothing. Prints the binary's path. Usage: hack/build-kstatus.sh [CACHE_DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
key=$(cat "$here/kstatus/go.mod" "$here/kstatus/go.sum" "$here/kstatus/main.go" | sha256sum | cut -c1-16)
out="${1:-$root/.cache/bin}/kstatus-$key"
if [[ ! -x "$out/kstatus" ]]; then
  command -v go >/dev/null || { echo "error: Go is needed to build hack/kstatus (https://go.dev/dl)" >&2; exit 1; }
  echo "building kstatus (sigs.k8s.io/cli-utils) once into $out" >&2
  mkdir -p "$out"
  (cd "$here/kstatus" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" \
    go build -trimpath -ldflags "-s -w" -o "$out/kstatus.tmp" . && mv "$out/kstatus.tmp" "$out/kstatus")
fi
echo "$out/kstatus"
