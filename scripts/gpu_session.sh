#!/usr/bin/env bash
# The GPU runs of a session, as the stages of one detached driver on nvidia-h200 (~15 min),
# most decisive first, each with its own limit; logs and records under $LOGS as they go.
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (carry [".gpu", ".whl"], timeout_s 600):
#     PEAKFLAT_COMMIT=<sha> bash .gpu/driver.sh start .gpu/stages.sh 0 >/dev/null; \
#     for i in $(seq 110); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done; \
#     bash .gpu/driver.sh collect
#   call 2 (no carry, within 30 s of call 1's end: after that the machine and the driver are
#   gone):
#     for i in $(seq 110); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done; \
#     bash /tmp/work/.gpu/driver.sh collect
#   then give_back at once and write the record with scripts/record_gpu_session.py. A helper
#   must not call the device tool: its time is the session's.
#
# What each stage answers (the plan at this commit: the host held to the memory a run gets,
# with what the kernel keeps beside the pinned pool; auto's largest searched over the settings
# that trade the device's memory for the host's):
#   dump64k_bwd  issue 26: where XLA:GPU schedules the write-back under the backward (2.460 s,
#                894 ms of copies exposed where its floor is ~0.25 s): the overlapped step's
#                schedule, compiled only (scripts/xla_copy_schedule.py reads it)
#   ours_1p1     issue 25: h200-1 with all four on (the lightest setting on the device there) at
#                1.1x its plan's largest context (634,548; 634,496 trained at 119.87 GiB on
#                2026-12-01): XLA's plan, compiled only, against the device's 132.8 GiB
#   e2e_largest  issues 25 and 27: h200-e2e with operators auto at its plan's largest, 506,628
#                (every boundary kept on the device, the optimizer streamed), 3 steps, the host's
#                available memory sampled each second (427,790 with every boundary offloaded was
#                killed on the host twice)
set -uo pipefail
cd "$(dirname "$0")/.."
export PEAKFLAT_COMMIT="${PEAKFLAT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
LOGS="${LOGS:-/tmp/gpu-logs}"; mkdir -p "$LOGS"
run() {  # run NAME LIMIT CMD...: each line stamped with seconds since the stage began
  local name=$1 limit=$2; shift 2
  echo "=== $name start $(date -Is)"
  local s; s=$(date +%s%N)
  timeout "$limit" "$@" 2>&1 | while IFS= read -r line; do
    printf '%7.1f %s\n' "$(( ($(date +%s%N) - s) / 100000000 ))e-1" "$line"; done > "$LOGS/$name.log"
  echo "=== $name rc=${PIPESTATUS[0]} wall=$(( ($(date +%s%N) - s) / 1000000000 )) s"
  tail -n 6 "$LOGS/$name.log"
}
keep() { cp "$1/summary.json" "$LOGS/$2_summary.json" 2>/dev/null
         cp "$1/metrics.jsonl" "$LOGS/$2_metrics.jsonl" 2>/dev/null; rm -rf "$1"; }
nc=(train.checkpoints=false --no-progress --overwrite)
train=(python3 -m peakflat_jax.cli train)  # timeout runs programs, not shell functions
plan=(python3 -m peakflat_jax.cli plan)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
export PEAKFLAT_JAX_CACHE=/tmp/cache
ALL_OFF=(operators.moe_dispatch=ep operators.loss=materialized operators.offload=none
         operators.optimizer_offload=false)
ALL_ON=(operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all
        operators.optimizer_offload=true)
unbounded=(train.device_memory_gib=1000000 train.host_memory_gib=1000000)
grow() { python3 -c "import sys; n = int(sys.argv[1]) * 11 // 10; print(n + n % 2)" "$1"; }  # 1.1x, even
rm -rf /tmp/xla-dump
XLA_FLAGS="--xla_dump_to=/tmp/xla-dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=overlapped" \
  run dump64k_bwd 150 "${plan[@]}" h200-1 "${ALL_ON[@]}" operators.layer_loop=unrolled \
  operators.optimizer_writeback=backward --check
(cd /tmp/xla-dump && tar -czf "$LOGS/xla_dump_h200-1_on64k_bwd.tgz" \
  $(ls | grep -E "overlapped.*after_optimizations-live-range\.txt" | head -2)) 2>/dev/null
run ours_1p1 200 "${plan[@]}" h200-1 data.seq_len="$(grow 634548)" "${ALL_ON[@]}" \
  "${unbounded[@]}" --check
sample() { while sleep 1; do p=$(pgrep -f "^python3 -m peakflat_jax.cli train h200-e2e" | head -1)
  echo "$(date +%s) $(grep -h VmRSS /proc/$p/status 2>/dev/null | tr -s ' ') $(grep MemAvailable /proc/meminfo | tr -s ' ')"
  done > "$LOGS/e2e_largest_mem.log"; }
sample & sampler=$!
run e2e_largest 620 "${train[@]}" h200-e2e data.seq_len=506628 train.steps=3 "${nc[@]}" \
  --run-dir /tmp/r3
kill $sampler
keep /tmp/r3 e2e_largest
echo "=== all done $(date -Is)"
