"""The GPU self-check of a backend, framework-agnostic: what to compute, what it must equal,
and the error a user gets when a framework's CUDA path is broken.

Jittor 1.3.11 does not build on CUDA 13 as released, and once patched to build it returned
wrong numbers there with no error (``(jt.ones((4, 4)) * 2).sum()`` gave 0.96). So before any
model work on a GPU the jittor backend runs ``SELF_CHECK`` through its own ops and compares
with numpy (``check_results``); a failure stops with :class:`GPUSelfCheckError` naming the CUDA
toolkit found and the toolkits jittor supports, instead of a crash deep inside or training
on garbage.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np

__all__ = ["GPUSelfCheckError", "JITTOR_CUDA_SUPPORTED", "self_check_inputs", "check_results",
           "cuda_toolkit", "self_check_error"]

# What jittor's own installer (jittor.compile_extern / install_cuda) offers.
JITTOR_CUDA_SUPPORTED = "CUDA 10.x to 12.2"


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


def cuda_toolkit() -> str:
    """The CUDA toolkit a framework would compile with: ``nvcc --version``'s release and path
    (``$nvcc_path``, else ``nvcc`` on PATH), or a note that none was found."""
    nvcc = os.environ.get("nvcc_path") or shutil.which("nvcc") or ""
    if not nvcc:
        return "no nvcc found (nvcc_path unset and no nvcc on PATH)"
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
        f"{framework} on the GPU failed its self-check against numpy: {what}.\n"
        f"  CUDA toolkit found: {toolkit}; {framework} supports {JITTOR_CUDA_SUPPORTED}.\n"
        f"  Use a supported toolkit (set nvcc_path=/path/to/cuda-12.2/bin/nvcc), or run {framework} on the "
        f"CPU (jittor.flags.use_cuda = 0), or use the torch backend on this GPU. See the README, section GPU."
    )
