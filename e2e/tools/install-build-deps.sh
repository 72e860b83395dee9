#!/usr/bin/env bash
# Installs the Debian packages the workspace needs to build (idempotent; no-op when present).
#   ibverbs-sys (feature `rdma`): cmake, libclang-dev (bindgen), libibverbs-dev, libnl-3-dev,
#   libnl-route-3-dev; openssl for the e2e control plane's PKI; libibverbs1 for Mooncake's wheel
#   (worker/tools/mooncake-venv.sh, `tandem-bench transfer --against mooncake`), even over TCP.
set -euo pipefail
pkgs=(cmake libclang-dev libibverbs-dev libibverbs1 libnl-3-dev libnl-route-3-dev pkg-config openssl)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "build dependencies present"
fi
