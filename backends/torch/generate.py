"""Batched beam search with KV cache for PyTorch: the tensor primitives for
``lora_core.beam.run_beam_search`` (all bookkeeping lives there).

Contract (same in every backend): ``beam_search(model, contexts, cfg, batch_size=8,
progress=False) -> list[list[int]]`` (generated tokens per context).
"""

from __future__ import annotations

import contextlib

import torch

from lora_core.beam import BeamConfig, beam_search_batched

from .model import KVCache
from .precision import autocast


def _forward(model):
    @torch.no_grad()
    def forward(ids, past, mask):
        with autocast(model):
            h, past = model.hidden(torch.from_numpy(ids), past=past, attention_mask=mask)
            logits = model.lm_logits(h[:, -1])
        return logits.float().cpu().numpy(), past
    return forward


def _repeat_rows(past, n):
    return KVCache(past, n)


def _reorder(cache, rows):
    cache.reorder(rows)
    return cache


def beam_search(model, contexts: list, cfg: BeamConfig = BeamConfig(), batch_size: int = 8,
                progress: bool = False) -> list:
    """Beam-decode every context (token ids); inputs are processed ``batch_size`` at a time."""
    model.eval()
    exact = getattr(model, "precision", "fp32") == "fp32"  # the packed decoding weights are float32-only
    with model.decoding(rows=batch_size * cfg.beam) if exact else contextlib.nullcontext():
        return beam_search_batched(_forward(model), _repeat_rows, _reorder, contexts, cfg, batch_size, progress)


__all__ = ["BeamConfig", "beam_search"]
