"""Seeded numpy initial values, so that both backends start from identical weights.

Base GPT-2: normal(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer) (GPT-2
paper, nanoGPT), zero biases, unit LayerNorm. LoRA (loralib ``reset_parameters``):
``lora_A`` kaiming-uniform(a=sqrt 5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
``lora_B`` zeros; for the embedding loralib swaps them (A zeros, B standard normal).
"""

from __future__ import annotations

import math

import numpy as np

from .config import GPT2Config, LoRAConfig
from .naming import base_shapes, lora_shapes


def init_gpt2_weights(cfg: GPT2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random GPT-2 weights (float32, canonical names, (out, in) layout)."""
    rng = np.random.default_rng(seed)
    std = cfg.initializer_range
    out = {}
    for name, shape in base_shapes(cfg).items():
        if name.startswith("ln") or ".ln_" in name:
            arr = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith(".bias"):
            arr = np.zeros(shape)
        else:
            s = std / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else std
            arr = rng.normal(0.0, s, size=shape)
        out[name] = arr.astype(np.float32)
    return out


def init_lora_weights(cfg: GPT2Config, lora: LoRAConfig, seed: int | None = None,
                      b_std: float = 0.0) -> dict[str, np.ndarray]:
    """LoRA initial values drawn from ``np.random.default_rng(seed or lora.seed)``.

    Args:
        b_std: if > 0, ``lora_B`` is drawn from normal(0, b_std) instead of zeros
            (tests use it so that the update is not zero).
    """
    rng = np.random.default_rng(lora.seed if seed is None else seed)
    out = {}
    for name, shape in lora_shapes(cfg, lora).items():
        is_embedding = name.startswith("wte.")
        if name.endswith("lora_A"):
            if is_embedding:
                arr = np.zeros(shape)
            else:
                bound = 1.0 / math.sqrt(shape[1])
                arr = rng.uniform(-bound, bound, size=shape)
        else:
            if is_embedding:
                arr = rng.normal(0.0, 1.0, size=shape)
            else:
                arr = rng.normal(0.0, b_std, size=shape) if b_std > 0 else np.zeros(shape)
        out[name] = arr.astype(np.float32)
    return out
