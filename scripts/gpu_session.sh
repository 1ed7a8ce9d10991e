#!/usr/bin/env bash
# The GPU runs of a session, as the stages of one detached driver on nvidia-h200 (~22 min as
# estimated from the walls of 2026-12-03's drivers; a lease is 30 min of device time with ~3 to
# start the machine), the decisive ones first, each with its own limit; logs and records under
# $LOGS as they go. The trainer adds its own XLA flags to any XLA_FLAGS a stage sets
# (cli.prepare_environment).
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (kind nvidia-h200, carry [".gpu", ".whl"], timeout_s 600), ALONE in its batch:
#     PEAKFLAT_COMMIT=<sha> bash .gpu/driver.sh start .gpu/stages.sh 0 >/dev/null; \
#     for i in $(seq 110); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done; \
#     bash .gpu/driver.sh collect
#   only once call 1 has returned with the driver's log, calls 2, 3 (no carry, back to back: the
#   machine is gone 30 s after a call returns, and the driver with it):
#     test -f /tmp/gpu-logs/driver.log || { echo "no driver here"; exit 3; }; \
#     for i in $(seq 110); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done; \
#     bash /tmp/work/.gpu/driver.sh collect
#   A call answered "taken back for other work" lost its machine and the driver with it: make
#   call 1 again (the stages in the order left to run; 2026-12-03 22:41 lost 560 s so). Where a
#   driver ends early, a second one can run on the warm machine: call 1's form, with
#   `rm -rf /tmp/gpu-logs;` first.
#   then give_back at once and write the record with scripts/record_gpu_session.py. (2026-12-03
#   16:24: call 1 found no machine, and calls 2 and 3, batched after it without the test, each
#   started one and waited 560 s on a driver that never started: 1,300 of the 1,800 s lost.) A
#   helper must not call the device tool: its time is the session's.
#
# A stage that lifts the device check (train.device_memory_gib) pins optimizer.resident_groups:
# left null, the planner would keep every group on a device it believes is 1 PB.
#
# What each stage answers:
#   auto_e2e534k issue 25: h200-e2e at the plan's largest context under operators auto,
#                533,994, with the knobs the trainer and `peakflat plan` now agree on (1 of 12
#                groups resident, 8 chunks: 129.33 GiB planned; 2026-12-04 15:30 ran 0 groups
#                and 6 chunks under its own cap: 89.22 GiB against 131.82, 1.48x). The
#                overlapped step's buffer assignment and live ranges are kept (~11 min)
#   dump_on855k  issue 25: h200-1 at its planned largest (855,174, the knobs auto chose there),
#                compiled only and dumped: how many [M_c, H] and [M_c, F] rows the pipelined
#                MoE holds on a GPU at B = 16,384 (h200-e2e's two dumps: four and six, against
#                the CPU-measured terms' nine and six)
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
         cp "$1/metrics.jsonl" "$LOGS/$2_metrics.jsonl" 2>/dev/null
         cp "$1/profile.json" "$LOGS/$2_profile.json" 2>/dev/null; rm -rf "$1"; }
nc=(train.checkpoints=false --no-progress --overwrite)
train=(python3 -m peakflat_jax.cli train)  # timeout runs programs, not shell functions
plan=(python3 -m peakflat_jax.cli plan)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
export PEAKFLAT_JAX_CACHE=/tmp/cache
unbounded=(train.device_memory_gib=1000000 train.host_memory_gib=1000000)
pinned=(operators.moe_dispatch=pipelined operators.token_budget=16384 operators.loss=materialized
        operators.offload=all operators.optimizer_offload=true optimizer.resident_groups=0)
three=(train.steps=3 "${nc[@]}")
lifted=(train.device_memory_gib=1000000)  # the host's budget stays the machine's
# 1. Issue 25: h200-e2e at auto's largest, trained, its overlapped step dumped.
rm -rf /tmp/xla-dump
XLA_FLAGS="--xla_dump_to=/tmp/xla-dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=overlapped" \
  run auto_e2e534k 720 "${train[@]}" h200-e2e data.seq_len=533994 "${three[@]}" --run-dir /tmp/r1
keep /tmp/r1 auto_e2e534k
(cd /tmp/xla-dump && tar -czf "$LOGS/xla_dump_auto_e2e534k.tgz" \
  $(ls | grep -E "overlapped.*after_optimizations-buffer-assignment\.txt" | head -1) \
  $(ls | grep -E "overlapped.*after_optimizations-live-range\.txt" | head -1)) 2>/dev/null
# 2. Issue 25: h200-1's pipelined MoE rows on a GPU at its planned largest.
rm -rf /tmp/xla-dump
XLA_FLAGS="--xla_dump_to=/tmp/xla-dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=overlapped" \
  run dump_on855k 300 "${plan[@]}" h200-1 data.seq_len=855174 "${pinned[@]}" --check
(cd /tmp/xla-dump && tar -czf "$LOGS/xla_dump_on855k.tgz" \
  $(ls | grep -E "overlapped.*after_optimizations-buffer-assignment\.txt" | head -1) \
  $(ls | grep -E "overlapped.*after_optimizations-live-range\.txt" | head -1)) 2>/dev/null
echo "=== all done $(date -Is)"
