#!/usr/bin/env bash
# Creates (once) the venv of the `tandem-kv` Python package (worker/python), installs the package into
# it from this checkout, and prints its python's path on stdout. CI calls this (e2e/tools/test.sh).
#
#   bash worker/tools/python-venv.sh            # create or reuse; prints .../bin/python
#   TANDEM_PY_VENV_ROOT=/some/dir bash worker/tools/python-venv.sh
#
# The venv lives in ${TANDEM_PY_VENV_ROOT:-~/.cache/tandem}/python-venv-<hash>, keyed by a hash of the
# pinned requirements (worker/python/requirements.txt) and the interpreter's version: a change of
# either makes a new venv; otherwise the cached one is reused with no network. The package itself is
# (re)installed from the checkout on every call (--no-deps --no-build-isolation, ~2 s): its build
# generates the gRPC stubs from worker/interfaces/proto with the venv's pinned grpcio-tools, so messages
# added to engine.proto appear without any change here.
set -euo pipefail
cd "$(dirname "$0")/../.."

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "python-venv: $python not found" >&2; exit 1; }
req=worker/python/requirements.txt
# The SGLang release the adapter is written against: its wheel (~39 MB, not installed: it needs torch)
# is kept in the venv for the contract test, which reads its source (tests/test_sglang_contract.py).
sglang_pin=sglang==0.5.23
key=$({ cat "$req"; echo "$sglang_pin"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
root="${TANDEM_PY_VENV_ROOT:-$HOME/.cache/tandem}"
venv="$root/python-venv-$key"
py="$venv/bin/python"

if ! [[ -x $py && -e $venv/.complete ]]; then
  rm -rf "$venv"
  mkdir -p "$root"
  "$python" -m venv "$venv" >&2
  "$py" -m pip install --quiet --disable-pip-version-check --no-input -r "$req" >&2
  "$py" -m pip download --quiet --disable-pip-version-check --no-input --no-deps "$sglang_pin" -d "$venv/wheels" >&2
  touch "$venv/.complete"
fi
"$py" -m pip install --quiet --disable-pip-version-check --no-input --no-deps --no-build-isolation \
  --force-reinstall worker/python >&2
rm -rf worker/python/build worker/python/src/*.egg-info
"$py" -c 'import tandem_kv' >&2
echo "$py"
