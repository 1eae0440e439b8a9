#!/usr/bin/env bash
# Install what the testbed's real node needs (containerd, runc, the CNI bridge and
# host-local plugins, a static busybox for the pause and busybox images, iptables for the
# FORWARD guard, conntrack to forget the pods' flows at teardown, buildah and mmdebstrap to
# build our images without a Docker daemon) from Debian's archive, only when something is missing: a warm run is a few
# `test -x` checks. Without root or apt-get it says what is missing and exits 0, so the rest
# of `make test` still runs; the real-node test then fails with the same list.
set -euo pipefail
declare -A need=(
  [/usr/bin/containerd]=containerd
  [/usr/bin/ctr]=containerd
  [/usr/sbin/runc]=runc
  [/usr/lib/cni/bridge]=containernetworking-plugins
  [/usr/lib/cni/host-local]=containernetworking-plugins
  [/usr/lib/cni/loopback]=containernetworking-plugins
  [/bin/busybox]=busybox-static
  [/usr/sbin/iptables]=iptables
  [/usr/sbin/conntrack]=conntrack
  [/usr/bin/buildah]=buildah
  [/usr/bin/mmdebstrap]=mmdebstrap
)
missing=()
for path in "${!need[@]}"; do
  [ -x "$path" ] || missing+=("${need[$path]}")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "real-node packages present"
  exit 0
fi
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
# busybox-static conflicts with busybox (the dynamic one); apt swaps them.
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "warning: the real-node test needs Debian packages: ${missing[*]} (run \`make node-deps\` as root on Debian/Ubuntu)" >&2
  exit 0
fi
echo "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# policy-rc.d 101: the package must not start a system containerd; the testbed runs its own.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; created_policy=1
fi
trap '[ "$created_policy" = 1 ] && rm -f "$policy"' EXIT
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "installed ${missing[*]}"
