"""PyTorch's scaled-dot-product attention with the kernels this library picks on a GPU.

On an H200 (docs/gpu.md, code e8ad55d) PyTorch chose its cuDNN attention for bf16, and cuDNN
builds a plan for each new shape: with batches of varying lengths (E2E's: 68, 63, 74, ... tokens)
a bf16 training step of GPT-2 Medium at batch 8 took 0.16-0.22 s where fp32 took 0.03-0.05 s. With
cuDNN's kernel off the same run trained at 6738 tokens/s against 2912 (transformers + peft: 5358
against 2363). So on a GPU our attention runs flash attention, memory-efficient attention or
the math kernel, in PyTorch's order of preference, and never cuDNN's; on the CPU PyTorch's
choice is left alone. (Under ``torch.compile`` the compiler picks, as before.)

Grouped-query attention in float32 on a GPU: flash attention runs fp16/bf16 only and PyTorch's
memory-efficient kernel refuses ``enable_gqa``, so PyTorch ran its math kernel, which keeps the
(batch, heads, T, T) probabilities for the backward pass: at a8d4e9a ours' float32 LoRA rows of
Llama-3.2-1B's shape (docs/gpu.md) kept ~131 MB a layer more than counted, 134 MB the
probabilities' size at 4 x 512 tokens and 32 heads. There the keys and values are repeated to the
query heads (as transformers' ``repeat_kv``) and the memory-efficient kernel runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

GPU_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CHOSEN_ON = ("cuda",)  # the devices whose kernels are chosen here
FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash attention's; it takes enable_gqa


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)``, on a GPU among ``GPU_KERNELS``
    (grouped-query attention outside flash attention's dtypes: keys and values repeated)."""
    if q.device.type in CHOSEN_ON and not torch.compiler.is_compiling():
        if kwargs.get("enable_gqa") and q.dtype not in FLASH_DTYPES and k.shape[-3] != q.shape[-3]:
            groups = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
            kwargs = {**kwargs, "enable_gqa": False}
        with sdpa_kernel(GPU_KERNELS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
