#!/usr/bin/env bash
# The GPU part of a session, as stages of one detached run on one GPU machine (each with its own
# time limit, the most decisive first, logs and records under $LOGS as they go). Run it through
# a detached driver that keeps the machine between calls; it expects the MaxText wheels in .whl/
# (scripts/maxtext/setup.sh download .whl).
#
#   STAGES="peer ours" bash scripts/gpu_session.sh      # default: every stage, in this order
#
# Stages:
#   peer        MaxText beside peakflat on h200-e2e (scripts/bench_end_to_end.py): MaxText with
#               its layer inputs and AdamW state offloaded and ours at 32K, that setting's
#               longest context, ours at it and at 4x it; the record is $LOGS/end_to_end.json
#   extra       MaxText's other settings (AdamW on the device, bf16 weights, its default) at
#               32K and 16K, ours at 64K
#   kernels     the kernels both lean on (scripts/maxtext/check_kernels.py), the donation check
#   determinism scripts/check_gradient_determinism.py: h200-1's gradient program and overlapped
#               step, the operators on, executed 16 times on the same inputs
#   determinism_sources  the same check at 8K with XLA's deterministic ops, then each operator
#               alone: which reduction differs from one execution to the next
#   depth       scripts/gpu/compile_depth.sh where it exists: compile time against depth
# DEADLINE_MIN bounds the bench's probes (none starts after it). OVERRIDES: config overrides of
# h200-e2e for both stacks (the peer's model follows ours), e.g. a cut model on a smaller card:
#   OVERRIDES="model.num_layers=6 device.memory_gib=75.2"   (an H100: 1 dense + 5 MoE layers)
set -uo pipefail
cd "$(dirname "$0")/.."
export PEAKFLAT_COMMIT="${PEAKFLAT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
LOGS="${LOGS:-/tmp/gpu-logs}"; mkdir -p "$LOGS"
STAGES="${STAGES:-peer determinism depth extra kernels}"
DEADLINE_MIN="${DEADLINE_MIN:-16}"
SITE=/tmp/maxtext-site
T0=$(date +%s)
left() { echo $(( DEADLINE_MIN * 60 - ($(date +%s) - T0) )); }
run() {  # run NAME LIMIT CMD...: the command's output in $LOGS/NAME.log, its end on stdout
  local name=$1 limit=$2; shift 2
  echo "=== $name start $(date -u +%T) (t=$(( $(date +%s) - T0 )) s)"
  timeout -k 20 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "=== $name rc=$? t=$(( $(date +%s) - T0 )) s"; tail -n 8 "$LOGS/$name.log"
}
bench() {  # bench NAME ARGS...: scripts/bench_end_to_end.py on h200-e2e, the one record
  local name=$1; shift
  local minutes=$(( $(left) / 60 ))
  (( minutes > 0 )) || { echo "=== $name skipped: past the deadline"; return; }
  local extra=(); for o in ${OVERRIDES:-}; do extra+=(--override "$o"); done
  run "$name" $(( minutes * 60 + 600 )) python3 scripts/bench_end_to_end.py --config h200-e2e \
    "${extra[@]}" \
    --out "$LOGS/end_to_end.json" --keep-logs "$LOGS/maxtext" --maxtext-site "$SITE" \
    --deadline-min "$minutes" --timeout 480 "$@"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  free -g | head -2; echo "commit $PEAKFLAT_COMMIT"; } | tee "$LOGS/machine.txt"

