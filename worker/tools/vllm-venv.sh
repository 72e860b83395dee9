#!/usr/bin/env bash
# Creates (once) the venv of the vLLM adapter's tests (worker/python/tests/test_vllm_tier.py): the
# pinned tandem-kv requirements (requirements.txt), torch with its dependencies
# (requirements-torch.txt), then without dependencies the packages vLLM's offloading modules import
# (requirements-vllm.txt) and vllm itself (its full set pulls GPU kernels, compilers and servers
# the scheduler-side offloading path never imports). Installs tandem-kv from this checkout into it
# and prints its python's path on stdout. CI calls this (e2e/tools/test.sh).
#
#   bash worker/tools/vllm-venv.sh            # create or reuse; prints .../bin/python
#   TANDEM_PY_VENV_ROOT=/some/dir bash worker/tools/vllm-venv.sh
#
# The venv lives in ${TANDEM_PY_VENV_ROOT:-~/.cache/tandem}/vllm-venv-<hash>, keyed by a hash of the three
# requirement files, the vLLM pin and the interpreter's version; otherwise the cached one is reused
# with no network. PyPI's torch for Linux x86_64 is the CUDA build: it brings its CUDA libraries
# (most of the venv's size) and runs CPU tensors without a GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "vllm-venv: $python not found" >&2; exit 1; }
req=worker/python/requirements.txt
req_torch=worker/python/requirements-torch.txt
req_vllm=worker/python/requirements-vllm.txt
vllm_pin=vllm==0.33.0
key=$({ cat "$req" "$req_torch" "$req_vllm"; echo "$vllm_pin"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
root="${TANDEM_PY_VENV_ROOT:-$HOME/.cache/tandem}"
venv="$root/vllm-venv-$key"
py="$venv/bin/python"

if ! [[ -x $py && -e $venv/.complete ]]; then
  rm -rf "$venv"
  mkdir -p "$root"
  start=$(date +%s)
  "$python" -m venv "$venv" >&2
  "$py" -m pip install --quiet --disable-pip-version-check --no-input --no-cache-dir -r "$req" -r "$req_torch" >&2
  "$py" -m pip install --quiet --disable-pip-version-check --no-input --no-cache-dir --no-deps -r "$req_vllm" "$vllm_pin" >&2
  touch "$venv/.complete"
  echo "vllm-venv: built $venv in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)" >&2
fi
"$py" -m pip install --quiet --disable-pip-version-check --no-input --no-deps --no-build-isolation \
  --force-reinstall worker/python >&2
rm -rf worker/python/build worker/python/src/*.egg-info
"$py" -c 'import tandem_kv.vllm, vllm.v1.kv_offload.tiering.spec' >&2
echo "$py"
