"""Dropout masks from one seeded numpy stream, shared by both backends (parity mode).

Normally each backend draws LoRA dropout masks from its own RNG, so torch and jittor runs
agree only statistically. In parity mode every LoRA layer asks this source for its mask,
in forward order, so both backends apply the same masks. ``reseed(step)`` makes the
stream a function of the step, so a resumed run draws the same masks as an uninterrupted
one.
"""

from __future__ import annotations

import numpy as np


class NumpyDropout:
    """Inverted-dropout masks: 0 with probability ``p``, else ``1 / (1 - p)`` (float32)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def reseed(self, step: int) -> None:
        self.rng = np.random.default_rng([self.seed, step])

    def mask(self, shape: tuple[int, ...], p: float) -> np.ndarray:
        keep = self.rng.random(shape, dtype=np.float32) >= p
        return keep.astype(np.float32) / np.float32(1.0 - p)
