#!/usr/bin/env bash
# Makes .venv-torch: Python 3.11 with torch (CPU build), numpy, and transformers and safetensors
# (pinned), for the PyTorch side of `peakflat xcheck` (peakflat_jax/xcheck/torch_side.py) and
# the Hugging Face reference models of tests/test_hf.py, where jax's Python has no torch.
# Idempotent like env.sh: a second run only checks. Prints the venv's python on stdout.
#
# torch is pinned to the CPU wheel (2.13.0+cpu, which lies on these machines' disk, found
# through pip's find-links): a bare `torch` or `torch==2.13.0` could resolve to the CUDA build,
# several GB with its nvidia-* wheels. The install refuses any nvidia-* or triton package.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

TORCH_PIN="torch==2.13.0+cpu"
HF_PINS="transformers==5.23.0 safetensors"
venv="$repo_root/.venv-torch"
stamp="$venv/.installed-$(echo "$TORCH_PIN numpy $HF_PINS" | sha1sum | cut -c1-12)"

find_python311() {
  # A bare `python3.11` may be a pyenv shim that fails; look where pyenv keeps it first.
  local candidates=()
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.11*/bin/python3.11)
  fi
  candidates+=("$HOME"/.pyenv/versions/3.11*/bin/python3.11 /usr/bin/python3.11 /usr/local/bin/python3.11)
  if command -v python3.11 >/dev/null 2>&1; then candidates+=("$(command -v python3.11)"); fi
  for candidate in "${candidates[@]}"; do
    if [ -x "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "error: Python 3.11 not found (looked in pyenv's versions and on PATH)" >&2
  return 1
}

# One maker at a time: test files on two pytest-xdist workers may ask at once, and the second
# would find a half-made venv. The lock file lies beside the venv, not in it (it is remade).
exec 9>"$repo_root/.venv-torch.lock"
flock 9
if [ ! -f "$stamp" ]; then
  python311="$(find_python311)"
  echo "setting up $venv with $python311" >&2
  rm -rf "$venv"
  "$python311" -m venv "$venv"
  log="$venv/pip-install.log"
  # --only-binary: never build anything; the report lists what pip chose before it installs.
  "$venv/bin/pip" install --only-binary=:all: --report "$venv/pip-report.json" \
    "$TORCH_PIN" numpy $HF_PINS >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  if "$venv/bin/python" - "$venv/pip-report.json" <<'EOF'
import json, sys
names = [item["metadata"]["name"].lower() for item in json.load(open(sys.argv[1]))["install"]]
bad = [n for n in names if n.startswith("nvidia") or n == "triton"]
sys.exit(1 if bad else 0)
EOF
  then :; else
    echo "error: pip pulled CUDA packages into $venv; see $venv/pip-report.json" >&2
    exit 1
  fi
  "$venv/bin/python" -c 'import torch, numpy; assert torch.__version__ == "2.13.0+cpu", torch.__version__'
  "$venv/bin/python" -c 'import transformers, safetensors
assert transformers.__version__ == "5.23.0", transformers.__version__'
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
echo "$venv/bin/python"
