#!/usr/bin/env bash
# The GPU runs of a session, as the stages of one detached driver on nvidia-h200 (~22 min as
# estimated from the walls of 2026-12-03's driver; a lease is 30 min of device time with ~3 to
# start the machine), the decisive ones first, each with its own limit; logs and records under
# $LOGS as they go. The trainer adds its own XLA flags to any XLA_FLAGS a stage sets
# (cli.prepare_environment).
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (kind nvidia-h200, carry [".gpu", ".whl"], timeout_s 600):
#     PEAKFLAT_COMMIT=<sha> bash .gpu/driver.sh start .gpu/stages.sh 0 >/dev/null; \
#     for i in $(seq 110); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done; \
#     bash .gpu/driver.sh collect
#   calls 2, 3 (no carry, AT ONCE: the machine is gone 30 s after a call returns, and the
#   driver with it; 2026-12-03 lost e2e_8x's last two steps that way):
#     for i in $(seq 110); do grep -q "all done" /tmp/gpu-logs/driver.log && break; sleep 5; done; \
#     bash /tmp/work/.gpu/driver.sh collect
#   then give_back at once and write the record with scripts/record_gpu_session.py. A helper
#   must not call the device tool: its time is the session's.
#
# A stage that lifts the device check (train.device_memory_gib) pins optimizer.resident_groups:
# left null, the planner would keep every group on a device it believes is 1 PB.
#
# What each stage answers:
#   dump698k     issue 25: all four on at 698,002 (K = 0), compiled only, its buffer assignment
#                dumped: XLA was 124.15 GiB on 2026-12-03 with 25 GiB of MoE loop zeros made
#                before the first layer; pipelined_moe._zeros_after removes them (not measured)
#   e2e_8x       issue 27: h200-e2e at 540,672 tokens (8.02x the host-CPU placement's planned
#                longest, 67,414), auto's choice at 506,628 held, 3 steps (on 2026-12-03 it
#                compiled at 104.09 GiB and ran 1 step of 141.6 s before the lease was lost)
#   hostcpu_probe issue 27: the host-CPU AdamW's rate on the 16-core host, chunked (all cores)
#                against the previous program (scripts/probes/probe_host_adamw.py)
#   hostcpu64k   issue 27: h200-e2e's standard stack with AdamW on the host CPU at 65,536
#                (44.2 s a step on 2026-12-02, ~43 s of it the update, host 124.62 GiB resident),
#                now chunked; both checks lifted (its host plan, 125.4 GiB, is past the 124.8
#                the machine has at the start, where the same run held 124.62)
#   auto64k      issue 27's ratio in the same lease: ours (auto) at 65,536 (3.140 s, 2026-12-02)
#   on64k_autoK  issue 26: h200-1 at 64K, all four forced on, the resident groups left to the
#                planner (it keeps all 8: 1.706 s measured with K = 8 set by hand; the standard
#                stack 1.602 s on 2026-12-03)
#   on512k_autoK issues 25/26: the same at 524,288, where the planner's count (4 of 8) fills
#                the device to 128.35 of 132.8 GiB planned: does it fit, and how fast
#   pgle_*       issue 26: XLA's latency-hiding scheduler given a measured profile of the step
#                (jax's AOT compile takes no PGLE: the profile goes in by XLA flag), K = 0
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
# 1. The MoE loop zeros at 698,002 (compiled only).
rm -rf /tmp/xla-dump
XLA_FLAGS="--xla_dump_to=/tmp/xla-dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=overlapped" \
  run dump698k 240 "${plan[@]}" h200-1 data.seq_len=698002 "${ALL_ON[@]}" \
  optimizer.resident_groups=0 "${unbounded[@]}" --check
(cd /tmp/xla-dump && tar -czf "$LOGS/xla_dump_h200-1_on698k.tgz" \
  $(ls | grep -E "overlapped.*after_optimizations-(live-range|buffer-assignment)\.txt" | head -2)) 2>/dev/null
