#!/usr/bin/env bash
# The main job, on any machine: trains configs/tiny.yaml (a 2.7M-parameter MoE, all four
# operators on) on 8 simulated CPU devices, or on the GPUs present with overrides for them.
# Extra arguments are config overrides, e.g. `bash scripts/demo.sh train.steps=10`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec peakflat train tiny --run-dir "${PEAKFLAT_OUT:-runs/tiny}" "$@"
