#!/usr/bin/env bash
# Every GPU check of this repository in one call, for a lent GPU machine (device tool), about 8 minutes:
#   1. benchmarks/causal_lm_gpu.py      the loss head's time and memory at 8,192 x 4,096 x 128,256 bf16 beside
#                                       Liger-Kernel, TRL, whole logits and the bare LM-head GEMM (issues #14, #29)
#      benchmarks/head_profile.py       (step head_profile, not in the default list) each part of the head timed
#                                       alone and a kernel table, to see where its time goes
#      benchmarks/llm_throughput_gpu.py (step llm_throughput, not in the default list) off-policy KD of a ~1B
#                                       student from a ~1B teacher vs student-only SFT, tokens/s (#32 item 5), with
#                                       a second KD run in kd_head_mode="fused" (#41 item 6: target KD/SFT <= 1.30)
#      benchmarks/head_modes_gpu.py     (step head_modes, in the default list) the sparse (top-k + tail) head at
#                                       k = 64 and 256 beside the dense head, Liger-Kernel and TRL, and the fused
#                                       mode beside the floor, time + peak + bf16 gradients vs float64 (#41 items 5-6;
#                                       `--tiny` checks it on a CPU)
#      head_modes_gpu.py --only-sweep   (step head_fused_sweep, not in the default list, ~90 s) the fused mode's token
#                                       chunk sweep (FUSED_CHUNKS, default 1024,2048,4096,8192): time, peak, bf16 vs
#                                       float64 and x the KD floor per chunk, and one step's kernel time by kind of
#                                       work (GEMM / row stats / gradient block / copies+casts+fills / other), into
#                                       head_fused_sweep.{md,json} (#41 item 6: <= 1.5x; decides FUSED_CHUNK_FACTOR)
#   2. benchmarks/kd_precision.py       bf16 gradients against float64 at 4,096 x 2,048 x 65,536 (issue #29)
#   3. the CUDA tests                   tests/test_mixed_precision.py, tests/test_chunked.py, test_sparse_head.py,
#                                       test_triton_sparse.py (the sparse head's kernels, #41 item 5) and
#                                       test_fused_grads.py (kd_head_mode="fused") and test_head_common.py (the
#                                       float32-output GEMMs written in place) on the GPU machine
#                                       (`-k "cuda or triton"`: with the loss head's walk through the real Triton
#                                       kernels against float64, test_loss_head_through_the_triton_kernels_...[cuda];
#                                       the [interpreter] variants skip, with the reason, where Triton's CPU
#                                       interpreter cannot run a kernel: Triton 3.6 with numpy >= 2.3)
#   4. benchmarks/distributed_gpu.sh    ZeRO-3 and FSDP2 through DistillationTrainer.train(), world_size 1 (#13)
#   5. benchmarks/engine_memory.py --gpu  peak GPU memory of the KD step, loss head vs whole logits, under DDP, FSDP2
#                                       and ZeRO-3 at world size 1 (V 128,256, bf16; issue #41 item 4). Checked on
#                                       the CPU first: `python benchmarks/engine_memory.py --gpu --tiny`
# STEPS="causal_lm_gpu head_modes kd_precision cuda_tests distributed_gpu engine_memory_gpu" (the default) selects
# and orders them; BUDGET=seconds bounds the whole run (see step() below).
# The machine has torch but not datasets/deepspeed, and an older transformers: carry wheels in .gpuwheels
# (see benchmarks/README.md, "GPU checks") and they are installed offline first. Results go to $OUT (or
# benchmarks/results when OUT is unset); each step has its own time limit so one slow step cannot eat the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
log="$OUT/gpu_checks.log"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  if [[ -d .gpuwheels ]]; then
    # --no-deps: every wheel the image lacks is in the folder; the rest (pyarrow, pandas, triton, ...) is there.
    $PY -m pip install -q --no-index --no-deps .gpuwheels/*.whl 2>&1 | tail -3
  fi
  $PY -c "import torch, transformers, accelerate, datasets; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
} >"$log" 2>&1

# BUDGET (seconds, optional): the whole script's wall-clock limit; each step gets min(its limit, what is left), and a
# step with under 30 s left is skipped (written to the log), so a device call's timeout never cuts off the results.
deadline=$(( $(date +%s) + ${BUDGET:-100000} ))
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s) left=$(( deadline - $(date +%s) ))
  if (( left < 30 )); then echo "$name: skipped, ${left} s of BUDGET left" >>"$log"; return; fi
  (( limit > left )) && limit=$left
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $(( $(date +%s) - start )) s" >>"$log"
}
for s in ${STEPS:-causal_lm_gpu head_modes kd_precision cuda_tests distributed_gpu engine_memory_gpu}; do
  case $s in
    causal_lm_gpu) step causal_lm_gpu 220 $PY benchmarks/causal_lm_gpu.py --out "$OUT" --chunks ${CHUNKS:-256 512} ;;
    head_profile) step head_profile 150 $PY benchmarks/head_profile.py --out "$OUT" ;;
    llm_throughput) step llm_throughput 560 $PY benchmarks/llm_throughput_gpu.py --kd_head_mode both --out "$OUT" ;;
    head_modes) step head_modes 200 $PY benchmarks/head_modes_gpu.py --out "$OUT" ;;
    head_fused_sweep) step head_fused_sweep 150 $PY benchmarks/head_modes_gpu.py --only-sweep --profile-fused \
      --fused-chunks "${FUSED_CHUNKS:-1024,2048,4096,8192}" --name head_fused_sweep --out "$OUT" ;;
    kd_precision) step kd_precision 150 $PY benchmarks/kd_precision.py --device cuda --out "$OUT" ;;
    cuda_tests) step cuda_tests 240 $PY -m pytest -q -p no:cacheprovider -k "cuda or triton" tests/test_mixed_precision.py \
      tests/test_chunked.py tests/test_sparse_head.py tests/test_triton_sparse.py tests/test_fused_grads.py \
      tests/test_head_common.py ;;
    distributed_gpu)
      step distributed_gpu 200 env PYTHON=$PY bash benchmarks/distributed_gpu.sh
      cp benchmarks/results/distributed_gpu.json "$OUT/" 2>/dev/null
      # the runs' own logs (ranks' tracebacks); $OUT/distributed_gpu.log is only the script's stdout
      cp benchmarks/results/distributed_gpu.log "$OUT/distributed_gpu_runs.log" 2>/dev/null ;;
    engine_memory_gpu) step engine_memory_gpu 300 $PY benchmarks/engine_memory.py --gpu --results "$OUT" ;;
    *) echo "unknown step $s" >>"$log" ;;
  esac
done
cat "$log"
