"""Put on PYTHONPATH by scripts/gpu_checks.sh (step ``sdpa``): with ``LORA_GPU_CUDNN_SDP=0`` every
Python process of the run (the benches start one per system) turns PyTorch's cuDNN attention
backend off, to see whether its per-shape plans are what makes bf16 steps on new shapes slow."""

import os

if os.environ.get("LORA_GPU_CUDNN_SDP") == "0":
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
