#!/usr/bin/env bash
# The next session's GPU runs, as the stages of one detached driver on nvidia-h200 (~16 min),
# most decisive first, each with its own limit; logs and records under $LOGS as they go.
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (carry [".gpu", ".whl"], timeout_s 600):
#     PEAKFLAT_COMMIT=<sha> bash .gpu/driver.sh start .gpu/stages.sh 0 >/dev/null; \
#     for i in $(seq 110); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done; \
#     bash .gpu/driver.sh collect
#   call 2 (no carry, within 30 s of call 1's end: after that the machine and the driver are
#   gone; the stages take ~15 min, so call 1 runs out first):
#     for i in $(seq 110); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done; \
#     bash /tmp/work/.gpu/driver.sh collect
#   then give_back at once and write the record with scripts/record_gpu_session.py. A helper
#   must not call the device tool: its time is the session's.
#
# What each stage answers (the last drivers' records: h200_session_gpu_20261202-162728.json and
# -164706.json; the trainer now keeps 8 host copies in flight, cli.GPU_HOST_COPIES_FLAG):
#   link        the host link each way and both at once, now with 8 copies in flight (at 16:47,
#               with XLA's 2: 54.5 / 54.4 / 59.5 GB/s, which cannot tell a shared link from
#               copies run one after another)
#   on64k_fwd   issue 26: h200-1 all four on at 64K, written back as updated (the default), at 8
#               in flight (2.903 s at 2), profiled: profile.json's host_copies_exposed says which
#               ops the exposed copies held back
#   on64k_bwd   the same written back under the backward (2.467 s at 8): where its ~0.6 s over
#               the link's floor waits
#   base64k     the standard stack (auto) at 64K, for the ratios of this lease
#   on517k      issue 26: all four on at the standard stack's largest context (517,600; as
#               updated: under the backward does not fit), 3 steps (the 16:47 lease ended
#               after its first: XLA's plan 103.45 GiB)
#   base517k    the standard stack there, in the same lease (27.3 s a step at 13:08)
#   pinned_rss  issue 25: what the machine loses beside 100 GiB of pinned arrays (MemAvailable
#               against VmRSS, sampled): h200-e2e's planned largest, 427,790, was killed with
#               123.0 GiB resident of a 124.0 plan on a host of 125.85
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
         cp "$1/metrics.jsonl" "$LOGS/$2_metrics.jsonl" 2>/dev/null
         cp "$1/profile.json" "$LOGS/$2_profile.json" 2>/dev/null; rm -rf "$1"; }
nc=(train.checkpoints=false --no-progress --overwrite)
train=(python3 -m peakflat_jax.cli train)  # timeout runs programs, not shell functions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
export PEAKFLAT_JAX_CACHE=/tmp/cache
ALL_OFF=(operators.moe_dispatch=ep operators.loss=materialized operators.offload=none
         operators.optimizer_offload=false)
ALL_ON=(operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all
        operators.optimizer_offload=true operators.layer_loop=unrolled)
run link 90 python3 scripts/probes/probe_host_link.py --gib 4 --pieces 8
run on64k_fwd 260 "${train[@]}" h200-1 train.steps=5 "${ALL_ON[@]}" train.profile_steps=2 \
  "${nc[@]}" --run-dir /tmp/r1
keep /tmp/r1 on64k_fwd
run on64k_bwd 200 "${train[@]}" h200-1 train.steps=5 "${ALL_ON[@]}" \
  operators.optimizer_writeback=backward train.profile_steps=2 "${nc[@]}" --run-dir /tmp/r2
keep /tmp/r2 on64k_bwd
run base64k 120 "${train[@]}" h200-1 train.steps=5 "${nc[@]}" --run-dir /tmp/r3
keep /tmp/r3 base64k
run on517k 330 "${train[@]}" h200-1 data.seq_len=517600 train.steps=3 "${ALL_ON[@]}" "${nc[@]}" \
  --run-dir /tmp/r4
keep /tmp/r4 on517k
run base517k 240 "${train[@]}" h200-1 data.seq_len=517600 train.steps=3 "${ALL_OFF[@]}" \
  "${nc[@]}" --run-dir /tmp/r5
keep /tmp/r5 base517k
grep -E "MemTotal|MemAvailable|Shmem:" /proc/meminfo > "$LOGS/meminfo_before_pinned.txt"
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=110 run pinned_rss 200 bash -c 'python3 scripts/probes/probe_pinned_host_rss.py --gib 100 & p=$!
  while kill -0 $p 2>/dev/null; do echo "sample $(grep VmRSS /proc/$p/status | tr -s " ") $(grep MemAvailable /proc/meminfo | tr -s " ")"; sleep 2; done; wait $p'
echo "=== all done $(date -Is)"
