"""Mixed precision, framework-agnostic: the ``precision`` switch and dynamic loss scaling.

``precision`` is one of ``fp32`` (default: everything in float32, the exact path), ``bf16``
(the forward runs under the framework's bfloat16 autocast: frozen products in bfloat16) or
``fp16`` (the same in float16, with dynamic loss scaling). LoRA parameters, their gradients
and the optimizer moments stay float32 in every mode.

Dynamic loss scaling (the rule of ``torch.amp.GradScaler``, Micikevicius et al. 2018, "Mixed
Precision Training", arXiv:1710.03740): the loss is multiplied by ``scale`` before the
backward pass and the gradients divided by it before clipping and the update. An update whose
gradients hold an inf or a NaN is skipped (parameters, moments and the step count unchanged),
``scale`` is multiplied by ``backoff_factor`` and the skip is counted; after
``growth_interval`` finite updates in a row ``scale`` is multiplied by ``growth_factor``.
``GradScaler`` itself is not used: it drives ``torch.optim.Optimizer`` objects (it reads their
``param_groups`` and keeps its per-optimizer state keyed by object id, and does not report
whether it skipped), our AdamW is not one, and the jittor backend needs the same rule.
:class:`DynamicLossScale` holds the state machine once; both backends' ``AdamW`` call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PRECISIONS", "check_precision", "LossScaleConfig", "DynamicLossScale", "precision_log"]

PRECISIONS = ("fp32", "bf16", "fp16")


def check_precision(value, option: str = "precision") -> str:
    """``value`` if it is one of :data:`PRECISIONS`, else a ``ValueError`` naming ``option``."""
    if value not in PRECISIONS:
        raise ValueError(f"{option}={value!r} is not a precision; choose one of {', '.join(PRECISIONS)}")
    return value


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling (``torch.amp.GradScaler``'s defaults)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1):
            raise ValueError(f"LossScaleConfig needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1; "
                             f"got {self}")
        if not (isinstance(self.growth_interval, int) and self.growth_interval > 0):
            raise ValueError(f"LossScaleConfig.growth_interval must be a positive int, got {self.growth_interval!r}")


class DynamicLossScale:
    """The loss scale of one optimizer: ``scale``, finite updates in a row, skipped updates."""

    KEYS = ("loss_scale.scale", "loss_scale.good_steps", "loss_scale.skipped_steps")

    def __init__(self, cfg: LossScaleConfig = LossScaleConfig()):
        self.cfg, self.scale, self.good_steps, self.skipped_steps = cfg, float(cfg.init_scale), 0, 0

    def update(self, finite: bool) -> bool:
        """Record one update's gradients (all finite or not); True if the update is applied."""
        if not finite:
            self.scale *= self.cfg.backoff_factor
            self.good_steps, self.skipped_steps = 0, self.skipped_steps + 1
            return False
        self.good_steps += 1
        if self.good_steps == self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.good_steps = 0
        return True

    def state_numpy(self) -> dict[str, np.ndarray]:
        """The state for a checkpoint (joins the optimizer's flat numpy dict)."""
        values = (np.float64(self.scale), np.int64(self.good_steps), np.int64(self.skipped_steps))
        return {k: np.array(v) for k, v in zip(self.KEYS, values)}

    def load_state_numpy(self, state: dict) -> dict:
        """Restore from ``state`` (an optimizer state holding :attr:`KEYS`); returns the rest."""
        missing = [k for k in self.KEYS if k not in state]
        if missing:
            raise ValueError(f"optimizer state has no loss-scale entries {missing}: it was saved by a run "
                             "without fp16 dynamic loss scaling")
        self.scale = float(state["loss_scale.scale"])
        self.good_steps, self.skipped_steps = int(state["loss_scale.good_steps"]), int(state["loss_scale.skipped_steps"])
        return {k: v for k, v in state.items() if k not in self.KEYS}


def precision_log(optimizer) -> dict:
    """Fields of the trainer's ``train`` log record: with loss scaling, ``skipped_steps`` (so
    far in the run) and the current ``loss_scale``; nothing otherwise."""
    ls = getattr(optimizer, "loss_scale", None)
    return {} if ls is None else {"skipped_steps": ls.skipped_steps, "loss_scale": ls.scale}
