"""Mixed precision for Jittor: contract in ``backends.torch.precision``; only ``fp32`` here.

Measured with jittor 1.3.11 on the CPU (x86-64, oneDNN), a (256, 1024) @ (1024, 768) product
of inputs rounded to the 16-bit type, against numpy's float64 product of the same inputs:
``bfloat16`` returned 0.63 relative error (max |diff| / max |exact|; torch's bfloat16 matmul:
3.2e-3), ``float16`` 1.0e-2 (torch: 4.0e-4) in 2.2-2.5 s against 4 ms in float32. Jittor has no
autocast (its ``amp_level`` flags only change type promotion). So bf16 and fp16 are refused
with that reason instead of training on wrong numbers; on a GPU jittor's CUDA path is not
verified here (issue 8: it computed wrong numbers on CUDA 13), so they are refused there too.
"""

from __future__ import annotations

import jittor as jt

from lora_core.train.precision import check_precision

_CPU_REASON = {
    "bf16": "jittor 1.3.11's bfloat16 matmul on the CPU returns wrong numbers (0.63 relative error against "
    "numpy, measured)",
    "fp16": "jittor 1.3.11's float16 matmul on the CPU accumulates in float16 (1e-2 relative error against "
    "numpy) and runs ~600x slower than float32 (measured)",
}


def set_precision(model, precision: str = "fp32") -> None:
    """``fp32`` only (see the module docstring); ``bf16``/``fp16`` raise ``ValueError``."""
    check_precision(precision)
    if precision != "fp32":
        where = "on CUDA" if jt.flags.use_cuda else "on the CPU"
        reason = (_CPU_REASON[precision] if not jt.flags.use_cuda else
                  "mixed precision for jittor's CUDA path is not implemented or verified in this library")
        raise ValueError(f"precision={precision!r} is not supported by the jittor backend {where}: {reason}; "
                         f"use precision='fp32' or the torch backend")
    model.precision = precision


__all__ = ["set_precision"]
