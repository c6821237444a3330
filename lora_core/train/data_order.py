"""The order of a training run, a function of the seed only (exact resume): which examples
each batch of an epoch holds, how many updates a run has, the framework seed of each update.

- Data order: ``numpy.random.default_rng([seed, epoch]).permutation(N)`` per epoch, cut into
  batches; the last batch of an epoch is kept smaller, filled up with seeded random examples
  (the paper code's ``FT_Dataset``) or dropped (``TrainConfig.last_batch``).
- Dropout: the framework RNG is reseeded with ``seed * 1_000_003 + step`` before each update.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dropout_seed", "epoch_batches", "steps_per_epoch", "total_steps"]


def steps_per_epoch(n: int, batch_size: int, last_batch: str = "keep") -> int:
    return n // batch_size if last_batch == "drop" else -(-n // batch_size)


def total_steps(cfg, n: int) -> int:
    """Updates of the whole run (the schedule's end): ``max_steps`` or epochs x updates per epoch."""
    return cfg.max_steps or cfg.epochs * steps_per_epoch(n, cfg.batch_size, cfg.last_batch)


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, last_batch: str = "keep") -> list[np.ndarray]:
    """Example indices of each batch of ``epoch`` (0-based): a permutation drawn from
    ``default_rng([seed, epoch])``; ``fill`` tops the last batch up with draws from the same
    generator (the paper's ``FT_Dataset`` fills it with random examples)."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    rest = n % batch_size
    if rest and last_batch == "fill":
        order = np.concatenate([order, rng.integers(0, n, batch_size - rest)])
    elif rest and last_batch == "drop":
        order = order[: n - rest]
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def dropout_seed(seed: int, step: int) -> int:
    """Framework seed before update ``step``: dropout masks depend on (seed, step) only."""
    return seed * 1_000_003 + step
