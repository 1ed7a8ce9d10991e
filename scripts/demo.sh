#!/usr/bin/env bash
# The main job on 8 simulated CPU devices: until the trainer exists, the Ring-DTP benchmark at
# CPU size with its memory table (XLA's plan on CPU; peaks need a GPU: scripts/bench_ring_dtp.py).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec peakflat bench ring_dtp --preset cpu --out-dir "${PEAKFLAT_OUT:-out}" "$@"
