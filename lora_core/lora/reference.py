"""Numpy reference of the LoRA math (Hu et al. 2021, eq. 3; loralib layouts), used by tests.

``y = x W^T + b + scaling * (x A^T) B^T`` for a Linear; for the fused qkv layer
(loralib ``MergedLinear``) slice j of the enabled output slices uses
``A[j*r:(j+1)*r]`` and ``B[j*o:(j+1)*o]`` with ``o = out/3``.
"""

from __future__ import annotations

import numpy as np


def _slices(out_features: int, enable: tuple[bool, ...] | None) -> list[slice]:
    """Output slices that receive LoRA pairs (one slice covering all if ``enable`` is None)."""
    if enable is None:
        return [slice(0, out_features)]
    o = out_features // len(enable)
    return [slice(i * o, (i + 1) * o) for i, on in enumerate(enable) if on]


def lora_delta(A: np.ndarray, B: np.ndarray, scaling: float, out_features: int,
               enable: tuple[bool, ...] | None = None) -> np.ndarray:
    """The weight update ``scaling * B A`` placed on the enabled output rows, (out, in)."""
    slices = _slices(out_features, enable)
    r = A.shape[0] // len(slices)
    delta = np.zeros((out_features, A.shape[1]), dtype=np.float64)
    for j, sl in enumerate(slices):
        o = sl.stop - sl.start
        delta[sl] = B[j * o:(j + 1) * o].astype(np.float64) @ A[j * r:(j + 1) * r].astype(np.float64)
    return scaling * delta


def merge(W: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float,
          enable: tuple[bool, ...] | None = None) -> np.ndarray:
    """``W + delta`` (float64)."""
    return W.astype(np.float64) + lora_delta(A, B, scaling, W.shape[0], enable)


def lora_linear(x: np.ndarray, W: np.ndarray, b: np.ndarray | None, A: np.ndarray, B: np.ndarray,
                scaling: float, enable: tuple[bool, ...] | None = None) -> np.ndarray:
    """Forward of a LoRA linear layer in float64; ``x`` is (..., in)."""
    x = x.astype(np.float64)
    y = x @ W.astype(np.float64).T + (0.0 if b is None else b.astype(np.float64))
    return y + x @ lora_delta(A, B, scaling, W.shape[0], enable).T


def lora_linear_grads(x: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float, dy: np.ndarray,
                      enable: tuple[bool, ...] | None = None) -> dict[str, np.ndarray]:
    """Gradients of ``sum(y * dy)`` w.r.t. ``x``, ``lora_A`` and ``lora_B`` (base W frozen).

    Returns a dict with ``lora_A``, ``lora_B`` (float64) and ``x_lora`` (the LoRA path's
    contribution to the input gradient; the base path adds ``dy @ W``).
    """
    X = x.reshape(-1, x.shape[-1]).astype(np.float64)
    G = dy.reshape(-1, dy.shape[-1]).astype(np.float64)
    slices = _slices(G.shape[1], enable)
    r = A.shape[0] // len(slices)
    dA, dB = np.zeros(A.shape), np.zeros(B.shape)
    dx = np.zeros_like(X)
    for j, sl in enumerate(slices):
        o = sl.stop - sl.start
        Aj, Bj, Gj = A[j * r:(j + 1) * r].astype(np.float64), B[j * o:(j + 1) * o].astype(np.float64), G[:, sl]
        dB[j * o:(j + 1) * o] = scaling * Gj.T @ (X @ Aj.T)
        dA[j * r:(j + 1) * r] = scaling * (Gj @ Bj).T @ X
        dx += scaling * (Gj @ Bj) @ Aj
    return {"lora_A": dA, "lora_B": dB, "x_lora": dx.reshape(x.shape)}


def lora_embedding(ids: np.ndarray, W: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float) -> np.ndarray:
    """loralib ``Embedding``: ``W[ids] + scaling * A.T[ids] @ B.T``; A (r, vocab), B (dim, r)."""
    return W[ids].astype(np.float64) + scaling * (A.T[ids].astype(np.float64) @ B.T.astype(np.float64))


def lora_conv1d(x: np.ndarray, W: np.ndarray, b: np.ndarray | None, A: np.ndarray, B: np.ndarray,
                scaling: float, enable: tuple[bool, ...] | None = None) -> np.ndarray:
    """GPT-2 ``Conv1D`` with LoRA (peft ``fan_in_fan_out``): W is stored (in, out), ``y = x W + b``
    plus the same update as ``lora_linear``; A (r, in), B (out, r) as for a Linear."""
    return lora_linear(x, W.T, b, A, B, scaling, enable)


def merge_conv1d(W: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float,
                 enable: tuple[bool, ...] | None = None) -> np.ndarray:
    """``W + delta^T`` for a (in, out) Conv1D weight (float64)."""
    return W.astype(np.float64) + lora_delta(A, B, scaling, W.shape[1], enable).T


def rslora_scaling(alpha: float, r: int) -> float:
    """Rank-stabilised LoRA (Kalajdzievski 2023; peft ``use_rslora``): ``alpha / sqrt(r)``."""
    return alpha / r ** 0.5
