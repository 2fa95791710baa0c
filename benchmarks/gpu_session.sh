#!/usr/bin/env bash
# On a lent GPU machine (docs/gpu.md): run shardlab's GPU checks in one call and append every
# table to $OUT/log.txt (the device returns at most 8 files). A lease is 15 minutes of device
# time, the machine's start included, and a command runs at most 10 minutes, so the whole batch
# ends by DEADLINE_S seconds (default 540): each step's limit is clipped to the time left and a
# step with under 15 s left is skipped (logged). Steps run in the order given in STEPS:
#
#   env           nvidia-smi, cores, /dev/shm, torch and the device
#   kernels       the rates behind the planner's constants: bf16 products at Llama-8B's shapes, causal
#                 SDPA forward/backward at 8k-32k per backend, an add (benchmarks/gpu_kernels.py)
#   shared_gpu    the same-GPU transport's CUDA tests (comm stream, events, async collectives, the comm
#                 thread), alone
#   checks        side by side (they time nothing): the gpu-marked tests, `shardlab verify` at
#                 N = 2 and 4 ranks sharing the GPU (VERIFY_N2 / VERIFY_N4: layout lists), and on
#                 4 cores of their own the CPU pp = 4 schedules (or, with CHECKS_PLANNER set,
#                 benchmarks/planner_calibration.py --device cuda on those layouts)
#   single        GPT-2 124M, shardlab's loop (compile_scope auto = the whole model, and blocks) vs a
#                 plain compiled loop, side by side in one process (PROFILE_STEPS: profile them)
#   single_eager  the same without torch.compile;  single1b: the 1B Llama
#   comm / comm2  same-GPU collectives at 64 MiB, N = 2, 4, 8 / N = 2 only: the transport on its
#                 comm stream (shared; one-shot all-reduce at 2 ranks, and up to 4 for small chunks), the same in two phases
#                 (shared_2phase), with waits that nap at once (shared_naps), its first version
#                 (shared_sync) and gloo (N = 2)
#                 (COMM_BURST: calls back to back per timed sample, default 1 = each call alone)
#   mps           comm at N = 2 and 4 under CUDA's MPS daemon (started and stopped by the step;
#                 MPS_TRAIN set: DDP on the 1B Llama under it too); run it last
#   memory        Llama-1B on 2 ranks: DDP vs ZeRO-3 with prefetch on/off (benchmarks/gpu_memory.py)
#   peaks         benchmarks/memory_peaks.py --device cuda on PEAKS layouts (predicted vs max allocated)
#   categories    shardlab memory --categories on CUDA, ZeRO-3 and DDP of the peaks step's model
#   planner       predicted vs torch.cuda.max_memory_allocated, tiny layouts
#   overlap       Llama-1B, 2 ranks on the same-GPU transport, ZeRO-3 and DDP under --profile: the
#                 share of communication hidden under compute (OVERLAP_ZERO: the stages; OVERLAP_THREAD:
#                 "false true" runs each also with parallel.comm_thread)
#   moe           the experts' kernels on the GPU
#
#   OUT=$OUT bash benchmarks/gpu_session.sh     # default: env checks single comm memory overlap
#   OUT=$OUT STEPS="single comm2" DEADLINE_S=300 bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
WORK=$(mktemp -d)
PY=${PY:-$(command -v python >/dev/null && echo python || echo python3)}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
STEPS=${STEPS:-"env shared_gpu single single1b comm overlap memory peaks"}
DEADLINE=$((SECONDS + ${DEADLINE_S:-540}))
GPU_TESTS="tests/unit/test_moe.py tests/unit/test_checkpoint_io.py tests/distributed/test_shared_comm.py
  tests/distributed/test_gpu_offload.py tests/distributed/test_async_checkpoint.py tests/distributed/test_compile.py
  tests/distributed/test_memory_peaks.py tests/distributed/test_comm_thread.py"

