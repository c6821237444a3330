#!/usr/bin/env bash
# ../shared/GPU.md's list on a lent GPU machine, in one call, each step under its own time limit:
#   1. the GPU tests (pytest -m gpu, torch), 2. GPT-2 Medium E2E training + beam, ours-torch vs
#   HF+peft (fp32/bf16, batch 8/32, eager decode step), 3. Llama methods (full, LoRA, GC, QLoRA
#   with bitsandbytes' CUDA kernels) vs transformers + peft + bitsandbytes with the planner's
#   prediction, 4. the jittor self-check (it must refuse CUDA 13 with its message).
# Raw output in $OUT (default ./gpu-out): gpu.log (every step's output) and one JSON per bench.
# Needs, in the project root (ignored folders, named in the device tool's carry):
#   .gpudata/data/{e2e,gpt2-vocab}   copies of ../shared/data's
#   .gpusite/bnb                     bitsandbytes 0.50.2 unpacked (its cpu and cuda13x libraries)
#   .gpusite/jt                      jittor 1.3.11 and astunparse (pip install --target)
# Usage there: bash scripts/gpu_checks.sh [STEP ...]   (default: tests nlg llama jittor, ~9 min)
# Steps for the questions the first run left (docs/gpu.md; run at e8ad55d: tests, llama16, llama-fp32,
# sdpa; at a8d4e9a: tests (cut at 300 s after 13 of 17), llama16, llama-fp32, llama-compile, nlg8; the
# next session: tests (18 now, ~7 min), then llama-fp32 llama16: float32 GQA attention without the
# math kernel, AdamW's multi-tensor update, the planner's refit of ours' LoRA rows held out):
#   llama-fp32  the 4-layer rows of step llama in float32 (no autocast), plain and GC (~1 min)
#   llama16  all 16 layers of Llama-3.2-1B's shape (the planner's CUDA fit on another shape; QLoRA
#            since its code tables stay on the GPU), with a torch.profiler table per row (profiles.tgz)
#   sdpa     GPT-2 Medium bf16 batch 8 with PyTorch's cuDNN attention off (scripts/gpu_site)
#   llama-compile  the 4-layer full and LoRA rows with ours' step through torch.compile (inductor):
#            the GPU rows are partly host-bound (ours' LoRA step 96 ms, 54 ms of it on the GPU)
#   nlg8     GPT-2 Medium bf16 batch 8 as users run it (ours picks its attention kernels since e8ad55d)
#   compile  GPT-2 Medium fp32 batch 8, ours-torch's step through torch.compile (cudagraphs, then
#            inductor): the launch-bound step is where the 2x target is (~4 min)
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
ROOT=$PWD
export PYTHONUNBUFFERED=1 LORA_TEST_BACKENDS=torch LORA_SHARED=$ROOT/.gpudata
export PYTHONPATH=$ROOT:$ROOT/.gpusite/bnb
LOG=$OUT/gpu.log
DATA=.gpudata/data
steps=${*:-tests nlg llama jittor}

run() {  # run NAME LIMIT_S CMD...: the command's output into gpu.log, its time and exit status after it
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "===== $name (limit ${limit} s) $(date +%T): $*" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "===== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

{
  date
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)"
  git rev-parse --short HEAD 2>/dev/null
} >>"$LOG" 2>&1

