#!/usr/bin/env bash
# Build dependencies of `tandem-worker --features rdma`: ibverbs-sys compiles a vendored rdma-core with
# cmake and runs bindgen over verbs.h (libclang), and links libibverbs; rdma-core's default build needs
# libnl. Default builds (TCP only) need none of this. Debian/Ubuntu; run as root.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y cmake libclang-dev libibverbs-dev libnl-3-dev libnl-route-3-dev
