#!/usr/bin/env bash
# The project's test command (README "Run the tests"; `.ci/run` calls exactly this).
#
# On a fresh machine it installs what the build needs (Debian packages for the `rdma` feature and
# the control plane's PKI) and builds the e2e control plane from Go modules (cached), then:
# formatting, clippy with warnings denied, the whole workspace's tests (cluster suites included),
# the CRD drift check, clippy of the `cuda` and `rdma` features and the `cuda` host-side tests.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Toolchains in their standard install locations, for shells that did not source a profile.
for d in "$HOME/.cargo/bin" /usr/local/go/bin; do
  if [[ -d $d && ":$PATH:" != *":$d:"* ]]; then PATH="$d:$PATH"; fi
done
export PATH

step() { printf '\n==> %s\n' "$*"; }

step "build dependencies"
bash e2e/tools/install-build-deps.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings denied)"
cargo clippy --workspace --all-targets -- -D warnings

step "the e2e control plane (built from Go modules once, then cached under ~/.cache)"
# A cold build takes ~15-25 min on an idle 2-core machine; a cache hit is instant.
bash e2e/tools/build-controlplane.sh >/dev/null
# With the binaries present the cluster suites must run, not skip.
export TANDEM_E2E_REQUIRE_CLUSTER=1

step "cargo test --workspace (unit, integration, cluster suites)"
cargo test --workspace

step "CRDs in charts/tandem/crds match the types"
cargo run --quiet -p tandem-crds --bin crdgen -- --check

# The tests build the worker with `negative-controls` (its dev-dependency on itself); the library
# and binaries as shipped do not have it: check that feature set on its own.
step "the worker as shipped: library and binaries without negative controls, warnings denied"
cargo clippy -p tandem-worker --lib --bins -- -D warnings

step "feature builds: cuda (dynamic loading, no toolkit needed), rdma (ibverbs), warnings denied"
cargo clippy -p tandem-worker --features cuda --all-targets -- -D warnings
cargo clippy -p tandem-worker --features rdma --all-targets -- -D warnings

# Without a device the CUDA backend must refuse with DeviceUnavailable (tested); its GPU checks are
# #[ignore]d here and run on a GPU machine with `-- --include-ignored`.
step "cuda feature: host-side tests of the load plan, the event ledger and the no-device path"
cargo test -p tandem-worker --features cuda --lib load::
cargo test -p tandem-worker --features cuda --test cache_load_order_cuda

step "rdma feature: host-side tests of the RDMA transport (no NIC here: open refuses, typed)"
cargo test -p tandem-worker --features rdma --lib transfer::

step "all tests passed"