for s in $steps; do
  case $s in
    tests)
      # only the modules that hold GPU-marked tests: collecting the whole suite took most of 126 s
      run pytest-gpu 480 python3 -m pytest -m gpu -q -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py) ;;
    nlg)
      for cfg in "8 fp32" "8 bf16" "32 bf16"; do
        set -- $cfg
        run "nlg-b$1-$2" 100 python3 -m examples.nlg.bench --data-dir $DATA --shapes gpt2-medium --device cuda \
          --systems ours-torch,hf-peft --repeats 1 --steps 10 --warmup 3 --beam-examples 16 --threads 4 \
          --batch "$1" --precision "$2" --json "$OUT/nlg-b$1-$2.json"
      done
      run nlg-b8-bf16-eager 60 python3 -m examples.nlg.bench --data-dir $DATA --shapes gpt2-medium --device cuda \
        --systems ours-torch --repeats 1 --steps 10 --warmup 3 --beam-examples 16 --threads 4 --batch 8 \
        --precision bf16 --decode-step eager --json "$OUT/nlg-b8-bf16-eager.json" ;;
    llama-compile)
      run lm-gpu-compile 200 python3 -m examples.lm.gpu_bench --shape llama-3.2-1b --layers 4 --batch 4 --block 512 \
        --steps 5 --methods full,lora --compile inductor --json "$OUT/lm-gpu-compile.json" ;;
    nlg8)
      run nlg-b8-bf16 120 python3 -m examples.nlg.bench --data-dir $DATA --shapes gpt2-medium --device cuda \
        --systems ours-torch,hf-peft --repeats 1 --steps 10 --warmup 3 --beam-examples 16 --threads 4 \
        --batch 8 --precision bf16 --json "$OUT/nlg-b8-bf16.json" ;;
    llama)
      run lm-gpu 170 python3 -m examples.lm.gpu_bench --shape llama-3.2-1b --layers 4 --batch 4 --block 512 \
        --steps 5 --methods full,lora,lora-gc,qlora,qlora-gc --check-logits --json "$OUT/lm-gpu.json" ;;
    llama-fp32)
      run lm-gpu-fp32 120 python3 -m examples.lm.gpu_bench --shape llama-3.2-1b --layers 4 --batch 4 --block 512 \
        --steps 5 --precision fp32 --methods full,full-gc,lora,lora-gc,qlora,qlora-gc --json "$OUT/lm-gpu-fp32.json" ;;
    llama16)
      run lm-gpu-16 240 python3 -m examples.lm.gpu_bench --shape llama-3.2-1b --batch 4 --block 512 --steps 5 \
        --methods full,full-gc,lora,lora-gc,qlora,qlora-gc --check-logits --decode 64 --profile "$OUT/prof" \
        --json "$OUT/lm-gpu-16.json"
      tar czf "$OUT/profiles.tgz" -C "$OUT" prof && rm -rf "$OUT/prof" ;;
    sdpa)
      LORA_GPU_CUDNN_SDP=0 PYTHONPATH=$PYTHONPATH:$ROOT/scripts/gpu_site run nlg-b8-bf16-nocudnn 120 \
        python3 -m examples.nlg.bench --data-dir $DATA --shapes gpt2-medium --device cuda \
        --systems ours-torch,hf-peft --repeats 1 --steps 10 --warmup 3 --beam-examples 16 --threads 4 \
        --batch 8 --precision bf16 --json "$OUT/nlg-b8-bf16-nocudnn.json" ;;
    compile)
      for be in cudagraphs inductor; do
        run "nlg-b8-fp32-$be" 150 python3 -m examples.nlg.bench --data-dir $DATA --shapes gpt2-medium --device cuda \
          --systems ours-torch --repeats 1 --steps 10 --warmup 3 --beam-examples 4 --threads 4 --batch 8 \
          --precision fp32 --compile "$be" --json "$OUT/nlg-b8-fp32-$be.json"
      done ;;
    jittor)
      PYTHONPATH=$PYTHONPATH:$ROOT/.gpusite/jt run jittor-self-check 150 python3 -c "
import lora_core as lc
bk = lc.get_backend('jittor')
import jittor as jt
print('jittor', jt.__version__, 'has_cuda', jt.has_cuda, 'nvcc_path', repr(jt.flags.nvcc_path))
from lora_core.models.gpt2 import gpt2_config
m = bk.GPT2LMModel(gpt2_config('tiny'))
print('to_device returned', bk.to_device(m, 'cuda'), '(a GPU jittor that passed the self-check)')
" ;;
    *) echo "unknown step $s (tests nlg llama jittor llama-fp32 llama16 llama-compile sdpa nlg8 compile)" | tee -a "$LOG" ;;
  esac
done
date >>"$LOG"
