#!/usr/bin/env bash
# The project's test command (README "Run the tests"; `.ci/run` calls exactly this).
#
# On a fresh machine it installs what the build needs (Debian packages for the `rdma` feature and
# the control plane's PKI) and builds the e2e control plane from Go modules (cached), then:
# formatting, clippy with warnings denied, the whole workspace's tests (cluster suites included),
# the CRD drift check, clippy of the `cuda` and `rdma` features and the `cuda` host-side tests, and
# the negative controls behind the `negative-controls` feature.
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

step "feature builds: cuda (dynamic loading, no toolkit needed), rdma (ibverbs), warnings denied"
cargo clippy -p tandem-worker --features cuda --all-targets -- -D warnings
cargo clippy -p tandem-worker --features rdma --all-targets -- -D warnings

# Without a device the CUDA backend must refuse with DeviceUnavailable (tested); its GPU checks are
# #[ignore]d here and run on a GPU machine with `-- --include-ignored`.
step "cuda feature: host-side tests of the load plan, the event ledger and the no-device path"
cargo test -p tandem-worker --features cuda --lib cache::
cargo test -p tandem-worker --features cuda --test cache_load_order_cuda

step "rdma feature: host-side tests of the RDMA transport (no NIC here: open refuses, typed)"
cargo test -p tandem-worker --features rdma --lib transfer::

# Product-code switches that reproduce fixed bugs (feature `negative-controls`): the tests that
# must see the bug come back when its mechanism is switched off.
step "negative controls: abandoned requests leak without the room guard's hand-over (issue 19)"
cargo clippy -p tandem-worker --features negative-controls --all-targets -- -D warnings
cargo test -p tandem-worker --features negative-controls --test transfer_cancel --test serve_cancel

step "all tests passed"
