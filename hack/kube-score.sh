#!/usr/bin/env bash
# Lint the rendered manifests with kube-score (github.com/zegl/kube-score), built from the Go
# module proxy once per version into .cache/bin. Exits non-zero on any CRITICAL finding not
# justified in the manifests themselves (a kube-score/ignore annotation next to a comment
# saying why). Usage: hack/kube-score.sh KUBECTL
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
# shellcheck source=/dev/null
source "$here/versions.env"
kubectl="$1"
bin="$root/.cache/bin/kube-score-v$KUBE_SCORE_VERSION"
if [[ ! -x "$bin/kube-score" ]]; then
  echo "building kube-score v$KUBE_SCORE_VERSION (once)"
  mkdir -p "$bin"
  GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$bin" go install "github.com/zegl/kube-score/cmd/kube-score@v$KUBE_SCORE_VERSION"
fi
for tree in manifests manifests/cert-manager; do
  echo "kube-score: $tree"
  "$kubectl" kustomize "$root/$tree" | "$bin/kube-score" score --output-format ci -
done
# The optional metrics component, as a user's overlay adds it.
overlay="$(mktemp -d)"
trap 'rm -rf "$overlay"' EXIT
cp -r "$root/manifests" "$root/crds" "$overlay/"
printf 'resources: [manifests]\ncomponents: [manifests/prometheus]\n' >"$overlay/kustomization.yaml"
echo "kube-score: manifests + manifests/prometheus"
"$kubectl" kustomize "$overlay" | "$bin/kube-score" score --output-format ci -
