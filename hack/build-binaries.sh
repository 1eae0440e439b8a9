#!/usr/bin/env bash
# Build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy and kubectl from Go modules into a
# cache folder keyed by version and by the wrapper modules' go.sum, so a second run costs
# nothing. Usage: hack/build-binaries.sh OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
out=${1:?usage: build-binaries.sh OUT_DIR}
stamp="k8s=$K8S_VERSION etcd=$ETCD_VERSION $(cat "$here/k8s/go.sum" "$here/etcd/go.sum" "$here/k8s/go.mod" "$here/etcd/go.mod" | sha256sum | cut -c1-16)"
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ]; then
  echo "control-plane binaries are up to date in $out"
  exit 0
fi
command -v go >/dev/null || { echo "error: Go is needed to build the control plane (https://go.dev/dl)" >&2; exit 1; }
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
mkdir -p "$out"
minor=${K8S_VERSION#*.}; minor=${minor%%.*}
ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld="$ld -X $pkg.gitVersion=v$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
start=$(date +%s)
echo "building kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy, kubectl v$K8S_VERSION (a cold build takes a while)"
(cd "$here/k8s" && go build -trimpath -ldflags "$ld" -o "$out/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl \
  k8s.io/kubernetes/cmd/kube-proxy)
echo "building etcd v$ETCD_VERSION"
(cd "$here/etcd" && go build -trimpath -ldflags "-s -w" -o "$out/etcd" .)
echo "$stamp" > "$out/.stamp"
echo "built control-plane binaries in $(( $(date +%s) - start ))s into $out"
