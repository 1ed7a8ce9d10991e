#!/usr/bin/env bash
# The test command: sets up .venv (Python 3.12), lints, and runs the suite on 8 simulated CPU
# devices.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ruff check peakflat_jax tests scripts
exec python -m pytest -q "$@" tests
