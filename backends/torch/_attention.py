"""PyTorch's scaled-dot-product attention with the kernels this library picks on a GPU.

On an H200 (docs/gpu.md, code e8ad55d) PyTorch chose its cuDNN attention for bf16, and cuDNN
builds a plan for each new shape: with batches of varying lengths (E2E's: 68, 63, 74, ... tokens)
a bf16 training step of GPT-2 Medium at batch 8 took 0.16-0.22 s where fp32 took 0.03-0.05 s. With
cuDNN's kernel off the same run trained at 6738 tokens/s against 2912 (transformers + peft: 5358
against 2363). So on a GPU our attention runs flash attention, memory-efficient attention or
the math kernel, in PyTorch's order of preference, and never cuDNN's; on the CPU PyTorch's
choice is left alone. (Under ``torch.compile`` the compiler picks, as before.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

GPU_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CHOSEN_ON = ("cuda",)  # the devices whose kernels are chosen here


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)``, on a GPU among ``GPU_KERNELS``."""
    if q.device.type in CHOSEN_ON and not torch.compiler.is_compiling():
        with sdpa_kernel(GPU_KERNELS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
