#!/usr/bin/env bash
# The next session's GPU runs, as the stages of one detached driver on nvidia-h200 (~26 min;
# the last stage may not finish), most decisive first, each with its own limit; logs and
# records under $LOGS as they go.
#
#   cp ../shared/gpu/driver.sh .gpu/ && cp scripts/gpu_session.sh .gpu/stages.sh  (wheels: .whl/)
#   call 1 (carry [".gpu", ".whl"]): bash .gpu/driver.sh start .gpu/stages.sh 555
#   calls 2.. (no carry, within 30 s): poll for "all done" in /tmp/gpu-logs/driver.log, then
#     bash /tmp/work/.gpu/driver.sh collect
#
# What each stage answers (the previous driver's records: h200_1_session_gpu_20261201-162217.json):
#   compile_*   issue 24's last check, like for like this time (operators auto resolved all off
#               at 8 layers and all on, unrolled, at 32 in the last driver): the gradient program
#               at 8 and 32 layers with the same operators, scanned, all on and all off
#   prof_on / prof_opt   issue 26: all four on (unrolled) and the streamed optimizer alone with
#               train.profile_steps=2: profile.json says how much of the host copies ran under
#               compute (the step is 2.87 / 2.81 s against 1.60: is the link idle or serial?)
#   dump_*      issue 25: XLA's GPU live ranges (its own sweep names the buffers live at the
#               peak, by op_name: *-live-range.txt) and buffer assignment: the overlapped step at
#               64K (a lower dense-FFN term took the plan under it) and all off at 256K (plan
#               1.38x: the dense FFN's fp32 term is 3x what XLA keeps)
#   host_adamw  the host-CPU AdamW's rate on the GPU host (the plan's default is the dev CPU's)
#   e2e_*       issue 27: h200-e2e's standard stack with its AdamW on the host CPU at 32K
#               (ZeRO-Offload's placement: optimizer.update_on=host_cpu), with it on the device
#               at 20K and 22K (its longest: 20K fits, 24K does not), and ours at 128K and 256K
#               (auto), 3 steps each
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
ALL_ON=(operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all
        operators.optimizer_offload=true)
ALL_OFF=(operators.moe_dispatch=ep operators.loss=materialized operators.offload=none
         operators.optimizer_offload=false)
for layers in 8 32; do
  run compile_on_l$layers 240 python3 scripts/bench_compile.py h200-1 model.num_layers=$layers \
    "${ALL_ON[@]}" operators.layer_loop=scan --out-dir "$LOGS"
  run compile_off_l$layers 200 python3 scripts/bench_compile.py h200-1 model.num_layers=$layers \
    "${ALL_OFF[@]}" operators.layer_loop=scan --out-dir "$LOGS"
done
run prof_on 240 "${train[@]}" h200-1 train.steps=5 "${ON[@]}" train.profile_steps=2 "${nc[@]}" \
  --run-dir /tmp/r-on; keep /tmp/r-on prof_on; cp /tmp/r-on/profile.json "$LOGS/prof_on_profile.json"
run prof_opt 240 "${train[@]}" h200-1 train.steps=5 operators.optimizer_offload=true \
  train.profile_steps=2 "${nc[@]}" --run-dir /tmp/r-opt; keep /tmp/r-opt prof_opt
cp /tmp/r-opt/profile.json "$LOGS/prof_opt_profile.json"
unset PEAKFLAT_JAX_CACHE
dump() {  # dump NAME MODULE_RE OVERRIDES...: plan --check with XLA's GPU dumps kept: the live
  # ranges (XLA's own sweep: the buffers live at the peak, by op_name), the buffer assignment and
  # the memory report, compressed
  local name=$1 module=$2; shift 2; rm -rf "/tmp/dump-$name"
  XLA_FLAGS="--xla_dump_to=/tmp/dump-$name --xla_dump_hlo_as_text --xla_dump_hlo_module_re=$module" \
    run "dump_$name" 200 python3 -m peakflat_jax.cli plan h200-1 "$@" --check
  mkdir -p "/tmp/pick-$name" && for f in /tmp/dump-$name/*after_optimizations-live-range.txt \
      /tmp/dump-$name/*after_optimizations-memory-usage-report.txt; do cp "$f" "/tmp/pick-$name/"; done
  for f in /tmp/dump-$name/*after_optimizations-buffer-assignment.txt; do
    head -c 20000000 "$f" > "/tmp/pick-$name/$(basename "$f")"; done
  tar -czf "$LOGS/dump-$name.tgz" -C /tmp "pick-$name"
}
dump on64k overlapped "${ON[@]}"
dump off256k train_step data.seq_len=262144 "${ALL_OFF[@]}" train.device_memory_gib=1000 \
  --device-memory 1000
run host_adamw 200 python3 scripts/probes/probe_host_adamw.py --sizes 1.6e7,2.56e8 \
  --machine "nvidia-h200's host (16 cores)" --out-dir "$LOGS"
export PEAKFLAT_JAX_CACHE=/tmp/cache
# ZeRO-Offload's placement for the standard stack where its AdamW does not fit the device.
run e2e_hostcpu_32768 300 "${train[@]}" h200-e2e data.seq_len=32768 train.steps=3 \
  "${ALL_OFF[@]}" optimizer.update_on=host_cpu train.device_memory_gib=1000000 "${nc[@]}" \
  --run-dir /tmp/r-e2e-hostcpu; keep /tmp/r-e2e-hostcpu e2e_hostcpu_32768
for n in 20480 22528; do
  run e2e_off_$n 200 "${train[@]}" h200-e2e data.seq_len=$n train.steps=3 "${ALL_OFF[@]}" \
    train.device_memory_gib=1000000 "${nc[@]}" --run-dir /tmp/r-e2e-off-$n
  keep /tmp/r-e2e-off-$n e2e_off_$n
done
for n in 131072 262144; do
  run e2e_auto_$n 420 "${train[@]}" h200-e2e data.seq_len=$n train.steps=3 "${nc[@]}" \
    --run-dir /tmp/r-e2e-auto-$n; keep /tmp/r-e2e-auto-$n e2e_auto_$n
done
echo "=== all done $(date -Is)"
