#!/usr/bin/env bash
# h200-1's compile against its depth with the optimizer streamed and overlapped, the scanned
# stack (each MoE layer's update made in the loop iteration before it, sco.MadeInScan) against
# the unrolled one; and the step at 8 layers. One H200 lease, ~5 minutes for the first three
# stages; the fourth (the unrolled stack's compile at 32 layers, ~4 minutes alone) runs only
# with FULL=1. Each stage has its own timeout; each writes one JSON line to
# $LOGS/compile_depth.jsonl, its log to $LOGS/<stage>.log.
#
#   LOGS=/tmp/gpu-logs bash scripts/gpu/compile_depth.sh          (from the repository root)
#
# CONFIG (default h200-1) and EXTRA (more overrides) let the same stages run elsewhere: on a CPU,
# CONFIG=tiny is a dry run of the script.
#
# The operators are forced on and every optimizer group streamed (optimizer.resident_groups=0:
# left to the planner, h200-1 at 8 layers keeps all 8 groups on the device and streams
# nothing). At 32 layers the streamed state (~150 GB) is more than the host holds, so that
# depth is compiled from the abstract state (scripts/bench_overlapped_compile.py), not trained.
# The persistent compilation cache is off (PEAKFLAT_JAX_CACHE empty): every compile is cold.
#
#   stage            what                                                   expected wall
#   train8_scan      4 steps at 8 layers, scanned: compile and median step  ~110 s
#   compile32_scan   the overlapped step at 32 layers, scanned, compile only ~60 s
#   train8_unrolled  4 steps at 8 layers, unrolled (today's auto)            ~140 s
#   compile32_unrolled (FULL=1) the same at 32 layers, unrolled               ~240 s
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1 PEAKFLAT_JAX_CACHE=
# XLA's own pinned-host pool limit for both loops: the trainer's planned cap is made from one
# array per bucket (plan.host_pool), the scanned stack's state arrays hold a block's layers each.
export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=64
export PEAKFLAT_COMMIT="${PEAKFLAT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
LOGS="${LOGS:-/tmp/gpu-logs}"; mkdir -p "$LOGS"
OUT="$LOGS/compile_depth.jsonl"
CONFIG="${CONFIG:-h200-1}"
# shellcheck disable=SC2206
on=(operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all
    operators.optimizer_offload=true optimizer.resident_groups=0 ${EXTRA:-})
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  | tee "$LOGS/gpu.txt"

stage() {  # stage NAME LIMIT CMD...: the command under its timeout, its output in NAME.log
  local name=$1 limit=$2; shift 2
  local started; started=$(date +%s)
  echo "=== $name start $(date -Is)"
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc wall=$(( $(date +%s) - started )) s"
  tail -n 4 "$LOGS/$name.log"
  STAGE_RC=$rc; STAGE_WALL=$(( $(date +%s) - started ))
}

train8() {  # train8 LOOP: 4 steps of h200-1 at 8 layers, one JSON line from its summary.json
  local loop=$1 dir=/tmp/compile_depth_$1
  stage "train8_$loop" 240 python3 -m peakflat_jax.cli train "$CONFIG" "${on[@]}" \
    operators.layer_loop="$loop" model.num_layers=8 train.steps=4 train.checkpoints=false \
    --no-progress --overwrite --run-dir "$dir"
  python3 - "$dir/summary.json" "$loop" "$STAGE_RC" "$STAGE_WALL" "$LOGS/train8_$loop.log" \
    >> "$OUT" <<'PY'
import json, os, sys
path, loop, rc, wall, log = sys.argv[1:]
summary = json.load(open(path)) if os.path.exists(path) else {}
print(json.dumps({
    "stage": f"train8_{loop}", "layer_loop": loop, "num_layers": 8, "rc": int(rc),
    "wall_seconds": int(wall), "commit": os.environ["PEAKFLAT_COMMIT"],
    "device": summary.get("device_kind"),
    "compile_seconds": summary.get("compile_seconds"),
    "median_step_seconds": summary.get("median_step_seconds"),
    "losses": summary.get("losses"), "peak_device_bytes": summary.get("peak_device_bytes"),
    "xla_plan_bytes": summary.get("xla_plan_bytes"), "host_peak_bytes": summary.get("host_peak_bytes"),
    "startup_seconds": summary.get("startup_seconds"), "failed": summary.get("failed"),
    "log_tail": open(log).read()[-1500:] if int(rc) else None}))
PY
  rm -rf "$dir"
}

compile32() {  # compile32 LOOP LIMIT: the overlapped step at 32 layers from the abstract state
  local loop=$1 limit=$2
  stage "compile32_$loop" "$limit" python3 scripts/bench_overlapped_compile.py "$CONFIG" \
    "${on[@]}" operators.layer_loop="$loop" model.num_layers=32 --out "$OUT"
  if [ "$STAGE_RC" -ne 0 ]; then
    python3 -c "import json, sys; print(json.dumps({'stage': 'compile32_$loop', 'rc': $STAGE_RC, \
'wall_seconds': $STAGE_WALL, 'log_tail': open(sys.argv[1]).read()[-1500:]}))" \
      "$LOGS/compile32_$loop.log" >> "$OUT"
  fi
}

train8 scan
compile32 scan 150
train8 unrolled
if [ "${FULL:-0}" = 1 ]; then compile32 unrolled 330; fi

python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
by = {r.get("stage") or f"compile{r['num_layers']}_{r['layer_loop']}": r for r in rows}
def compile_of(row):
    if row is None or row.get("rc", 0):
        return None
    if "compile_seconds" in row and isinstance(row["compile_seconds"], dict):
        return sum(row["compile_seconds"].values())
    return row.get("lower_seconds", 0) + row.get("compile_seconds", 0)
for loop in ("scan", "unrolled"):
    at8, at32 = compile_of(by.get(f"train8_{loop}")), compile_of(by.get(f"compile32_{loop}"))
    step = (by.get(f"train8_{loop}") or {}).get("median_step_seconds")
    ratio = f"{at32 / at8:.2f}x" if at8 and at32 else "n/a"
    print(f"{loop:9s} compile at 8: {at8}, at 32: {at32} (32/8 {ratio}); median step at 8: {step}")
PY
echo "=== all done $(date -Is)"
