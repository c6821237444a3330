"""Configure jittor before its first import (no CUDA runtime -> CPU; quiet logs).

jittor looks for ``nvcc`` at import and, when it finds one (e.g. a CUDA toolkit on a
machine without a GPU driver), fails loading ``libcudart``. With no NVIDIA driver here we
set ``nvcc_path=""`` so jittor builds its CPU path. A user who sets ``nvcc_path`` or has
a working driver gets jittor's CUDA path unchanged. oneDNN (jittor's fast CPU matmul) is
provided by the install step (``scripts/link_onednn.sh``), not here.
"""

from __future__ import annotations

import ctypes
import os


def cuda_driver_present() -> bool:
    """True if the NVIDIA driver library loads and reports at least one device."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0


def configure() -> None:
    """Set jittor's environment switches; a no-op for anything the user already set."""
    if "nvcc_path" not in os.environ and not cuda_driver_present():
        os.environ["nvcc_path"] = ""
    os.environ.setdefault("log_silent", "1")


def import_jittor() -> None:
    """Import jittor; on a machine with an NVIDIA driver a crash there (jittor compiling its
    CUDA sources against an unsupported toolkit) becomes ``GPUSelfCheckError`` naming it."""
    try:
        import jittor  # noqa: F401
    except Exception as e:
        if os.environ.get("nvcc_path") == "" or not cuda_driver_present():
            raise
        from lora_core.gpu_check import self_check_error

        raise self_check_error("jittor", f"importing jittor failed: {type(e).__name__}: {str(e).strip()[:500]}") from e
