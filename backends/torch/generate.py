"""Batched beam search with KV cache for PyTorch: the tensor primitives for
``lora_core.generate.beam.run_beam_search`` (all bookkeeping lives there).

Contract (same in every backend): ``beam_search(model, contexts, cfg, batch_size=8,
progress=False, scoring="auto", decode_step="auto") -> list[list[int]]`` (generated tokens
per context).
"""

from __future__ import annotations

import contextlib

import torch

from lora_core.data.batching import check_prompts
from lora_core.generate.beam import BeamConfig, beam_search_batched
from lora_core.generate.beam_scoring import TIE_MARGIN, Candidates, LogitEdits, resolve_topk, scoring_on_device
from lora_core.generate.static_cache import decode_step_captured

from ._captured_decode import StaticDecoder, StaticKVCache
from .gpt2 import KVCache
from .precision import autocast


class DeviceLogits:
    """Next-token logits (rows, V) left on the model's device for device scoring
    (``lora_core.generate.beam_scoring``): post-processing, log-sum-exp and each row's top
    ``kk + TIE_MARGIN`` happen there; only those come to the host."""

    def __init__(self, logits: torch.Tensor):
        self.logits, self.shape = logits, tuple(logits.shape)

    def repeat_rows(self, n: int) -> DeviceLogits:
        return DeviceLogits(self.logits.repeat_interleave(n, 0))

    def candidates(self, edits: LogitEdits, kk: int) -> Candidates:
        x, dev = self.logits, self.logits.device
        if len(edits.pen_rows):
            at = (torch.from_numpy(edits.pen_rows).to(dev), torch.from_numpy(edits.pen_cols).to(dev))
            s = x[at]
            x[at] = torch.where(s < 0, s * edits.penalty, s / edits.penalty)
        if len(edits.ban_rows):
            x[torch.from_numpy(edits.ban_rows).to(dev), torch.from_numpy(edits.ban_cols).to(dev)] = float("-inf")
        vals, cols = torch.topk(x, min(kk + TIE_MARGIN, x.shape[1]), dim=-1)
        lse = torch.logsumexp(x, dim=-1)
        return resolve_topk(vals.cpu().numpy(), cols.cpu().numpy(), lse.cpu().numpy(), kk,
                            lambda rows: x[torch.from_numpy(rows).to(dev)].cpu().numpy())


def _forward(model, on_device: bool, static: StaticDecoder | None):
    @torch.no_grad()
    def forward(ids, past, mask):
        if isinstance(past, StaticKVCache):
            logits = static.step(past, ids[:, -1])
        else:
            with autocast(model):
                h, past = model.hidden(torch.from_numpy(ids), past=past, attention_mask=mask)
                logits = model.lm_logits(h[:, -1]).float()
        return (DeviceLogits(logits) if on_device else logits.cpu().numpy()), past
    return forward


def _repeat_rows(static: StaticDecoder | None):
    """The prompt cache repeated beam-wise: a growing ``KVCache``, or the decoder's preallocated one."""
    return (lambda past, n, mask: KVCache(past, n)) if static is None else static.start


def _reorder(cache, rows):
    cache.reorder(rows)
    return cache


def beam_search(model, contexts: list, cfg: BeamConfig = BeamConfig(), batch_size: int = 8,
                progress: bool = False, scoring: str = "auto", decode_step: str = "auto") -> list:
    """Beam-decode every context (token ids); inputs are processed ``batch_size`` at a time.
    ``scoring``: where each step's logits are reduced (``lora_core.generate.beam_scoring``): "host"
    (numpy), "device" (the model's device, only candidates to the host) or "auto" (device
    on a GPU, host on the CPU, where numpy's ranking is the faster).
    ``decode_step``: "eager" (a growing cache, the step run op by op), "captured" (a
    preallocated cache reordered in place, the step recorded once per shape as a CUDA graph
    on a GPU; op by op on a CPU) or "auto" (captured on a GPU, eager on the CPU, where it is
    the faster); both decode the same beams."""
    check_prompts(contexts, model.config.vocab_size)  # ValueError naming the id, as every backend
    on_gpu = next(model.parameters()).device.type != "cpu"
    on_device = scoring_on_device(scoring, on_gpu)
    static = StaticDecoder(model, cfg.max_new_tokens) if decode_step_captured(decode_step, on_gpu, "torch", True) \
        else None
    model.eval()
    exact = getattr(model, "precision", "fp32") == "fp32"  # the packed decoding weights are float32-only
    with model.decoding(rows=batch_size * cfg.beam) if exact else contextlib.nullcontext():
        return beam_search_batched(_forward(model, on_device, static), _repeat_rows(static), _reorder, contexts, cfg,
                                   batch_size, progress)


__all__ = ["BeamConfig", "DeviceLogits", "beam_search"]
