# Sourced by demo.sh and test.sh: finds Python 3.12 (jax 0.11.2 needs it) and
# makes .venv with the package installed. Idempotent: a second run only checks.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

find_python312() {
  # A bare `python3.12` may be a pyenv shim that fails; look where pyenv keeps it first.
  local candidates=()
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
  fi
  candidates+=("$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12)
  if command -v python3.12 >/dev/null 2>&1; then candidates+=("$(command -v python3.12)"); fi
  for candidate in "${candidates[@]}"; do
    if [ -x "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "error: Python 3.12 not found (looked in pyenv's versions and on PATH)" >&2
  return 1
}

venv="$repo_root/.venv"
stamp="$venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python312="$(find_python312)"
  echo "setting up $venv with $python312" >&2
  "$python312" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip 2>/dev/null || true
  "$venv/bin/pip" install --quiet -e ".[test]"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
