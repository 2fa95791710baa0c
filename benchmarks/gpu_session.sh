#!/usr/bin/env bash
# On a lent GPU machine (the GPU issue: docs/benchmarks.md, "GPU"): run every GPU check shardlab
# has and write each table to $OUT (default ./gpu_out). Written on a CPU-only machine and NOT yet
# run on a GPU: expect to fix what the first run shows. Each step is independent (a failing step
# is logged and the next one runs); the whole batch is sized for ~25 minutes, and the device
# runs at most 10 minutes per command, so split it into calls whose step limits (below) fit:
#
#   OUT=$OUT STEPS="env tests" bash benchmarks/gpu_session.sh        # <= 360 s
#   OUT=$OUT STEPS="comm" bash benchmarks/gpu_session.sh             # <= 3 x 180 s
#   OUT=$OUT STEPS="verify" VERIFY_N=2 bash benchmarks/gpu_session.sh    # <= 420 s, then VERIFY_N=4
#   OUT=$OUT STEPS="single" bash benchmarks/gpu_session.sh           # <= 300 + 280 s
#   OUT=$OUT STEPS="planner moe" bash benchmarks/gpu_session.sh      # <= 340 + 240 s
#   OUT=$OUT STEPS="overlap pipeline" bash benchmarks/gpu_session.sh # <= 2 x 150 + 280 s
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PY:-python}
export PYTHONPATH=${PYTHONPATH:-.}
STEPS=${STEPS:-"env tests comm verify single planner overlap moe pipeline"}

step() {  # step NAME TIMEOUT_S CMD...: run with a time limit, log to $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "   rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

for s in $STEPS; do
  case $s in
    env)
      step env 60 bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'" ;;
    tests)  # the gpu-marked tests (CUDA IPC transport, pinned snapshots, CUDA RNG in checkpoints)
      step test_gpu 300 "$PY" -m pytest -q -m gpu tests ;;
    comm)   # N ranks on one GPU: gloo (host-staged) vs the shared-memory transport over CUDA IPC
      for n in 2 4 8; do
        step "comm_n$n" 180 "$PY" -m shardlab.cli bench comm --device cuda --nproc "$n" \
          --ops all_reduce,all_gather,reduce_scatter,all_to_all,sendrecv --sizes 1M..64M --factor 4 \
          --algorithms backend --transport process_group,shared
      done ;;
    verify)  # the parity matrix with the ranks sharing the GPU (float64; auto transport = shared)
      for n in ${VERIFY_N:-2 4}; do step "verify_n$n" 420 "$PY" -m shardlab.cli verify --nproc "$n"; done ;;
    single)  # shardlab's loop vs a plain compiled loop, bf16
      step single_gpt2 300 "$PY" benchmarks/single_device.py --config configs/gpt2-124m.toml --device cuda
      step single_llama1b 280 "$PY" benchmarks/single_device.py --config configs/llama-1b.toml --device cuda ;;
    planner)  # predicted vs torch.cuda.max_memory_allocated
      step planner 340 "$PY" benchmarks/planner_calibration.py --device cuda --layouts "dp:1,fsdp:2,tp2:2,pp2-1f1b:2" \
        --out "$OUT/planner_calibration_cuda.md" ;;
    overlap)  # 2 ranks sharing the GPU over gloo (asynchronous, unlike the shared transport): DDP
              # and FSDP traces, and how much of each rank's communication overlapped its compute
      for zero in 0 3; do
        step "overlap_zero$zero" 150 "$PY" -m shardlab.cli train configs/llama-350m.toml --nproc 2 \
          --train.device=cuda --train.precision=bf16 --train.steps=6 --profile 2 --parallel.zero_stage=$zero \
          --parallel.comm_transport=process_group --checkpoint.save=false --logging.run_dir="$OUT/overlap_zero$zero"
      done ;;
    moe)    # the experts' kernels on the GPU: per-expert loop vs torch._grouped_mm (bf16, fp32)
      step moe_kernel 240 "$PY" benchmarks/moe_kernel.py --device cuda --dtypes bfloat16 float32 \
        --tokens 2048 8192 ;;
    pipeline)  # the machine's 16 CPU cores: pp = 4 ranks with a core each (on the 2-core CI host four
               # ranks share two cores, so no schedule can turn its bubble into speed: ZB-H1 vs 1F1B)
      step pipeline_cpu_pp4 280 "$PY" benchmarks/pipeline.py --pp 4 --d-model 256 --steps 8 \
        --engines 1f1b,zb-h1,dualpipe,interleaved ;;
    *) echo "unknown step $s" | tee -a "$OUT/summary.txt" ;;
  esac
done
