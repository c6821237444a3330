"""The GPU self-check of a backend, framework-agnostic: what to compute, what it must equal,
and the error a user gets when a framework's CUDA path is broken.

Jittor 1.3.11 does not build on CUDA 13 as released, and once patched to build it returned
wrong numbers there with no error (``(jt.ones((4, 4)) * 2).sum()`` gave 0.96). So before any
model work on a GPU the jittor backend runs ``SELF_CHECK`` through its own ops and compares
with numpy (``check_results``); a failure stops with :class:`GPUSelfCheckError` naming the CUDA
toolkit found and the toolkits jittor supports, instead of a crash deep inside or training
on garbage. The same error, with the same two facts, is what a user gets where jittor cannot
use the GPU at all: an import that crashes compiling its CUDA sources, or a jittor without
CUDA (built without ``nvcc``, or no toolkit found) asked for the GPU.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import numpy as np

__all__ = ["GPUSelfCheckError", "JITTOR_CUDA_SUPPORTED", "NVCC_PLACES", "self_check_inputs", "check_results",
           "cuda_driver_present", "find_nvcc", "cuda_toolkit", "self_check_error"]

# What jittor's own installer (jittor.compile_extern / install_cuda) offers.
JITTOR_CUDA_SUPPORTED = "CUDA 10.x to 12.2"
# Where jittor looks for nvcc after $nvcc_path and PATH (jittor/compiler.py).
NVCC_PLACES = ("/usr/local/cuda/bin/nvcc", "/usr/bin/nvcc", "/opt/cuda/bin/nvcc")


class GPUSelfCheckError(RuntimeError):
    """A framework's GPU path cannot compile or computes wrong numbers."""


def self_check_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """Small float32 inputs of the self-check (elementwise, reduction, matmul, softmax)."""
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((16, 32)).astype(np.float32),
            "b": rng.standard_normal((32, 8)).astype(np.float32)}


def expected_results(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """numpy (float64) values of the checks the backend computes with its own ops."""
    a, b = x["a"].astype(np.float64), x["b"].astype(np.float64)
    z = a - a.max(-1, keepdims=True)
    return {"ones_times_2_sum": np.array(32.0), "scale_add": 2 * a + 1, "row_sum": a.sum(-1),
            "matmul": a @ b, "softmax": np.exp(z) / np.exp(z).sum(-1, keepdims=True)}


def check_results(got: dict[str, np.ndarray], inputs: dict[str, np.ndarray], rtol: float = 1e-4) -> list[str]:
    """The checks whose values differ from numpy (max |diff| / max(1, max |expected|) > rtol)."""
    bad = []
    for name, want in expected_results(inputs).items():
        have = np.asarray(got.get(name, np.nan), dtype=np.float64)
        if have.shape != want.shape:
            bad.append(f"{name}: shape {have.shape} != {want.shape}")
            continue
        err = float(np.max(np.abs(have - want), initial=0.0)) / max(1.0, float(np.max(np.abs(want), initial=0.0)))
        if not np.isfinite(err) or err > rtol:
            bad.append(f"{name}: relative error {err:.3g}")
    return bad


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


def find_nvcc() -> str:
    """The ``nvcc`` a framework would compile with: ``$nvcc_path`` when set and not empty,
    else ``nvcc`` on PATH, else the first of ``NVCC_PLACES`` that exists; ``""`` if none."""
    found = os.environ.get("nvcc_path") or shutil.which("nvcc")
    return found or next((p for p in NVCC_PLACES if os.path.isfile(p) and os.access(p, os.X_OK)), "")


def cuda_toolkit() -> str:
    """The CUDA toolkit a framework would compile with: ``nvcc --version``'s release and path
    (:func:`find_nvcc`), or a note that none was found."""
    nvcc = find_nvcc()
    if not nvcc:
        return f"none (no nvcc: $nvcc_path empty or unset, none on PATH or at {', '.join(NVCC_PLACES)})"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{nvcc} (could not run it: {e})"
    m = re.search(r"release (\d+\.\d+)", out)
    return f"CUDA {m.group(1) if m else 'of unknown version'} ({nvcc})"


def self_check_error(framework: str, what: str, toolkit: str | None = None) -> GPUSelfCheckError:
    """The error for a failed GPU self-check; ``what``: the failed checks or the exception."""
    toolkit = toolkit or cuda_toolkit()
    return GPUSelfCheckError(
        f"{framework} failed its GPU self-check: {what}.\n"
        f"  CUDA toolkit found: {toolkit}; {framework} supports {JITTOR_CUDA_SUPPORTED}.\n"
        f"  Use a supported toolkit (set nvcc_path=/path/to/cuda-12.2/bin/nvcc), or run {framework} on the "
        f"CPU (jittor.flags.use_cuda = 0), or use the torch backend on this GPU. See the README, section GPU."
    )
