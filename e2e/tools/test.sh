#!/usr/bin/env bash
# The project's test command (README "Run the tests"; `.ci/run` calls exactly this).
#
# On a fresh machine it installs what the build needs (Debian packages for the `rdma` feature),
# then: formatting, clippy with warnings denied, the whole workspace's tests, the CRD drift
# check, and compile checks of the `cuda` and `rdma` features.
set -euo pipefail
cd "$(dirname "$0")/../.."

step() { printf '\n==> %s\n' "$*"; }

step "build dependencies"
bash e2e/tools/install-build-deps.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings denied)"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test --workspace"
cargo test --workspace

step "CRDs in charts/tandem/crds match the types"
cargo run --quiet -p tandem-crds --bin crdgen -- --check

step "feature builds: cuda (dynamic loading, no toolkit needed), rdma (ibverbs)"
cargo check -p tandem-worker --features cuda
cargo check -p tandem-worker --features rdma

step "all tests passed"