limit() {  # limit WANTED: seconds this step may take (clipped to the deadline), 0 to skip
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

collect() {  # collect NAME RC T0: append the step's output to the log
  { echo; echo "=== $1: rc=$2 in $((SECONDS - $3)) s"; cat "$WORK/$1.txt"; } >> "$LOG"
  echo "$1: rc=$2 in $((SECONDS - $3)) s"
}

step() {  # step NAME WANTED_S CMD...: run alone with a time limit
  local name=$1 lim; lim=$(limit "$2"); shift 2
  if [ "$lim" = 0 ]; then echo "=== $name: skipped (deadline)" | tee -a "$LOG"; return; fi
  echo "$name ($lim s): $*" >> "$LOG"
  local t0=$SECONDS
  timeout -k 5 "$lim" "$@" > "$WORK/$name.txt" 2>&1
  collect "$name" $? "$t0"
}

background() {  # background NAME LIMIT CORES CMD...: start a step beside the others (see checks),
  local name=$1 lim=$2 cores=$3; shift 3  # on CORES (taskset) where the machine has 16 or more
  local pin=()
  if command -v taskset >/dev/null && [ "$(nproc)" -ge 16 ]; then pin=(taskset -c "$cores"); fi
  echo "$name ($lim s, beside the other checks): ${pin[*]} $*" >> "$LOG"
  ( t0=$SECONDS; timeout -k 5 "$lim" "${pin[@]}" "$@" > "$WORK/$name.txt" 2>&1; echo "$? $t0" > "$WORK/$name.rc" ) &
}

comm() {  # comm N LIMIT TRANSPORTS [NAME]: the collectives at 64 MiB with N ranks sharing the GPU
  step "${4:-comm}_n$1" "$2" "$PY" -m shardlab.cli bench comm --device cuda --nproc "$1" --sizes 64M --iters 10 \
    --warmup 2 --ops all_reduce,all_gather,reduce_scatter,all_to_all,sendrecv --algorithms backend --transport "$3" \
    --burst "${COMM_BURST:-1}"
}

for s in $STEPS; do
  case $s in
    env)
      step env 30 bash -c "nvidia-smi; nproc; df -h /dev/shm; $PY -c 'import torch, shardlab; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)'" ;;
    checks)
      lim=$(limit 220)
      if [ "$lim" = 0 ]; then echo "=== checks: skipped (deadline)" >> "$LOG"; continue; fi
      # shellcheck disable=SC2086
      background test_gpu "$lim" 0-11 "$PY" -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS
      # VERIFY_N2 / VERIFY_N4: a comma list of layouts (default: all that fit)
      # shellcheck disable=SC2086  (VERIFY_ARGS: more flags, e.g. --comm-thread)
      background verify_n2 "$lim" 0-11 "$PY" -m shardlab.cli verify --nproc 2 ${VERIFY_N2:+--layouts "$VERIFY_N2"} ${VERIFY_ARGS:-}
      # shellcheck disable=SC2086
      background verify_n4 "$lim" 0-11 "$PY" -m shardlab.cli verify --nproc 4 ${VERIFY_N4:+--layouts "$VERIFY_N4"} ${VERIFY_ARGS:-}
      extra=""
      if [ -n "${VERIFY_N8:-}" ]; then  # 8 ranks sharing the GPU, only the layouts named
        background verify_n8 "$lim" 0-11 "$PY" -m shardlab.cli verify --nproc 8 --layouts "$VERIFY_N8"
        extra=verify_n8
      fi
      if [ -n "${CHECKS_PLANNER:-}" ]; then  # memory predicted vs max allocated (its step times ran beside)
        background planner "$lim" 12-15 "$PY" benchmarks/planner_calibration.py --device cuda --layouts "$CHECKS_PLANNER"
        side=planner
      else
        background pipeline_cpu_pp4 "$lim" 12-15 "$PY" benchmarks/pipeline.py --pp 4 --d-model 256 \
          --steps 8 --engines 1f1b,zb-h1 --transport shared --cores 4
        side=pipeline_cpu_pp4
      fi
      wait
      for name in test_gpu verify_n2 verify_n4 $extra $side; do
        read -r rc t0 < "$WORK/$name.rc"
        collect "$name" "$rc" "$t0"
      done ;;
    kernels)  # mm_eff / attn_eff / HBM measured beside the stated constants (docs/planner.md, Time model)
      step kernels 60 "$PY" benchmarks/gpu_kernels.py --device cuda --json "$OUT/kernels.json" ;;
    shared_gpu)  # the comm-stream path first: if it is wrong, the comm and overlap rows say nothing
      step shared_gpu 60 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        tests/distributed/test_shared_comm.py::test_shared_collectives_on_one_gpu \
        tests/distributed/test_comm_thread.py::test_comm_thread_on_one_gpu ;;
    single)  # shardlab's loop vs a plain compiled loop, bf16, GPT-2 124M at 16 x 1024 tokens
      step single_gpt2 150 "$PY" benchmarks/single_device.py --config configs/gpt2-124m.toml --device cuda \
        --blocks 4 --per-block 5 --warmup 3 --profile-steps "${PROFILE_STEPS:-0}" \
        --variants='--parallel.compile_scope=blocks' ;;
    single_eager)  # the same without torch.compile (is the gap in the compiled blocks or in the loop?)
      step single_gpt2_eager 60 "$PY" benchmarks/single_device.py --config configs/gpt2-124m.toml --device cuda \
        --blocks 3 --per-block 5 --warmup 2 --profile-steps "${PROFILE_STEPS:-0}" --parallel.compile=false ;;
    single1b)  # the 1B Llama at seq 2048 (compiled)
      step single_llama1b 170 "$PY" benchmarks/single_device.py --config configs/llama-1b.toml --device cuda \
        --blocks 3 --per-block 3 --warmup 2 --parallel.compile=true ;;
    comm2)  # N = 2 only
      comm 2 35 process_group,shared,shared_2phase,shared_naps,shared_sync ;;
    comm)  # N ranks on one GPU at 64 MiB: the shared-memory transport over CUDA IPC (and gloo at N = 2)
      comm 2 35 process_group,shared,shared_2phase,shared_naps,shared_sync
      for n in 4 8; do comm "$n" 30 shared,shared_2phase,shared_naps,shared_sync; done ;;
    mps)  # the same with CUDA's MPS daemon: the ranks' kernels in one GPU context, no time slices
      if ! command -v nvidia-cuda-mps-control >/dev/null; then echo "=== mps: no nvidia-cuda-mps-control" | tee -a "$LOG"; continue; fi
      export CUDA_MPS_PIPE_DIRECTORY="$WORK/mps_pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps_log"
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && echo "mps: daemon started" >> "$LOG"
      comm 2 35 shared,shared_2phase mps_comm
      comm 4 30 shared,shared_2phase mps_comm
      if [ -n "${MPS_TRAIN:-}" ]; then  # DDP on the 1B Llama, 2 ranks, under MPS
        step mps_train_zero0 70 "$PY" -m shardlab.cli train configs/llama-1b.toml --nproc 2 --train.device=cuda \
          --train.steps=5 --train.global_batch=2 --profile 2 --parallel.zero_stage=0 --checkpoint.save=false \
          --logging.progress=false --logging.run_dir="$WORK/mps_train"
      fi
      echo quit | nvidia-cuda-mps-control; sleep 1
      { echo "mps: daemon stopped; its log:"; tail -n 20 "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null; } >> "$LOG"
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
    memory)  # Llama-1B, 2 ranks sharing the GPU: DDP vs ZeRO-3 with prefetch on/off (MEM_BATCH: global batch)
      step memory_1b 90 "$PY" benchmarks/gpu_memory.py --config configs/llama-1b.toml --nproc 2 \
        --train.global_batch="${MEM_BATCH:-2}" ;;
    peaks)  # predicted vs max allocated, the ~100M Llama of the memory issue (PEAKS: layouts, at N = 4)
      # shellcheck disable=SC2086
      step peaks 120 "$PY" benchmarks/memory_peaks.py --device cuda --n 4 \
        --only ${PEAKS:-ddp zero1 zero2 zero3 zero3-noprefetch tp2-sp-dp2 pp2-1f1b-dp2 ddp-bf16 zero3-bf16} ;;
    categories)  # where the CUDA peak goes (torch.profiler's categories at the peak) for ZeRO-3 and DDP, the
                 # ~100M Llama of the peaks step (its CUDA rows measured 1.06-1.19x the prediction)
      for zero in 3 0; do
        step "categories_zero$zero" 60 "$PY" -m shardlab.cli memory --nproc 4 --model.vocab_size=256 \
          --model.d_model=1024 --model.n_layers=8 --model.n_heads=8 --model.max_seq_len=64 --train.seq_len=64 \
          --train.global_batch=16 --parallel.dp_shard=4 --parallel.zero_stage=$zero --train.device=cuda \
          --device h100 --categories
      done ;;
    planner)  # the planner's predicted total vs torch.cuda.max_memory_allocated, tiny layouts
      step planner 120 "$PY" benchmarks/planner_calibration.py --device cuda --layouts "dp:1,fsdp:2,tp2:2,pp2-1f1b:2" ;;
    overlap)  # Llama-1B, 2 ranks on the same-GPU transport (collectives on its comm stream):
              # ZeRO-3 and DDP traces; the summary's line: how much communication overlapped compute
      for zero in ${OVERLAP_ZERO:-3 0}; do  # OVERLAP_THREAD="false true": also with parallel.comm_thread
        for thr in ${OVERLAP_THREAD:-false}; do
          name="overlap_zero$zero$([ "$thr" = true ] && echo _thread)"
          step "$name" 70 "$PY" -m shardlab.cli train configs/llama-1b.toml --nproc 2 \
            --train.device=cuda --train.steps=5 --train.global_batch=2 --profile 2 --parallel.zero_stage=$zero \
            --parallel.comm_thread=$thr --checkpoint.save=false --logging.progress=false --logging.run_dir="$WORK/$name"
          for f in "$WORK/$name"/profile/rank*.json; do  # traces back, compressed (16 MiB a file)
            [ -f "$f" ] && gzip -c "$f" > "$OUT/${name}_$(basename "$f").gz"
          done
        done
      done ;;
    moe)  # the experts' kernels: per-expert loop vs torch._grouped_mm
      step moe_kernel 120 "$PY" benchmarks/moe_kernel.py --device cuda --dtypes bfloat16 float32 --tokens 2048 8192 ;;
    *) echo "unknown step $s" | tee -a "$LOG" ;;
  esac
done
echo "done in $SECONDS s" | tee -a "$LOG"
