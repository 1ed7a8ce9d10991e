#!/usr/bin/env bash
# The next session's GPU runs, as the stages of one detached driver on nvidia-h200 (~25 min),
# most decisive first, each with its own limit; logs and records under $LOGS as they go.
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (carry [".gpu", ".whl"]): PEAKFLAT_COMMIT=<sha> bash .gpu/driver.sh start .gpu/stages.sh 540
#   calls 2.. (no carry, within 30 s of the last; a later call finds a fresh machine and the
#   driver gone), each returning as soon as the driver is done:
#     for i in $(seq 108); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done
#     bash /tmp/work/.gpu/driver.sh collect
#   then give_back at once. Check before the first call that what runs is what was tested
#   (git diff; sco.MadeInLoop.lead is 1: the 13:08 driver of 2026-12-02 ran a lead of 99).
#
# What each stage answers (the last driver's record: h200_session_gpu_20261202-130810.json):
#   on64k_fwd, on64k_bwd  issue 26: h200-1 all four on at 64K with each MoE layer's update made
#               inside the unrolled forward, tied (sco.MadeInLoop): copies in from layer l - 1's
#               start (under the backward's write-back also the update after its end); written
#               back as updated / under the backward;
#               profiled (host copies under compute: 129 and 205 ms of ~1335 untied); the first
#               with XLA's schedule dumped (untied: 335 of 406 copies before the first layer)
#   opt64k      issue 26: the streamed optimizer alone (EP, unrolled, tied), profiled: its step
#               minus the standard stack's is the exposure the issue bounds (<= 10% of ~1.3 s)
#   base64k     the standard stack (auto) at 64K in the same lease, for the ratios (1.582 s)
#   pinned_rss  issue 25: what the machine loses beside 100 GiB of pinned arrays (MemAvailable
#               against VmRSS): h200-e2e's planned largest, 427,790, was killed with 123.0 GiB
#               resident of a 124.0 plan
#   e2e_auto_262144  issue 27: ours at 256K with the tied update (37.16 s untied)
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
for f in /tmp/dump-on64k/*overlapped*before_optimizations.txt; do
  gzip -c "$f" > "/tmp/pick-on64k/$(basename "$f").gz"; done
tar -czf "$LOGS/dump-on64k.tgz" -C /tmp pick-on64k; rm -rf /tmp/dump-on64k
run on64k_bwd 240 "${train[@]}" h200-1 train.steps=5 "${ALL_ON[@]}" \
  operators.optimizer_writeback=backward train.profile_steps=2 "${nc[@]}" --run-dir /tmp/r-on-bwd
keep /tmp/r-on-bwd on64k_bwd; cp /tmp/r-on-bwd/profile.json "$LOGS/on64k_bwd_profile.json" 2>/dev/null
run opt64k 240 "${train[@]}" h200-1 train.steps=5 "${ALL_OFF[@]}" operators.optimizer_offload=true \
  operators.layer_loop=unrolled train.profile_steps=2 "${nc[@]}" --run-dir /tmp/r-opt
keep /tmp/r-opt opt64k; cp /tmp/r-opt/profile.json "$LOGS/opt64k_profile.json" 2>/dev/null
run base64k 160 "${train[@]}" h200-1 train.steps=5 "${nc[@]}" --run-dir /tmp/r-base64k
keep /tmp/r-base64k base64k
rm -rf /tmp/r-on-fwd /tmp/r-on-bwd /tmp/r-opt  # profiles: /tmp may be memory
grep -E "MemTotal|MemAvailable|Shmem:" /proc/meminfo > "$LOGS/meminfo_before_pinned.txt"; df -h /tmp >> "$LOGS/meminfo_before_pinned.txt"
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=110 run pinned_rss 200 bash -c 'python3 scripts/probes/probe_pinned_host_rss.py --gib 100 & p=$!
  while kill -0 $p 2>/dev/null; do echo "sample $(grep VmRSS /proc/$p/status | tr -s " ") $(grep MemAvailable /proc/meminfo | tr -s " ")"; sleep 2; done; wait $p'
run e2e_auto_262144 420 "${train[@]}" h200-e2e data.seq_len=262144 train.steps=3 "${nc[@]}" \
  --run-dir /tmp/r-e2e-256k; keep /tmp/r-e2e-256k e2e_auto_262144
echo "=== all done $(date -Is)"
