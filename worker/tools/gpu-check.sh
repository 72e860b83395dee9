#!/usr/bin/env bash
# The GPU check (issue 16 item 4; DESIGN §6): every CUDA test that is #[ignore]d on machines without
# a device, then `tandem-bench gpu` (KV page copies H2D, D2H and D2D as ratios of the device's own
# one-copy peaks, measured in the same run). Under 8 minutes on one NVIDIA GPU.
#
#   bash worker/tools/gpu-check.sh build   # here (needs cargo): release builds with `--features
#                                          # cuda` into target/gpu-check/ (no CUDA toolkit needed)
#   bash worker/tools/gpu-check.sh run     # on the GPU machine (needs only libcuda): runs them
#   bash worker/tools/gpu-check.sh         # both, on a GPU machine that has cargo
#
# The `device` tool's machine has no Rust toolchain: build here, then carry `target/gpu-check` and
# run `bash worker/tools/gpu-check.sh run`. Exit status: 0 when every test passed and the bench ran;
# 1 otherwise; 3 when no device is usable (nothing was checked).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/gpu-check
mode=${1:-all}

build() {
  for d in "$HOME/.cargo/bin"; do [[ -d $d ]] && PATH="$d:$PATH"; done
  rm -rf "$out" && mkdir -p "$out/tests"
  cargo build --release -p tandem-worker --features cuda --bin tandem-bench
  cp target/release/tandem-bench "$out/"
  # Every test binary of the worker whose ignored tests need the device: the library (load::,
  # memory::) and the integration tests that carry #[ignore = "needs a CUDA device"].
  local targets=()
  if grep -rq 'needs a CUDA device' worker/src; then targets+=(--lib); fi
  for f in worker/tests/*.rs; do
    if grep -q 'needs a CUDA device' "$f"; then targets+=(--test "$(basename "$f" .rs)"); fi
  done
  cargo test --release -p tandem-worker --features cuda "${targets[@]}" --no-run \
    --message-format=json-render-diagnostics \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])' \
    | while read -r exe; do cp "$exe" "$out/tests/"; done
  ls -la "$out" "$out/tests"
}

run() {
  [[ -x $out/tandem-bench ]] || { echo "no $out/tandem-bench: run '$0 build' first" >&2; exit 1; }
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
    echo "gpu-check: no NVIDIA device visible (nvidia-smi)" >&2
    exit 3
  fi
  local failed=0
  for t in "$out"/tests/*; do
    echo "==> $(basename "$t") --ignored (the CUDA tests)"
    # --ignored runs only the ignored tests: the CUDA ones; the host-side ones ran in CI.
    if ! timeout 240 "$t" --ignored --test-threads 1; then failed=1; fi
  done
  echo "==> tandem-bench gpu"
  if ! timeout 180 "$out/tandem-bench" gpu; then failed=1; fi
  if [[ $failed -ne 0 ]]; then echo "gpu-check: FAILED" >&2; exit 1; fi
  echo "gpu-check: all CUDA tests passed, figures above"
}

case $mode in
  build) build ;;
  run) run ;;
  all) build && run ;;
  *) echo "usage: $0 [build|run]" >&2; exit 2 ;;
esac
