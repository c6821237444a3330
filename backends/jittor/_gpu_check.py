"""Jittor's GPU self-check (what and why: ``lora_core.gpu_check``): run once before the first
model is built with ``jittor.flags.use_cuda`` set; a failure raises ``GPUSelfCheckError``.
``require_cuda`` raises the same error where jittor has no CUDA at all, before the GPU is
switched on (jittor's own answer is a bare "No CUDA found")."""

from __future__ import annotations

import jittor as jt
import numpy as np

from lora_core.gpu_check import check_results, self_check_error, self_check_inputs

from . import _env

_passed = False


def compute(inputs: dict) -> dict:
    """The self-check's values through jittor's ops (on the device jittor uses now)."""
    a, b = jt.array(inputs["a"]), jt.array(inputs["b"])
    return {"ones_times_2_sum": np.array((jt.ones((4, 4)) * 2).sum().item()), "scale_add": (a * 2 + 1).numpy(),
            "row_sum": a.sum(-1).numpy(), "matmul": jt.matmul(a, b).numpy(),
            "softmax": jt.nn.softmax(a, dim=-1).numpy()}


def require_cuda() -> None:
    """Raise ``GPUSelfCheckError`` (the toolkit found, the ones jittor supports, why) unless
    this jittor can run on the GPU (``jittor.has_cuda``: built with nvcc, a device seen)."""
    if jt.has_cuda:
        return
    if _env.no_cuda_reason:
        why = _env.no_cuda_reason
    elif not jt.flags.nvcc_path:
        why = "jittor was built without nvcc (nvcc_path empty), for the CPU"
    else:
        why = f"jittor was built with {jt.flags.nvcc_path} but sees no CUDA device"
    raise self_check_error("jittor", f"this jittor has no CUDA: {why}")


def ensure_gpu_ok(force: bool = False, compute=compute) -> None:
    """Check jittor's numbers against numpy when it runs on a GPU (``force``: also on the CPU),
    once per process; raise ``GPUSelfCheckError`` naming the CUDA toolkit on failure."""
    global _passed
    if (_passed and not force) or not (jt.flags.use_cuda or force):
        return
    inputs = self_check_inputs()
    try:
        got = compute(inputs)
    except Exception as e:  # a kernel that does not compile, a missing CUDA library
        raise self_check_error("jittor", f"{type(e).__name__}: {str(e).strip()[:500]}") from e
    bad = check_results(got, inputs)
    if bad:
        raise self_check_error("jittor", "wrong numbers: " + "; ".join(bad))
    _passed = _passed or bool(jt.flags.use_cuda)
