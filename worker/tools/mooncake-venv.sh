#!/usr/bin/env bash
# Creates (once) the Python venv `tandem-bench transfer --against mooncake` drives Mooncake from, and
# prints its python's path on stdout.
#
#   bash worker/tools/mooncake-venv.sh            # create or reuse; prints .../bin/python
#   MOONCAKE_VENV=/some/dir bash worker/tools/mooncake-venv.sh
#
# Installs `mooncake-transfer-engine-non-cuda==0.3.13.post1` from PyPI into
# ${MOONCAKE_VENV:-~/.cache/tandem/mooncake-venv}. The default `mooncake-transfer-engine` wheel links
# libcudart/libcuda and does not import without a GPU driver; the non-CUDA build does. Both need
# Debian's `libibverbs1` even for TCP (installed by e2e/tools/install-build-deps.sh, called here).
# Idempotent: when the venv already imports `mooncake.engine` it is reused as is (no network).
set -euo pipefail
cd "$(dirname "$0")/../.."

pkg="mooncake-transfer-engine-non-cuda==0.3.13.post1"
venv="${MOONCAKE_VENV:-$HOME/.cache/tandem/mooncake-venv}"
py="$venv/bin/python"
probe='from mooncake.engine import TransferEngine; TransferEngine()'

if [[ -x $py ]] && "$py" -c "$probe" >/dev/null 2>&1; then
  echo "$py"
  exit 0
fi

bash e2e/tools/install-build-deps.sh >&2
python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "mooncake-venv: $python not found" >&2; exit 1; }
mkdir -p "$(dirname "$venv")"
[[ -x $py ]] || "$python" -m venv "$venv" >&2
"$py" -m pip install --quiet --disable-pip-version-check "$pkg" >&2
if ! "$py" -c "$probe" >&2; then
  echo "mooncake-venv: $pkg installed in $venv but mooncake.engine does not import" >&2
  exit 1
fi
echo "$py"
