#!/usr/bin/env bash
# This session's GPU runs, as the stages of one detached driver on nvidia-h200 (~25 min),
# most decisive first, each with its own limit; logs and records under $LOGS as they go.
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (carry [".gpu", ".whl"]): PEAKFLAT_COMMIT=<sha> bash .gpu/driver.sh start .gpu/stages.sh 540
#   calls 2.. (no carry, within 30 s of the last; a later call finds a fresh machine and the
#   driver gone), each returning as soon as the driver is done:
#     for i in $(seq 108); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done
#     bash /tmp/work/.gpu/driver.sh collect
#   then give_back at once.
#
# What each stage answers (the last drivers' records: h200_session_gpu_20261202-064500.json):
#   on64k_fwd, on64k_bwd  issue 26: h200-1 all four on at 64K with each MoE layer's update made
#               inside the unrolled forward (sco.MadeInLoop), written back as updated / under
#               the backward; profiled (host copies under compute); the first with XLA's
#               schedule dumped (where the copies sit now)
#   base64k     issue 26: the standard stack (auto) at 64K in the same lease, for the ratios
#   base_517600  issue 25: h200-1's standard stack at the plan's largest, counted as XLA:GPU
#               schedules a step past the device's memory (plan.programs.step_terms): 3 steps,
#               through the trainer's own fit check (nothing lifted)
#   e2e_hostcpu_b2  issue 27: the host-CPU standard stack's batch at 32K (plan: 2; ours trains 8)
#   e2e_auto_427790  issues 25 and 27: ours at h200-e2e's planned largest (6.5x the host-CPU
#               stack's 65,536)
#   check_off_665580  issue 25: does the standard stack fit at 1.29x the plan's largest
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
export PEAKFLAT_JAX_CACHE=/tmp/cache
ALL_ON=(operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all
        operators.optimizer_offload=true operators.layer_loop=unrolled)
XLA_FLAGS="--xla_dump_to=/tmp/dump-on64k --xla_dump_hlo_as_text --xla_dump_hlo_module_re=overlapped" \
  run on64k_fwd 260 "${train[@]}" h200-1 train.steps=5 "${ALL_ON[@]}" train.profile_steps=2 \
  "${nc[@]}" --run-dir /tmp/r-on-fwd; keep /tmp/r-on-fwd on64k_fwd
cp /tmp/r-on-fwd/profile.json "$LOGS/on64k_fwd_profile.json" 2>/dev/null
mkdir -p /tmp/pick-on64k && cp /tmp/dump-on64k/*after_optimizations-live-range.txt \
  /tmp/dump-on64k/*after_optimizations-memory-usage-report.txt /tmp/pick-on64k/ 2>/dev/null
tar -czf "$LOGS/dump-on64k.tgz" -C /tmp pick-on64k
run on64k_bwd 240 "${train[@]}" h200-1 train.steps=5 "${ALL_ON[@]}" \
  operators.optimizer_writeback=backward train.profile_steps=2 "${nc[@]}" --run-dir /tmp/r-on-bwd
keep /tmp/r-on-bwd on64k_bwd; cp /tmp/r-on-bwd/profile.json "$LOGS/on64k_bwd_profile.json" 2>/dev/null
run base64k 160 "${train[@]}" h200-1 train.steps=5 "${nc[@]}" --run-dir /tmp/r-base64k
keep /tmp/r-base64k base64k
run base_517600 300 "${train[@]}" h200-1 data.seq_len=517600 train.steps=3 "${ALL_OFF[@]}" \
  "${nc[@]}" --run-dir /tmp/r-base518k; keep /tmp/r-base518k base_517600
HOST_CPU=("${ALL_OFF[@]}" optimizer.update_on=host_cpu train.device_memory_gib=1000000
          train.host_memory_gib=1000000)
run e2e_hostcpu_b2 330 "${train[@]}" h200-e2e data.seq_len=32768 data.batch_size=2 \
  train.steps=3 "${HOST_CPU[@]}" "${nc[@]}" --run-dir /tmp/r-b2; keep /tmp/r-b2 e2e_hostcpu_b2
run e2e_auto_427790 420 "${train[@]}" h200-e2e data.seq_len=427790 train.steps=3 "${nc[@]}" \
  --run-dir /tmp/r-e2e-428k; keep /tmp/r-e2e-428k e2e_auto_427790
run check_off_665580 130 python3 -m peakflat_jax.cli plan h200-1 "${ALL_OFF[@]}" \
  data.seq_len=665580 train.device_memory_gib=1000000 --check
echo "=== all done $(date -Is)"
