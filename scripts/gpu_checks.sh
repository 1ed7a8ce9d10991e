#!/usr/bin/env bash
# The GPU checks and benchmarks (done ones kept for re-runs), grouped by the machine each needs
# and sized to one device call (at most 10 minutes). Run from the repository root there:
#
#   bash scripts/gpu_checks.sh h200-smoke      # nvidia-h200: cuDNN attention against XLA's, then
#                                              #   `peakflat train tiny` in bf16 on one GPU
#                                              #   (synthetic, packed corpus, all operators off)
#   bash scripts/gpu_checks.sh h200-train [STEPS]  # nvidia-h200: `peakflat train h200-1` (issue 14),
#                                              #   then its step with the optimizer overlapped,
#                                              #   after the backward and removed (issue 20)
#   bash scripts/gpu_checks.sh h200-compile    # nvidia-h200: h200-1's compile cold, from the
#                                              #   cache, with another step count; 8 and 32
#                                              #   layers compiled alone; SCO scanned and unrolled
#   bash scripts/gpu_checks.sh h200-plan       # nvidia-h200: plan --check of h200-1 on and off,
#                                              #   XLA's GPU buffer assignment at 3 layers
#   bash scripts/gpu_checks.sh h200-xcheck     # nvidia-h200: h200-1 (2 layers) against PyTorch
#   bash scripts/gpu_checks.sh h200-sco        # nvidia-h200: SCO, half and all boundaries offloaded
#   bash scripts/gpu_checks.sh h200-sco-plan   # nvidia-h200: XLA's buffer plan of SCO's step
#                                              #   (compile only: what the temporaries hold)
#   bash scripts/gpu_checks.sh h200-kernels    # nvidia-h200: the Mosaic probe (forward blocks)
#   bash scripts/gpu_checks.sh h200-adamw      # nvidia-h200: OffloadStreamAdamW baselines,
#                                              #   buckets of 5e8 and 3 slots
#   bash scripts/gpu_checks.sh x2-moe [TEXT...]  # nvidia-h200-x2: the MoE cases (one per
#                                              #   method and token count, timed on all five
#                                              #   profiles) whose JSON holds any TEXT
#                                              #   (default: 65,536 tokens)
#   bash scripts/gpu_checks.sh x2-moe-profile  # nvidia-h200-x2: every method at 32,768 tokens,
#                                              #   traced on the first profile (trace + HLO kept
#                                              #   in $OUT)
#   bash scripts/gpu_checks.sh x2-ragged       # nvidia-h200-x2: the ragged-exchange probe
#   bash scripts/gpu_checks.sh x8-ring         # nvidia-h200-x8: Ring-DTP at P = 8 (issue 6)
#   bash scripts/gpu_checks.sh x8-moe [TEXT...]  # nvidia-h200-x8: PipelinedLLEP at E_p = 8, the
#                                              #   cases whose JSON holds any TEXT (default: all)
#   bash scripts/gpu_checks.sh x8-adamw        # nvidia-h200-x8: 8 AdamW streams sharing the host
#
# Records go to $OUT when set (the device tool's output folder), else scripts/results.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export PEAKFLAT_COMMIT="${PEAKFLAT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
out="${OUT:-scripts/results}"

# Packages the GPU image lacks travel as wheels in .whl (see the device notes in docs/).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=".:/tmp/site"
fi

