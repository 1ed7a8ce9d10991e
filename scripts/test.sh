#!/usr/bin/env bash
# The test command: sets up .venv (Python 3.12), lints, and runs the suite on 8 simulated CPU
# devices, in two pytest-xdist workers (PEAKFLAT_TEST_WORKERS; 0: in this process), a test file
# to a worker: a file's tests share its module fixtures and the programs its trainers compiled.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ruff check peakflat_jax tests scripts
workers="${PEAKFLAT_TEST_WORKERS:-2}"
exec python -m pytest -q -n "$workers" --dist loadfile --durations=15 "$@" tests
