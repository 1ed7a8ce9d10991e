#!/usr/bin/env bash
# The main job, on any machine: trains configs/tiny.yaml (a 2.7M-parameter MoE, all four
# operators on) on 8 simulated CPU devices, or on the GPUs present with overrides for them.
# Extra arguments are config overrides or flags, in any order: `bash scripts/demo.sh train.steps=10`;
# a second run needs `--overwrite` (start again) or `--resume` (continue the first). The run
# directory is PEAKFLAT_OUT (default runs/tiny), unless the arguments name one (--run-dir).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
run_dir=(--run-dir "${PEAKFLAT_OUT:-runs/tiny}")
for word in "$@"; do
  case "$word" in --run-dir|--run-dir=*) run_dir=() ;; esac
done
exec peakflat train tiny "${run_dir[@]}" "$@"