case "${1:-}" in
  h200-smoke)
    timeout 120 python3 scripts/check_attention.py --out-dir "$out"
    common=(model.dtype=bfloat16 mesh.data=1 mesh.seq=-1 train.steps=20 train.progress=false)
    off=(operators.moe_dispatch=ep operators.loss=materialized operators.offload=none
         operators.optimizer_offload=false)
    for run in synthetic corpus off; do
      case $run in
        synthetic) extra=(data.source=synthetic) ;;
        corpus) extra=() ;;
        off) extra=("${off[@]}") ;;
      esac
      timeout 150 python3 -m peakflat_jax.cli train tiny "${common[@]}" "${extra[@]}" \
        --run-dir "/tmp/smoke-$run" --overwrite
      cp "/tmp/smoke-$run/summary.json" "$out/smoke-$run-summary.json" 2>/dev/null
    done ;;
  h200-train)
    # No checkpoints: one is ~41 GB, and this run measures, it is never resumed.
    timeout 330 python3 -m peakflat_jax.cli train h200-1 "train.steps=${2:-100}" \
      train.checkpoints=false --run-dir /tmp/h200-1 --overwrite
    cp /tmp/h200-1/summary.json "$out/h200-1-summary.json"
    cp /tmp/h200-1/metrics.jsonl "$out/h200-1-metrics.jsonl"
    timeout 250 python3 -m peakflat_jax.cli bench train_step --preset gpu \
      --only '"config": "h200-1", "overrides": [],' --out-dir "$out" ;;
  h200-compile)
    # Issue 24: a cold compile, a second process from the persistent cache, a third with
    # another step count (no recompile), compile at 8 and 32 layers, SCO's scanned overlap.
    export PEAKFLAT_JAX_CACHE=/tmp/peakflat-cache
    for run in cold warm steps; do
      steps=6; [ "$run" = steps ] && steps=9
      start=$(date +%s.%N)
      timeout 420 python3 -m peakflat_jax.cli train h200-1 "train.steps=$steps" \
        train.checkpoints=false --no-progress --run-dir "/tmp/h200-1-$run" --overwrite \
        | while IFS= read -r line; do
            echo "$(awk -v s="$start" -v t="$(date +%s.%N)" 'BEGIN{printf "%7.1f", t-s}') $line"
          done
      cp "/tmp/h200-1-$run/summary.json" "$out/h200-1-$run-summary.json"
    done
    unset PEAKFLAT_JAX_CACHE
    for layers in 8 32; do
      timeout 300 python3 scripts/bench_compile.py h200-1 "model.num_layers=$layers" \
        --out-dir "$out"
    done
    timeout 480 python3 -m peakflat_jax.cli bench sco --preset gpu --out-dir "$out" ;;
  h200-plan)
    # Issue 25: the closed form against XLA's GPU plan of what the trainer compiles (no step
    # runs), operators on and all off; then the gradient program at 3 layers compiled with XLA's
    # buffer assignment dumped (what the GPU's extra temporaries are), tarred into $out.
    for variant in on off; do
      extra=(); [ "$variant" = off ] && extra=(operators.moe_dispatch=ep operators.loss=materialized
                                              operators.offload=none operators.optimizer_offload=false)
      timeout 420 python3 -m peakflat_jax.cli plan h200-1 "${extra[@]}" --check \
        > "$out/plan_check_h200-1_$variant.txt" 2>&1
      tail -8 "$out/plan_check_h200-1_$variant.txt"
    done
    rm -rf /tmp/xla-dump
    XLA_FLAGS="--xla_dump_to=/tmp/xla-dump --xla_dump_hlo_as_text" timeout 300 \
      python3 scripts/bench_compile.py h200-1 model.num_layers=3 --out-dir "$out"
    tar -czf "$out/xla_dump_h200-1_L3.tgz" -C /tmp/xla-dump \
      $(cd /tmp/xla-dump && ls | grep -E "buffer-assignment|memory-usage-report" | head -40) ;;
  h200-xcheck)
    # Issue 30: h200-1's model (2 layers, 2,048 tokens) against the PyTorch side, on the GPU.
    timeout 420 python3 -m peakflat_jax.cli xcheck run --record-dir "$out" --config h200-1 \
      model.num_layers=2 data.seq_len=2048 ;;
  h200-sco)
    # The scan as the same-run baseline, then half and all boundaries offloaded (~2 min a case).
    timeout 560 python3 scripts/bench_sco.py --preset gpu --repeats 2 --only '"offload": 24' \
      --only '"offload": 12' \
      --only scan --out-dir "$out" ;;
  h200-sco-plan)
    timeout 300 python3 scripts/probes/probe_sco_plan.py --offload 24 12 --min-gb 0.5 \
      --out-dir "$out" ;;
  h200-kernels)
    timeout 300 python3 scripts/probes/probe_grouped_matmul.py --out-dir "$out" ;;
  h200-adamw)
    timeout 560 python3 scripts/bench_offload_adamw.py --preset gpu --only '"method": "link"' \
      --only whole_state --only host_cpu --only '"bucket_params": 500000000' \
      --only '"slots": 3' --out-dir "$out" ;;
  x2-moe)
    shift
    only=()
    for text in "${@:-\"tokens\": 65536}"; do only+=(--only "$text"); done
    timeout 560 python3 scripts/bench_moe_dispatch.py --preset gpu "${only[@]}" --out-dir "$out" ;;
  x2-moe-profile)
    prefix='"tokens": 32768, "profiles": [[0.0, 0], [0.95, 16], [0.8, 16], [0.5, 4], [0.3, 16]],'
    PEAKFLAT_ARTIFACTS="$out" timeout 560 python3 scripts/bench_moe_dispatch.py --preset gpu \
      --trace-steps 1 --only "$prefix" --out-dir "$out" ;;
  x2-ragged)
    timeout 300 python3 scripts/probes/probe_ragged_exchange.py --out-dir "$out" ;;
  x8-ring)
    timeout 560 python3 scripts/bench_ring_dtp.py --preset gpu-x8 --out-dir "$out" ;;
  x8-moe)
    shift
    only=()
    for text in "${@:-\"tokens\": 65536}"; do only+=(--only "$text"); done
    timeout 560 python3 scripts/bench_moe_dispatch.py --preset gpu-x8 "${only[@]}" \
      --out-dir "$out" ;;
  x8-adamw)
    timeout 560 python3 scripts/bench_offload_adamw.py --preset gpu-x8 --out-dir "$out" ;;
  *)
    echo "usage: bash scripts/gpu_checks.sh h200-sco | h200-sco-plan | h200-kernels |" \
      "h200-adamw |" \
      "x2-moe [TEXT...] | x2-moe-profile | x2-ragged | x8-ring | x8-moe [TEXT...] | x8-adamw" >&2
    exit 2 ;;
esac
