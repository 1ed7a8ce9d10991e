#!/usr/bin/env bash
# The next session's GPU runs, as the stages of one detached driver on nvidia-h200 (~26 min;
# the last stages may not finish), most decisive first, each with its own limit; logs and
# records under $LOGS as they go.
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (carry [".gpu", ".whl"]): PEAKFLAT_COMMIT=<sha> bash .gpu/driver.sh start .gpu/stages.sh 555
#   calls 2.. (no carry, within 30 s): poll for "all done" in /tmp/gpu-logs/driver.log, then
#     bash /tmp/work/.gpu/driver.sh collect
#
# What each stage answers (the last drivers' records: h200_session_gpu_20261201-185430.json,
# h200_1_lhs_gpu_20261201-193600.json):
#   cmdbuf      issue 26: the streamed optimizer's host copies ran on four copy streams at the
#               link's rate but only 80 ms of 1.27 s under compute, with or without the
#               latency-hiding scheduler: do XLA:GPU's command buffers (CUDA graphs) serialize
#               them? The same run with command buffers off.
#   dump_sco64k issue 25: XLA's GPU dumps of EP's step at its own peak (SCO alone at 64K: the
#               plan 1.02x; EP's layer terms over-count at 256K and 128K, and lowering them put
#               this point under)
#   base_largest / base_over   issue 25's last check: h200-1's standard stack at the plan's
#               largest context trains (3 steps) and 1.1x of it does not fit
#   e2e_hostcpu_65536   issue 27: the standard stack's longest with its AdamW on the host CPU
#               (plan: 67,414), its peak resident memory (host_peak_bytes, VmHWM)
#   e2e_auto_262144  issues 25 and 27: ours at 256K as the plan now takes it (scanned: the
#               unrolled step's hoisted weight-gradient sums do not fit its plan)
#   e2e_batch_*  issue 27: the largest batch at 32K, ours (8) and the host-CPU standard stack (2)
set -uo pipefail
cd "$(dirname "$0")/.."
export PEAKFLAT_COMMIT="${PEAKFLAT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
LOGS="${LOGS:-/tmp/gpu-logs}"; mkdir -p "$LOGS"
run() {  # run NAME LIMIT CMD...: each line stamped with seconds since the stage began (a bash
  # read loop: mawk buffers its whole input)
  local name=$1 limit=$2; shift 2
  echo "=== $name start $(date -Is)"
  local s; s=$(date +%s%N)
  timeout "$limit" "$@" 2>&1 | while IFS= read -r line; do
    printf '%7.1f %s\n' "$(( ($(date +%s%N) - s) / 100000000 ))e-1" "$line"; done > "$LOGS/$name.log"
  echo "=== $name rc=${PIPESTATUS[0]} wall=$(( ($(date +%s%N) - s) / 1000000000 )) s"
  tail -n 6 "$LOGS/$name.log"
}
keep() { cp "$1/summary.json" "$LOGS/$2_summary.json" 2>/dev/null
         cp "$1/metrics.jsonl" "$LOGS/$2_metrics.jsonl" 2>/dev/null; }
nc=(train.checkpoints=false --no-progress --overwrite)
ON=(operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all
    operators.optimizer_offload=true operators.layer_loop=unrolled)
train=(python3 -m peakflat_jax.cli train)  # timeout runs programs, not shell functions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
export PEAKFLAT_JAX_CACHE=/tmp/cache
ALL_OFF=(operators.moe_dispatch=ep operators.loss=materialized operators.offload=none
         operators.optimizer_offload=false)
run cmdbuf 240 env XLA_FLAGS=--xla_gpu_enable_command_buffer= "${train[@]}" h200-1 \
  train.steps=4 operators.optimizer_offload=true train.profile_steps=2 "${nc[@]}" --run-dir /tmp/r-cb
keep /tmp/r-cb cmdbuf; cp /tmp/r-cb/profile.json "$LOGS/cmdbuf_profile.json"
unset PEAKFLAT_JAX_CACHE
dump() {  # dump NAME MODULE_RE OVERRIDES...: plan --check with XLA's GPU dumps kept: the live
  # ranges, the buffer assignment and the memory report, compressed
  local name=$1 module=$2; shift 2; rm -rf "/tmp/dump-$name"
  XLA_FLAGS="--xla_dump_to=/tmp/dump-$name --xla_dump_hlo_as_text --xla_dump_hlo_module_re=$module" \
    run "dump_$name" 200 python3 -m peakflat_jax.cli plan h200-1 "$@" --check
  mkdir -p "/tmp/pick-$name" && for f in /tmp/dump-$name/*after_optimizations-live-range.txt \
      /tmp/dump-$name/*after_optimizations-memory-usage-report.txt; do cp "$f" "/tmp/pick-$name/"; done
  for f in /tmp/dump-$name/*after_optimizations-buffer-assignment.txt; do
    head -c 20000000 "$f" > "/tmp/pick-$name/$(basename "$f")"; done
  tar -czf "$LOGS/dump-$name.tgz" -C /tmp "pick-$name"
}
dump sco64k train_step "${ALL_OFF[@]}" operators.offload=all operators.layer_loop=scan
export PEAKFLAT_JAX_CACHE=/tmp/cache
largest=$(python3 -m peakflat_jax.cli plan h200-1 "${ALL_OFF[@]}" --json \
  | python3 -c "import json, sys; print(json.load(sys.stdin)['largest_context'])")
over=$(( (largest * 11 / 10 + 1023) / 1024 * 1024 ))
echo "h200-1 standard stack: the plan's largest $largest, 1.1x: $over"
run base_largest 300 "${train[@]}" h200-1 data.seq_len=$largest train.steps=3 "${ALL_OFF[@]}" \
  "${nc[@]}" --run-dir /tmp/r-bl; keep /tmp/r-bl base_largest
run base_over 200 "${train[@]}" h200-1 data.seq_len=$over train.steps=3 "${ALL_OFF[@]}" \
  train.device_memory_gib=1000000 "${nc[@]}" --run-dir /tmp/r-bo; keep /tmp/r-bo base_over
run e2e_hostcpu_65536 330 "${train[@]}" h200-e2e data.seq_len=65536 train.steps=3 \
  "${ALL_OFF[@]}" optimizer.update_on=host_cpu train.device_memory_gib=1000000 "${nc[@]}" \
  --run-dir /tmp/r-hc64; keep /tmp/r-hc64 e2e_hostcpu_65536
run e2e_auto_262144 420 "${train[@]}" h200-e2e data.seq_len=262144 train.steps=3 "${nc[@]}" \
  --run-dir /tmp/r-e2e-256k; keep /tmp/r-e2e-256k e2e_auto_262144
run e2e_batch_ours 300 "${train[@]}" h200-e2e data.seq_len=32768 data.batch_size=8 \
  train.steps=3 "${nc[@]}" --run-dir /tmp/r-b8; keep /tmp/r-b8 e2e_batch_ours
run e2e_batch_hostcpu 330 "${train[@]}" h200-e2e data.seq_len=32768 data.batch_size=2 \
  train.steps=3 "${ALL_OFF[@]}" optimizer.update_on=host_cpu train.device_memory_gib=1000000 \
  "${nc[@]}" --run-dir /tmp/r-b2; keep /tmp/r-b2 e2e_batch_hostcpu
echo "=== all done $(date -Is)"
