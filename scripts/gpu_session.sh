#!/usr/bin/env bash
# The GPU runs of a session, as the stages of one detached driver on nvidia-h200 (~22 min as
# estimated from the walls of 2026-12-03's drivers; a lease is 30 min of device time with ~3 to
# start the machine), the decisive ones first, each with its own limit; logs and records under
# $LOGS as they go. The trainer adds its own XLA flags to any XLA_FLAGS a stage sets
# (cli.prepare_environment).
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (kind nvidia-h200, carry [".gpu", ".whl"], timeout_s 600), ALONE in its batch;
#   needs_h200 true where a stage needs more than an H100's ~78 GiB (without it the kind may
#   give an H100: 2026-12-05 07:15 did, and h200-e2e at 741,848 was refused there):
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
# What each stage answers (the program of c29268e):
#   STAGES=h100 (nvidia-h100-x1; ran 2026-12-05 12:34, h100_session_gpu_20261205-123444.json)
#             emu443k, emu416k, emu262k, emu378k, emu430k: h200-1's standard stack compiled
#             with XLA:GPU's dumps of its step against the H200's scheduler limit (below)
#   STAGES=h100b (ran 2026-12-05 16:22, h100_session_gpu_20261205-162214.json): the same at 64K
#             with 64 segments, 128K and 621,208
#   default (nvidia-h200, needs_h200; ran 2026-12-05 17:26 in 336 s,
#   h200_session_gpu_20261205-172600.json):
#   on16k, off16k, opt16k, moe16k, loss16k, sco16k
#             issue 25's sweep at 16K on the H200: on the H100 machine the host plan, whose
#             runtime term is the H200 machine's, was 1.36-1.63x of each VmHWM; here
#             1.008-1.116x (~30-70 s each)
#   on16k_r0  the four on at 16K, every group streamed, compiled: 2026-12-01's 16K point was of
#             a program no longer built
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
three=(train.steps=3 "${nc[@]}")
on=(operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all
    operators.optimizer_offload=true)
off=(operators.moe_dispatch=ep operators.loss=materialized operators.offload=none
     operators.optimizer_offload=false)
dump_step() {  # dump_step NAME OVERRIDES...: plan --check of h200-1, the step's dumps kept
  local name=$1; shift; rm -rf "/tmp/dump-$name"
  XLA_FLAGS="--xla_dump_to=/tmp/dump-$name --xla_dump_hlo_as_text --xla_dump_hlo_module_re=train_step" \
    run "$name" 240 "${plan[@]}" h200-1 "$@" --check
  mkdir -p "/tmp/pick-$name" && cp /tmp/dump-$name/*after_optimizations-{live-range,memory-usage-report,buffer-assignment}.txt \
    "/tmp/pick-$name/" 2>/dev/null
  tar -czf "$LOGS/xla_dump_$name.tgz" -C /tmp "pick-$name"; rm -rf "/tmp/dump-$name" "/tmp/pick-$name"; }
# An H200's compile on an H100 (STAGES=h100): XLA:GPU's scheduler and rematerialization plan
# against GetSchedulerMemoryLimit (xla/service/gpu/gpu_hlo_schedule.cc), (the module's device
# memory - its arguments and outputs) x the slop factor, where the module's device memory is
# the allocator's limit. With the allocator's limit set to the H200's (132.8 GiB: the fraction
# of this card's memory that makes it; no preallocation, so nothing past the card is taken)
# the compile sees the H200's limit. The rest of the card (its bandwidth in the cost model, the
# autotuner's scratch on the real 80 GB) still enters; at 443,720, where the H200's limit does
# not bind, the compile matched the H200's own to 5 KB at its peak (docs/plan.md, the
# twentieth driver), and where it binds, at 621,208, the total matched the H200's to the MB.
emulate_h200() {
  local limit; limit=$(XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
    python3 -c "import jax; print(jax.devices()[0].memory_stats()['bytes_limit'])")
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(f'{132.8 * 2**30 * 0.95 / $limit:.6f}')")
  echo "=== this card's limit at 0.95: $limit B; the H200's 132.8 GiB at $XLA_PYTHON_CLIENT_MEM_FRACTION"
}
case "${STAGES:-h200}" in
  h100)   # issue 25: the standard stack's step at 262K-443K (ran 2026-12-05 12:34)
    emulate_h200
    for context in 443720 416768 262144 378176 430000; do
      dump_step "emu$((context / 1000))k" data.seq_len=$context "${off[@]}" "${unbounded[@]}"
    done
    echo "=== all done $(date -Is)"; exit 0 ;;
  h100b)  # after review: 64 segments, 128K, and 621,208, where the H200's limit binds (its
          # compile: 130.25 GiB)
    emulate_h200
    dump_step emu64k_seg64 data.seq_len=65536 data.max_segments=64 "${off[@]}" "${unbounded[@]}"
    dump_step emu128k data.seq_len=131072 "${off[@]}" "${unbounded[@]}"
    dump_step emu621k data.seq_len=621208 "${off[@]}" "${unbounded[@]}"
    echo "=== all done $(date -Is)"; exit 0 ;;
esac
run on16k 180 "${train[@]}" h200-1 data.seq_len=16384 "${on[@]}" "${three[@]}" --run-dir /tmp/r1
keep /tmp/r1 on16k
run off16k 150 "${train[@]}" h200-1 data.seq_len=16384 "${off[@]}" "${three[@]}" --run-dir /tmp/r1
keep /tmp/r1 off16k
run opt16k 150 "${train[@]}" h200-1 data.seq_len=16384 "${off[@]}" \
  operators.optimizer_offload=true "${three[@]}" --run-dir /tmp/r1
keep /tmp/r1 opt16k
run moe16k 150 "${train[@]}" h200-1 data.seq_len=16384 "${off[@]}" \
  operators.moe_dispatch=pipelined "${three[@]}" --run-dir /tmp/r1
keep /tmp/r1 moe16k
run loss16k 150 "${train[@]}" h200-1 data.seq_len=16384 "${off[@]}" operators.loss=ring \
  "${three[@]}" --run-dir /tmp/r1
keep /tmp/r1 loss16k
run sco16k 150 "${train[@]}" h200-1 data.seq_len=16384 "${off[@]}" operators.offload=all \
  "${three[@]}" --run-dir /tmp/r1
keep /tmp/r1 sco16k
run on16k_r0 150 "${plan[@]}" h200-1 data.seq_len=16384 "${on[@]}" operators.layer_loop=unrolled \
  optimizer.resident_groups=0 --check
echo "=== all done $(date -Is)"