for stage in $STAGES; do case $stage in
  peer)
    run setup 180 bash scripts/maxtext/setup.sh install .whl "$SITE"
    # MaxText's setting that keeps fp32 weights (ours keeps an fp32 master) and its AdamW state
    # off the device, and ours, at 32K; then that setting's longest, ours beside it and at 4x.
    bench peer32k --stacks maxtext:offload+optimizer peakflat --at 32768 --steps 5
    # cuDNN's attention alone at long context: what bounds either stack's MFU there.
    run attention 120 python3 scripts/maxtext/check_kernels.py --attention-only \
      --attention-context 131072 --json "$LOGS/attention.json"
    start=$(python3 - "$LOGS/end_to_end.json" <<'EOF'
import json, sys
probes = json.load(open(sys.argv[1]))["probes"]
print(65536 if any(p["fits"] and p["context"] == 32768 and p["stack"].startswith("maxtext")
                   for p in probes) else 16384)
EOF
)
    best=maxtext:offload+optimizer
    bench peer_longest --longest "$best" --start "$start" --steps 3 --headroom 0.03
    # 4x theirs where a step there takes minutes, not tens of minutes (ours' steps grow with
    # the square of the context: 36 s at 262,144, 260 s at 741,848 on an H200).
    scales=$(python3 - "$LOGS/end_to_end.json" "$best" <<'EOF'
import json, sys
longest = json.load(open(sys.argv[1]))["longest"].get(sys.argv[2], {}).get("context") or 0
print("1 4" if 4 * longest <= 300_000 else "1")
EOF
)
    bench ours_at_theirs --stacks peakflat --at-longest-of "$best" --scales $scales --steps 3 ;;
  kernels)
    run kernels 150 env PYTHONPATH="$SITE" python3 scripts/maxtext/check_kernels.py \
      --json "$LOGS/kernels.json" --attention-context 131072
    run kernels_fusion 120 env XLA_FLAGS=--xla_gpu_experimental_use_ragged_dot_fusion=true \
      python3 scripts/maxtext/check_kernels.py --ragged-dot-fusion --json "$LOGS/kernels_fusion.json"
    run donation 120 python3 scripts/maxtext/donation_repro.py ;;
  extra)
    bench peer_extra --stacks maxtext:offload maxtext:offload+bf16 maxtext:default --at 32768 \
      --steps 5
    bench default16k --stacks maxtext:default --at 16384 --steps 5
    bench ours64k --stacks peakflat --at 65536 --steps 4 ;;
  determinism)
    run determinism 360 env XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="${DETERMINISM_POOL_GB:-100}" \
      python3 scripts/check_gradient_determinism.py h200-1 \
      ${DETERMINISM_OVERRIDES:-data.seq_len=32768} --executions 16 \
      --commit "$PEAKFLAT_COMMIT" --out "$LOGS/determinism.json" ;;
  determinism_sources)  # which reduction differs run to run: XLA's deterministic ops at 8K,
    # then each operator alone (the GPU's differences, docs/cpu_scheduler.md)
    run determinism_xla_deterministic 300 env XLA_FLAGS=--xla_gpu_deterministic_ops=true \
      XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="${DETERMINISM_POOL_GB:-100}" \
      python3 scripts/check_gradient_determinism.py h200-1 data.seq_len=8192 --executions 4 \
      --commit "$PEAKFLAT_COMMIT" --out "$LOGS/determinism_xla_deterministic.json"
    for only in operators.moe_dispatch=pipelined operators.loss=ring operators.offload=all; do
      run "determinism_${only%%=*}" 240 python3 scripts/check_gradient_determinism.py h200-1 \
        --no-default-overrides "$only" data.seq_len=8192 --executions 4 \
        --commit "$PEAKFLAT_COMMIT" --out "$LOGS/determinism_${only%%=*}.json"
    done ;;
  depth)  # DEPTH_TREE: another tree's compile_depth.sh (a branch's, carried in .gpu/)
    tree="${DEPTH_TREE:-.}"
    [[ -f "$tree/scripts/gpu/compile_depth.sh" ]] && LOGS="$LOGS" run depth 420 \
      bash "$tree/scripts/gpu/compile_depth.sh" ;;
  *) echo "unknown stage $stage" ;;
esac; done
echo "all done t=$(( $(date +%s) - T0 )) s"
