"""Device placement for Jittor: contract in ``backends.torch.device``.

Jittor has one switch for the whole process, ``jt.flags.use_cuda``, and uses the first GPU
it sees (choose it with ``CUDA_VISIBLE_DEVICES``); turning it on runs the GPU self-check
(``lora_core.gpu_check``) first, and asking for the GPU on a machine with a driver where this
jittor has no CUDA raises the self-check's error. It has no peak-memory counter:
``peak_gpu_mb`` is ``None``.
"""

from __future__ import annotations

import jittor as jt

from lora_core.device import parse_device, resolve_device
from lora_core.gpu_check import GPUSelfCheckError

from ._env import cuda_driver_present
from ._gpu_check import ensure_gpu_ok, require_cuda


def gpu_count() -> int:
    return 1 if jt.has_cuda and cuda_driver_present() else 0


def to_device(model, device: str = "auto") -> str:
    """Run jittor (and so ``model``) on ``device``; returns ``cpu`` or ``cuda:0``."""
    kind, index = parse_device(device)
    if kind == "cuda" and index not in (None, 0):
        raise ValueError(f"device={device!r}: jittor uses the first GPU it sees; choose GPU {index} with "
                         f"CUDA_VISIBLE_DEVICES={index} and device='cuda'")
    if kind == "cuda" and cuda_driver_present():
        require_cuda()  # a GPU this jittor cannot use: the self-check's message, not "no GPU here"
    name = resolve_device(device, gpu_count(), "jittor",
                          "jt.has_cuda is false: no NVIDIA driver, or jittor built without nvcc")
    jt.flags.use_cuda = int(name != "cpu")
    if name != "cpu":
        try:
            ensure_gpu_ok()
        except GPUSelfCheckError:
            jt.flags.use_cuda = 0
            raise
    return name


def peak_gpu_mb(model) -> float | None:
    """``None``: jittor keeps no peak GPU memory counter."""
    return None


def reset_peak_gpu(model) -> None:
    """Nothing: jittor keeps no peak GPU memory counter."""


__all__ = ["peak_gpu_mb", "reset_peak_gpu", "to_device"]
