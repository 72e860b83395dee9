#!/usr/bin/env bash
# The project's test command (README "Run the tests"; `.ci/run` calls exactly this).
#
# On a fresh machine it installs what the build needs (Debian packages for the `rdma` feature and
# the control plane's PKI) and builds the e2e control plane from Go modules (cached), then: the
# dependency rules (operator and e2e free of the worker crate, one feature set for the demo),
# formatting, clippy with warnings denied, the whole workspace's tests (cluster suites included),
# the CRD drift check, clippy of the `cuda` and `rdma` features and the `cuda` host-side tests, and
# the negative controls behind the `negative-controls` feature, and the Mooncake rows of
# `tandem-bench transfer --against mooncake` (a cached venv from PyPI), and the Python client's tests
# (worker/python, a cached venv from PyPI; the vLLM tier's in a second one with torch and vLLM).
set -euo pipefail
cd "$(dirname "$0")/../.."

# Toolchains in their standard install locations, for shells that did not source a profile.
for d in "$HOME/.cargo/bin" /usr/local/go/bin; do
  if [[ -d $d && ":$PATH:" != *":$d:"* ]]; then PATH="$d:$PATH"; fi
done
export PATH
# A one-shot build keeps no incremental state: it saves a third of the target directory's disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# /dev/null must stay the character device. Once in a rehearsal it was a regular file by the
# clippy steps (culprit not found yet): rustc's `-` probe read test logs from it and the build
# failed on them. Each step checks it first, names the step before if it was replaced, and puts
# the device back when it can (root), so that one stray process does not fail every later step.
last_step="(start)"
guard_dev_null() {
  [[ -c /dev/null ]] && return 0
  echo "WARNING: /dev/null is not a character device after step: $last_step" >&2
  ls -la /dev/null >&2 || true
  if [[ $(id -u) == 0 ]] && rm -f /dev/null && mknod -m 666 /dev/null c 1 3; then
    echo "WARNING: /dev/null restored (mknod c 1 3)" >&2
  else
    echo "/dev/null is broken and cannot be restored here" >&2
    exit 1
  fi
}
step() { guard_dev_null; last_step="$*"; printf '\n==> %s\n' "$*"; }
trap guard_dev_null EXIT

step "build dependencies"
bash e2e/tools/install-build-deps.sh

step "the operator and e2e do not depend on the worker crate (DESIGN §1)"
# Every edge kind: a dev- or build-dependency on tandem-worker would break the rule too.
for p in tandem-operator tandem-e2e; do
  tree=$(cargo tree -p "$p" -e normal,build,dev --prefix none --format '{p}')
  if grep -q '^tandem-worker ' <<<"$tree"; then
    echo "$p depends on tandem-worker:" >&2
    cargo tree -p "$p" -e normal,build,dev -i tandem-worker >&2
    exit 1
  fi
done

step "one feature set: the demo's build of worker + operator reuses every dependency of tandem-e2e"
# `cargo run -p tandem-e2e -- demo` builds tandem-e2e, then the demo builds tandem-worker and
# tandem-operator with tandem-e2e selected too (e2e/src/demo/stack.rs::ensure_binaries). Both must
# resolve every third-party package with the same features, or the second build compiles them
# again: keep e2e/demo-deps/Cargo.toml in step with the worker's and the operator's dependencies.
features() {
  cargo tree "$@" -e normal,build --prefix none --format '{p}|{f}' \
    | sed -E 's/ \((\*|proc-macro)\)//g' | grep -v -e '^tandem-' -e '^$' | sort -u
}
if ! diff <(features -p tandem-e2e) \
  <(features -p tandem-e2e -p tandem-worker -p tandem-operator) >&2; then
  echo "the demo's second build would see other features (lines: tandem-e2e alone < > with the binaries)" >&2
  exit 1
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings denied)"
cargo clippy --workspace --all-targets -- -D warnings

step "the e2e control plane (built from Go modules once, then cached under ~/.cache)"
# A cold build takes ~15-25 min on an idle 2-core machine; a cache hit is instant.
bash e2e/tools/build-controlplane.sh >/dev/null
# With the binaries present the cluster suites must run, not skip.
export TANDEM_E2E_REQUIRE_CLUSTER=1
# Tests that read ../shared/data (the Mooncake trace, model geometry) fail instead of skipping
# when it is missing.
export TANDEM_REQUIRE_DATA=1

step "cargo test --workspace (unit, integration, cluster suites)"
cargo test --workspace

