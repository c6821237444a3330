"""Attention masks and positions as numpy, shared by the backends.

``attention_mask`` (B, T_past + T) marks real tokens with 1. Positions default to
``cumsum(mask) - 1`` so a left-padded row gets the positions of its real tokens, as
HF ``generate`` computes them.
"""

from __future__ import annotations

import numpy as np

# Additive mask value: exp() underflows to exactly 0, and a fully masked row (a pad
# query of a left-padded row) stays finite instead of turning into NaN.
MASK_VALUE = -1e9


def attention_bias(mask: np.ndarray | None, T: int, t_past: int) -> np.ndarray:
    """Float32 (B|1, 1, T, T_past+T): 0 where causal order and padding allow, MASK_VALUE elsewhere."""
    allowed = np.tril(np.ones((T, t_past + T), dtype=bool), t_past)[None, None]
    if mask is not None:
        allowed = allowed & np.asarray(mask, dtype=bool)[:, None, None, :]
    return np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)


def positions(mask: np.ndarray | None, B: int, T: int, t_past: int) -> np.ndarray:
    """int64 (B|1, T) position ids of the new tokens."""
    if mask is None:
        return np.arange(t_past, t_past + T, dtype=np.int64)[None]
    return np.maximum(np.cumsum(np.asarray(mask, dtype=np.int64), -1) - 1, 0)[:, t_past:]
