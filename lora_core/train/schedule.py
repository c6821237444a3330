"""Learning-rate schedules of the LoRA paper's code (microsoft/LoRA ``optimizer.py``).

Pure functions of the step: both backends and a resumed run compute the same value.
"""

from __future__ import annotations

from typing import Literal


def linear_warmup_decay(step: int, base_lr: float, warmup: int, max_step: int) -> float:
    """Linear warm-up from 0 over ``warmup`` steps, then linear decay to 0 at ``max_step``.

    ``step`` is the 0-based index of the optimizer update: the paper code wraps this in
    ``LambdaLR`` and calls ``scheduler.step()`` after each update, so its first update
    runs with ``lr(0)`` (0 when ``warmup > 0``).
    """
    if step < warmup:
        return base_lr * step / max(1, warmup)
    return base_lr * max(0.0, (max_step - step) / max(1, max_step - warmup))


def constant(step: int, base_lr: float, warmup: int, max_step: int) -> float:
    """Linear warm-up, then constant."""
    return base_lr * step / warmup if step < warmup else base_lr


SCHEDULES = {"linear": linear_warmup_decay, "constant": constant}


def lr_at(step: int, base_lr: float, warmup: int, max_step: int,
          kind: Literal["linear", "constant"] = "linear") -> float:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose from {sorted(SCHEDULES)}")
    return SCHEDULES[kind](step, base_lr, warmup, max_step)
