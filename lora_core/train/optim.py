"""AdamW as in the LoRA paper's code (microsoft/LoRA ``examples/NLG/src/optimizer.py``).

Per update with gradient g, for every parameter that trains (frozen ones get no state):
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    step = lr * sqrt(1 - b2^t) / (1 - b1^t) if correct_bias else lr
    p = p - step * m / (sqrt(v) + eps)
    p = p - lr * weight_decay * p      # decoupled, applied after the update
Backends implement this in tensors; ``adamw_reference`` is the numpy form tests use.
With ``loss_scale`` (fp16, ``lora_core.train.precision``) the gradients are unscaled before
clipping and an update with non-finite gradients is skipped.

Which tensors the weight decay applies to is ``AdamWConfig.decay`` (:func:`decays`): ``all``
trained tensors (the paper code: LoRA runs), or ``matrices`` only (full fine-tuning: no decay
on norms, biases and embeddings, as nanoGPT's and transformers' Trainer's grouping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .precision import LossScaleConfig


@dataclass(frozen=True)
class AdamWConfig:
    """Hyper-parameters (paper code defaults: betas (0.9, 0.999), eps 1e-6); ``loss_scale``:
    dynamic loss scaling (fp16 training), ``None`` for none; ``decay``: which tensors the
    weight decay applies to (:func:`decays`)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    correct_bias: bool = True
    loss_scale: LossScaleConfig | None = None
    decay: Literal["all", "matrices"] = "all"

    def __post_init__(self):
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"AdamW betas must be in [0, 1), got {self.betas!r}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"AdamW needs eps > 0 and weight_decay >= 0, got eps={self.eps!r}, "
                             f"weight_decay={self.weight_decay!r}")
        if self.decay not in ("all", "matrices"):
            raise ValueError(f"AdamWConfig.decay must be 'all' or 'matrices', got {self.decay!r}")


# Embedding tables by name (GPT-2 wte/wpe, Llama embed_tokens, DistilBERT *_embeddings): matrices
# that take no weight decay under ``decay="matrices"``.
EMBEDDING_NAMES = ("wte.weight", "wpe.weight", "embed_tokens.weight", "_embeddings.weight")


def decays(name: str, shape: tuple[int, ...], rule: str = "all") -> bool:
    """Whether the weight decay applies to the parameter ``name`` of ``shape``: under ``all``
    every trained tensor; under ``matrices`` tensors of 2 or more dimensions that are not
    embedding tables (norm weights and biases are 1-d; a LoRA A/B is a matrix)."""
    if rule == "all":
        return True
    return len(shape) >= 2 and not name.endswith(EMBEDDING_NAMES)


def step_size(lr: float, t: int, cfg: AdamWConfig) -> float:
    """The effective step size of update ``t`` (1-based)."""
    if not cfg.correct_bias:
        return lr
    b1, b2 = cfg.betas
    return lr * math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)


def adamw_reference(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, lr: float,
                    cfg: AdamWConfig, decay: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One update in float64: returns the new ``(p, m, v)``; ``decay``: :func:`decays` of ``p``."""
    b1, b2 = cfg.betas
    p, g = p.astype(np.float64), g.astype(np.float64)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - step_size(lr, t, cfg) * m / (np.sqrt(v) + cfg.eps)
    if cfg.weight_decay > 0 and decay:
        p = p - lr * cfg.weight_decay * p
    return p, m, v


def pack_state(m: dict[str, np.ndarray], v: dict[str, np.ndarray], t: int) -> dict[str, np.ndarray]:
    """Optimizer state as one flat numpy dict (``m.<name>``, ``v.<name>``, ``t``) for checkpoints."""
    out = {f"m.{n}": a for n, a in m.items()}
    out.update({f"v.{n}": a for n, a in v.items()})
    out["t"] = np.array(t, dtype=np.int64)
    return out


def unpack_state(names, state: dict[str, np.ndarray]) -> tuple[dict, dict, int]:
    """Inverse of ``pack_state`` for the parameters ``names``; refuses missing or extra keys."""
    expected = {f"{k}.{n}" for n in names for k in ("m", "v")} | {"t"}
    if set(state) != expected:
        raise ValueError(f"optimizer state keys differ: missing {sorted(expected - set(state))}, "
                         f"unexpected {sorted(set(state) - expected)}")
    return {n: state[f"m.{n}"] for n in names}, {n: state[f"v.{n}"] for n in names}, int(state["t"])