rm -rf /tmp/xla-dump
# 2. h200-e2e at 540,672, 3 steps, the host sampled each second.
sample() { while sleep 1; do p=$(pgrep -f "^python3 -m peakflat_jax.cli train h200-e2e" | head -1)
  echo "$(date +%s) $(grep -h -E 'VmRSS|VmHWM' /proc/$p/status 2>/dev/null | tr -s ' ' | tr '\n' ' ') $(grep MemAvailable /proc/meminfo | tr -s ' ')"
  done > "$LOGS/e2e_8x_mem.log"; }
sample & sampler=$!
run e2e_8x 720 "${train[@]}" h200-e2e data.seq_len=540672 operators.moe_dispatch=pipelined \
  operators.token_budget=56292 operators.loss=ring operators.offload=none \
  operators.optimizer_offload=true optimizer.resident_groups=0 operators.layer_loop=scan \
  train.steps=3 train.device_memory_gib=1000000 "${nc[@]}" --run-dir /tmp/r3
kill $sampler
python3 scripts/host_samples.py "$LOGS/e2e_8x_mem.log" > "$LOGS/e2e_8x_host.json" 2>&1
keep /tmp/r3 e2e_8x
# 3. The host-CPU AdamW: its rate, then the standard stack's step with it, then ours beside it.
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 run hostcpu_probe 150 python3 \
  scripts/probes/probe_host_adamw.py --sizes 1.1e8 --leaf 5.5e7 --cols 1536 --dtypes bfloat16 \
  --repeats 5 --machine "H200 host" --out-dir "$LOGS"
run hostcpu64k 330 "${train[@]}" h200-e2e data.seq_len=65536 "${ALL_OFF[@]}" \
  optimizer.update_on=host_cpu "${unbounded[@]}" train.steps=3 "${nc[@]}" \
  --run-dir /tmp/r2
keep /tmp/r2 hostcpu64k
run auto64k 240 "${train[@]}" h200-e2e data.seq_len=65536 train.steps=3 "${nc[@]}" \
  --run-dir /tmp/r2
keep /tmp/r2 auto64k
# 4. h200-1 at 64K: all four forced on with the planner's resident groups, and the standard stack.
run on64k_autoK 200 "${train[@]}" h200-1 "${ALL_ON[@]}" "${sixty4[@]}" --run-dir /tmp/r1
keep /tmp/r1 on64k_autoK
# Where the count stops at the device's edge (the plan keeps 4 of 8 at 128.35 of 132.8 GiB):
# nothing bounds the resident updates' temporaries yet, so this is the check that the count
# the planner fills the device with fits.
run on512k_autoK 300 "${train[@]}" h200-1 "${ALL_ON[@]}" data.seq_len=524288 train.steps=3 \
  "${nc[@]}" --run-dir /tmp/r1
keep /tmp/r1 on512k_autoK
# 5. PGLE by hand: a profiled run's trace to XLA's profile proto, then the same run compiled with it.
bwd=(h200-1 "${ALL_ON[@]}" operators.layer_loop=unrolled operators.optimizer_writeback=backward
     optimizer.resident_groups=0)
run pgle_profiled 200 "${train[@]}" "${bwd[@]}" "${sixty4[@]}" --run-dir /tmp/r4
python3 -c "
import glob, sys
from jax.experimental.profiler import get_profiled_instructions_proto
runs = sorted(glob.glob('/tmp/r4/profile/plugins/profile/*/'))
if not runs:
    sys.exit('no trace under /tmp/r4/profile/plugins/profile/')
proto = get_profiled_instructions_proto(runs[-1])
if not proto:
    sys.exit('the profile proto is empty')
open('$LOGS/pgle_profile.pb', 'wb').write(proto)
print('profile proto', len(proto), 'bytes from', runs[-1])" > "$LOGS/pgle_proto.log" 2>&1 \
  && echo "=== pgle_proto ok" || echo "=== pgle_proto failed: $(tail -1 "$LOGS/pgle_proto.log")"
keep /tmp/r4 pgle_profiled
if [ -s "$LOGS/pgle_profile.pb" ]; then
  XLA_FLAGS="--xla_gpu_pgle_profile_file_or_directory_path=$LOGS/pgle_profile.pb" \
    run pgle_used 200 "${train[@]}" "${bwd[@]}" "${sixty4[@]}" --run-dir /tmp/r4
  keep /tmp/r4 pgle_used
fi
echo "=== all done $(date -Is)"
