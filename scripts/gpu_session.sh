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
#   then give_back at once and write the record with scripts/record_gpu_session.py. (2026-12-03
#   16:24: call 1 found no machine, and calls 2 and 3, batched after it without the test, each
#   started one and waited 560 s on a driver that never started: 1,300 of the 1,800 s lost.) A
#   helper must not call the device tool: its time is the session's.
#
# A stage that lifts the device check (train.device_memory_gib) pins optimizer.resident_groups:
# left null, the planner would keep every group on a device it believes is 1 PB.
#
# What each stage answers:
#   check524k    issue 25: h200-1 all four on at 524,288, K = 0, compiled only, with the dense
#                FFN's backward ordered (model.layers.weight_gradients_first): XLA's plan of the
#                overlapped step at or under the plan's 90.92 GiB and within 1.2x (82.36
#                before the barrier, when XLA chose that order itself)
#   base64k, on64k_autoK  issue 26: the standard stack and all four forced on (the planner's
#                resident count) at 64K in one lease (1.602 and 1.685 s in two leases), the
#                barrier in: does it cost time?
#   largest      issues 25/26/27: h200-1 with operators auto at the plan's largest context,
#                855,174 (1.44x the standard stack's 592,826), 3 steps: trains, peak at or
#                under 132.8 GiB and the plan within 1.2x of it
#   over1p1      issue 25: 1.1x that, 940,692, compiled only: XLA past the device's 132.8
#   alone_*      issue 26: the standard stack with one operator on (pipelined MoE, ring loss,
#                SCO), 64K, against base64k of the same lease
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
ALL_OFF=(operators.moe_dispatch=ep operators.loss=materialized operators.offload=none
         operators.optimizer_offload=false)
ALL_ON=(operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all
        operators.optimizer_offload=true)
unbounded=(train.device_memory_gib=1000000 train.host_memory_gib=1000000)
sixty4=(train.steps=5 train.profile_steps=2 "${nc[@]}")
check_on() {  # check_on NAME LIMIT CONTEXT [K]: all four on, compiled only (plan --check)
  run "$1" "$2" "${plan[@]}" h200-1 "data.seq_len=$3" "${ALL_ON[@]}" \
    "optimizer.resident_groups=${4:-0}" "${unbounded[@]}" --check
}
# 1. Issue 25: the dense FFN's order made, at long context.
check_on check524k 240 524288
# 2. Issue 26 at 64K, both stacks in one lease.
run base64k 200 "${train[@]}" h200-1 "${sixty4[@]}" --run-dir /tmp/r1
keep /tmp/r1 base64k
run on64k_autoK 200 "${train[@]}" h200-1 "${ALL_ON[@]}" "${sixty4[@]}" --run-dir /tmp/r1
keep /tmp/r1 on64k_autoK
# 3. The plan's largest context for ours, and 1.1x it.
run largest 560 "${train[@]}" h200-1 data.seq_len=855174 train.steps=3 "${nc[@]}" --run-dir /tmp/r2
keep /tmp/r2 largest
# The knobs the plan chose at 855,174 (peakflat plan h200-1 data.seq_len=855174 --json), pinned:
# with the device check lifted the planner would choose others.
run over1p1 300 "${plan[@]}" h200-1 data.seq_len=940692 operators.moe_dispatch=pipelined \
  operators.token_budget=16384 operators.loss=materialized operators.offload=all \
  operators.optimizer_offload=true optimizer.resident_groups=0 "${unbounded[@]}" --check
# 4. Each operator alone on the standard stack, the same lease (issue 26's table; targets: the
# pipelined MoE within 1.10x, SCO 1.02x, the ring loss 1.0x of the standard stack's step).
for alone in operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all; do
  name=alone_${alone#operators.}; name=${name%%=*}
  run "$name" 200 "${train[@]}" h200-1 "${ALL_OFF[@]}" "$alone" "${sixty4[@]}" --run-dir /tmp/r1
  keep /tmp/r1 "$name"
done
echo "=== all done $(date -Is)"
