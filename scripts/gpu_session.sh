#!/usr/bin/env bash
# The next session's GPU runs, as the stages of one detached driver on nvidia-h200 (~26 min;
# the last stages may not finish), most decisive first, each with its own limit; logs and
# records under $LOGS as they go.
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (carry [".gpu", ".whl"]): PEAKFLAT_COMMIT=<sha> bash .gpu/driver.sh start .gpu/stages.sh 555
#   calls 2.. (no carry, within 30 s: a later call finds a fresh machine and the driver gone):
#     poll for "all done" in /tmp/gpu-logs/driver.log, then
#     bash /tmp/work/.gpu/driver.sh collect
#
# What each stage answers (the last drivers' records: h200_session_gpu_20261201-185430.json,
# h200_session_gpu_20261201-220535.json):
#   dump_off443k  issue 25: XLA's GPU dumps of h200-1's standard stack at the plan's largest
#               (443,720): which of EP's rows XLA frees before the attention's backward when
#               memory is scarce (the plan is 1.22x there and 1.1x of it fits)
#   e2e_hostcpu_65536   issue 27: the standard stack's longest with its AdamW on the host CPU
#               (plan: 67,414; compiled at 127.3 GiB last time, the step never ran), its peak
#               resident memory (host_peak_bytes, VmHWM)
#   e2e_auto_262144  issues 25 and 27: ours at 256K as the plan now takes it (EP, the ring
#               loss, SCO, the optimizer streamed, unrolled: 128.9 GiB planned)
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
train=(python3 -m peakflat_jax.cli train)  # timeout runs programs, not shell functions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
ALL_OFF=(operators.moe_dispatch=ep operators.loss=materialized operators.offload=none
         operators.optimizer_offload=false)
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
dump off443k train_step "${ALL_OFF[@]}" data.seq_len=443720
export PEAKFLAT_JAX_CACHE=/tmp/cache
run e2e_hostcpu_65536 330 "${train[@]}" h200-e2e data.seq_len=65536 train.steps=3 \
  "${ALL_OFF[@]}" optimizer.update_on=host_cpu train.device_memory_gib=1000000 train.host_memory_gib=1000000 "${nc[@]}" \
  --run-dir /tmp/r-hc64; keep /tmp/r-hc64 e2e_hostcpu_65536
run e2e_auto_262144 420 "${train[@]}" h200-e2e data.seq_len=262144 train.steps=3 "${nc[@]}" \
  --run-dir /tmp/r-e2e-256k; keep /tmp/r-e2e-256k e2e_auto_262144
run e2e_batch_ours 300 "${train[@]}" h200-e2e data.seq_len=32768 data.batch_size=8 \
  train.steps=3 "${nc[@]}" --run-dir /tmp/r-b8; keep /tmp/r-b8 e2e_batch_ours
run e2e_batch_hostcpu 330 "${train[@]}" h200-e2e data.seq_len=32768 data.batch_size=2 \
  train.steps=3 "${ALL_OFF[@]}" optimizer.update_on=host_cpu train.device_memory_gib=1000000 train.host_memory_gib=1000000 \
  "${nc[@]}" --run-dir /tmp/r-b2; keep /tmp/r-b2 e2e_batch_hostcpu
echo "=== all done $(date -Is)"
