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


class ReplayMasks:
    """Activation checkpointing in parity mode: the masks ``source`` gives during a block's
    forward pass, recorded, then given again in the same order when the block is recomputed
    for the backward pass (``start()`` before each pass), so that both passes drop the same
    units. Torch's own dropout needs no such thing (``torch.utils.checkpoint`` restores the
    RNG state before recomputing); jittor's draws at execution time, so the jittor backend
    records its own masks here too (a source whose ``mask`` returns a jittor mask)."""

    def __init__(self, source):
        self.source, self.masks, self.i = source, [], 0

    def start(self) -> None:
        self.i = 0

    def mask(self, shape: tuple[int, ...], p: float) -> np.ndarray:
        if self.i == len(self.masks):
            self.masks.append(self.source.mask(shape, p))
        m = self.masks[self.i]
        if tuple(m.shape) != tuple(shape):
            raise RuntimeError(
                f"recomputed forward pass asked for a mask of shape {tuple(shape)}, recorded {tuple(m.shape)}"
            )
        self.i += 1
        return m


class BlockMasks:
    """The parity-mode masks of one checkpointed block: between ``start()`` and ``stop()``
    every module of ``modules`` with a ``mask_source`` (other than a ``fixed`` one, which
    repeats itself) takes its masks from its own ``ReplayMasks``, so the first pass records
    and each later pass (the recomputation) replays them. (Plain methods, no context
    manager: torch.compile traces this.)"""

    def __init__(self, modules):
        self.layers = [
            m
            for m in modules
            if getattr(m, "mask_source", None) is not None and not getattr(m.mask_source, "fixed", False)
        ]
        self.replays = [ReplayMasks(m.mask_source) for m in self.layers]

    def start(self) -> list:
        """Swap the replays in; returns the sources for ``stop``."""
        sources = [m.mask_source for m in self.layers]
        for m, r in zip(self.layers, self.replays):
            r.start()
            m.mask_source = r
        return sources

    def stop(self, sources: list) -> None:
        for m, src in zip(self.layers, sources):
            m.mask_source = src