# The venv comes from PyPI once (~50 s cold, 105 MB with the SGLang wheel the contract test reads),
# then from ~/.cache/tandem (the package is reinstalled from the checkout, ~3 s); the tests (~10 s) start
# the tandem-worker binary the workspace tests just built (before the feature builds below rebuild it).
step "tandem-kv: the Python client of the engine API and the SGLang backend against a real tandem-worker"
py=$(bash worker/tools/python-venv.sh)
TANDEM_WORKER_BIN="$PWD/target/debug/tandem-worker" "$py" -m pytest -q -p no:cacheprovider worker/python/tests

# A second venv with torch and vLLM 0.33.0 (~95 s cold, 6.6 GB: PyPI's torch is the CUDA build with its
# CUDA libraries; then from ~/.cache/tandem), where the vLLM module must run, not skip.
step "tandem-kv: the vLLM secondary tier inside vLLM's real offloading manager, and the vLLM PD connector in vLLM's real Scheduler behind the decode front door, against real tandem-workers"
py_vllm=$(bash worker/tools/vllm-venv.sh)
TANDEM_REQUIRE_VLLM=1 TANDEM_WORKER_BIN="$PWD/target/debug/tandem-worker" \
  "$py_vllm" -m pytest -q -p no:cacheprovider worker/python/tests/test_vllm_tier.py \
  worker/python/tests/test_vllm_pd.py

# A thin venv over the vLLM venv (~35 s cold, 343 MB: SGLang 0.5.23 and what its host pool and
# disaggregation modules import beyond the vLLM venv's torch), where the SGLang modules must run.
step "tandem-kv: the SGLang L3 backend through SGLang's real factory and host pools, and the SGLang PD transfer backend through SGLang's plugin loader and KV pool behind the decode front door, against real tandem-workers"
py_sglang=$(bash worker/tools/sglang-venv.sh)
TANDEM_REQUIRE_SGLANG=1 TANDEM_WORKER_BIN="$PWD/target/debug/tandem-worker" \
  "$py_sglang" -m pytest -q -p no:cacheprovider worker/python/tests/test_sglang_real.py \
  worker/python/tests/test_sglang_pd.py

step "CRDs in charts/tandem/crds match the types"
cargo run --quiet -p tandem-crds --bin crdgen -- --check

# The tests build the worker with `negative-controls` (its dev-dependency on itself); the library
# and binaries as shipped do not have it: check that feature set on its own.
step "the worker as shipped: library and binaries without negative controls, warnings denied"
cargo clippy -p tandem-worker --lib --bins -- -D warnings

step "the operator as shipped: library and binary without negative controls (UnsafeModes), warnings denied"
cargo clippy -p tandem-operator --lib --bins -- -D warnings

step "feature builds: cuda (dynamic loading, no toolkit needed), rdma (ibverbs), warnings denied"
cargo clippy -p tandem-worker --features cuda --all-targets -- -D warnings
cargo clippy -p tandem-worker --features rdma --all-targets -- -D warnings

# Without a device the CUDA backend must refuse with DeviceUnavailable (tested); its GPU checks are
# #[ignore]d here and run on a GPU machine with `-- --include-ignored`.
step "cuda feature: host-side tests of the load plan, the event ledger and the no-device path"
cargo test -p tandem-worker --features cuda --lib load::
cargo test -p tandem-worker --features cuda --test load_order_cuda

step "rdma feature: host-side tests of the RDMA transport (no NIC here: open refuses, typed)"
cargo test -p tandem-worker --features rdma --lib transfer::

# Product-code switches that reproduce fixed bugs (feature `negative-controls`): the tests that
# must see the bug come back when its mechanism is switched off.
step "negative controls: abandoned requests leak without the room guard's hand-over (issue 19)"
cargo clippy -p tandem-worker --features negative-controls --all-targets -- -D warnings
cargo test -p tandem-worker --features negative-controls --test transfer_cancel --test serve_cancel

# The venv comes from PyPI once (~30 s), then from ~/.cache/tandem (instant); the test starts
# Mooncake's Python engine and its C++ bench on loopback through `tandem-bench transfer`'s code.
step "Mooncake side by side: the cached venv and tandem-bench transfer's Mooncake rows on loopback"
bash worker/tools/mooncake-venv.sh >/dev/null
cargo test -p tandem-worker --bin tandem-bench -- --ignored mooncake_rows_measure_with_the_venv

step "all tests passed"
