#!/usr/bin/env bash
# Creates (once) the venv of the SGLang adapter's tests that need SGLang itself
# (worker/python/tests/test_sglang_real.py, test_sglang_pd.py): a thin venv over the vLLM venv
# (worker/tools/vllm-venv.sh, whose torch, transformers and numpy it reuses through a .pth file), with
# requirements-sglang.txt and sglang installed without dependencies (SGLang's full set pulls GPU
# kernels and servers these tests never import; its pinned torch 2.14.1 would be a second 6 GB torch).
# Installs tandem-kv from this checkout into it and prints its python's path on stdout. CI calls this
# (e2e/tools/test.sh).
#
#   bash worker/tools/sglang-venv.sh          # create or reuse; prints .../bin/python
#   TANDEM_PY_VENV_ROOT=/some/dir bash worker/tools/sglang-venv.sh
#
# The venv lives in ${TANDEM_PY_VENV_ROOT:-~/.cache/tandem}/sglang-venv-<hash>, keyed by the vLLM
# venv's path, requirements-sglang.txt, the SGLang pin and the interpreter's version; otherwise the
# cached one is reused with no network.
set -euo pipefail
cd "$(dirname "$0")/../.."

python=${PYTHON:-python3}
base_py=$(bash worker/tools/vllm-venv.sh)
base_site=$("$base_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
req=worker/python/requirements-sglang.txt
sglang_pin=sglang==0.5.23
key=$({ echo "$base_site"; cat "$req"; echo "$sglang_pin"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
root="${TANDEM_PY_VENV_ROOT:-$HOME/.cache/tandem}"
venv="$root/sglang-venv-$key"
py="$venv/bin/python"

if ! [[ -x $py && -e $venv/.complete ]]; then
  rm -rf "$venv"
  mkdir -p "$root"
  start=$(date +%s)
  "$python" -m venv "$venv" >&2
  # After this venv's own site-packages on sys.path: its pins win over the vLLM venv's.
  echo "$base_site" > "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tandem-vllm-base.pth"
  "$py" -m pip install --quiet --disable-pip-version-check --no-input --no-cache-dir --no-deps -r "$req" "$sglang_pin" >&2
  touch "$venv/.complete"
  echo "sglang-venv: built $venv in $(($(date +%s) - start)) s, $(du -sh "$venv" | cut -f1)" >&2
fi
"$py" -m pip install --quiet --disable-pip-version-check --no-input --no-deps --no-build-isolation \
  --force-reinstall worker/python >&2
rm -rf worker/python/build worker/python/src/*.egg-info
"$py" -c 'import tandem_kv.sglang, sglang.srt.mem_cache.pool_host.mha, sglang.srt.disaggregation.decode' >&2
echo "$py"
