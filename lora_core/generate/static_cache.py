"""Layout of a preallocated beam-search cache, for a decode step of fixed shapes (one that
a backend can capture once and replay, e.g. as a CUDA graph). Imports neither torch nor jittor.

The cache of one batch (``B`` inputs, ``repeats`` beams each, ``R = B * repeats`` rows):

- the prompt part, once per input (B, n_head (a Llama's key/value heads), ``prompt_capacity(P)``, head_size): the
  left-padded prompt of ``P`` positions, then empty positions up to a multiple of
  ``PROMPT_MULTIPLE`` (so that batches of nearby prompt lengths share one shape);
- the generated part, per row (R, n_head, ``max_new_tokens``, head_size): generated step
  ``s`` (0-based) is written at slot ``s``; rows are reordered in place before each step.

``prompt_layout`` gives what the step reads besides the cache: the additive attention bias
over the prompt part (``MASK_VALUE`` at pads and empty slots) and each row's first
generated position id (its number of real prompt tokens: the position ids of
``lora_core.generate.masks.positions``). Attention over the generated part allows slots ``<= s``.
An empty slot's weight is exactly zero after the softmax, so the step computes what the
growing cache computes, up to the order of float additions.
"""

from __future__ import annotations

import numpy as np

from ..models import check_length
from .masks import MASK_VALUE

__all__ = ["DECODE_STEPS", "PROMPT_MULTIPLE", "check_room", "decode_step_captured", "kv_layout",
           "prompt_capacity", "prompt_layout"]

DECODE_STEPS = ("auto", "eager", "captured")
PROMPT_MULTIPLE = 32


def decode_step_captured(decode_step: str, on_gpu: bool, backend: str, can_capture: bool) -> bool:
    """Whether beam search runs its decode step on the preallocated cache, captured:
    ``decode_step`` "captured", or "auto" on a GPU of a backend that can capture ("eager":
    the growing cache, a step built op by op). Unknown choices, or "captured" where the
    backend cannot capture, raise ``ValueError``."""
    if decode_step not in DECODE_STEPS:
        raise ValueError(f"beam search: unknown decode_step {decode_step!r}; choose from {', '.join(DECODE_STEPS)}")
    if decode_step == "captured" and not can_capture:
        raise ValueError(f"beam search: decode_step 'captured' is not supported by the {backend} backend "
                         "(it has no graph capture; its JIT already compiles each step's fused ops); "
                         "use decode_step 'auto' or 'eager'")
    return can_capture and (decode_step == "captured" or (decode_step == "auto" and on_gpu))


def prompt_capacity(P: int, multiple: int = PROMPT_MULTIPLE) -> int:
    """Prompt slots for a left-padded prompt of ``P`` positions: ``P`` rounded up to ``multiple``."""
    if P < 1:
        raise ValueError(f"prompt_capacity: a prompt of {P} positions")
    return -(-P // multiple) * multiple


def prompt_layout(mask: np.ndarray, repeats: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """For a left-padded prompt mask (B, P) (1: real token): the additive bias over the prompt
    slots, float32 (B * repeats, 1, 1, capacity), and the position id of each row's first
    generated token, int64 (B * repeats, 1). Rows are input-major (``repeats`` per input)."""
    mask = np.asarray(mask, dtype=bool)
    B, P = mask.shape
    if capacity < P:
        raise ValueError(f"prompt_layout: {P} prompt positions do not fit {capacity} slots")
    allowed = np.zeros((B, capacity), dtype=bool)
    allowed[:, :P] = mask
    bias = np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)
    bias = np.repeat(bias, repeats, axis=0)[:, None, None, :]
    first = np.repeat(mask.sum(axis=1).astype(np.int64), repeats)[:, None]
    return bias, first


def kv_layout(cfg) -> tuple[int, int, int]:
    """(layers, key/value heads, head size) of a decoder's cache: GPT-2's config, or a Llama
    family's (grouped-query attention: ``num_key_value_heads`` heads of ``head_dim``)."""
    if hasattr(cfg, "num_key_value_heads"):
        return cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    return cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head


def check_room(P: int, step: int, cfg) -> None:
    """The growing cache's bound, kept by the preallocated one: generated step ``step`` (0-based)
    after a left-padded prompt of ``P`` positions makes a sequence of ``P + step + 1`` tokens,
    refused where the model's own check refuses it (``models.check_length``: GPT-2's
    ``n_positions``; a Llama family's ``max_position_embeddings``, ``sliding_window``)."""
    check_length(cfg, P + step + 1)
