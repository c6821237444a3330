"""Batched beam search with KV cache for Jittor: tensor primitives for
``lora_core.generate.beam.run_beam_search``; contract in ``backends.torch.generate``."""

from __future__ import annotations

import jittor as jt

from lora_core.data.batching import check_prompts
from lora_core.generate.beam import BeamConfig, beam_search_batched
from lora_core.generate.beam_scoring import TIE_MARGIN, Candidates, LogitEdits, resolve_topk, scoring_on_device
from lora_core.generate.static_cache import decode_step_captured

from .gpt2 import KVCache


class DeviceLogits:
    """Next-token logits left on jittor's device for device scoring (contract in
    ``backends.torch.generate.DeviceLogits``)."""

    def __init__(self, logits: jt.Var):
        self.logits, self.shape = logits, tuple(logits.shape)

    def repeat_rows(self, n: int) -> DeviceLogits:
        return DeviceLogits(self.logits.repeat_interleave(n, 0))

    def candidates(self, edits: LogitEdits, kk: int) -> Candidates:
        x = self.logits
        if len(edits.pen_rows):
            at = (jt.array(edits.pen_rows), jt.array(edits.pen_cols))
            s = x[at]
            x[at] = jt.where(s < 0, s * edits.penalty, s / edits.penalty)
        if len(edits.ban_rows):
            x[jt.array(edits.ban_rows), jt.array(edits.ban_cols)] = float("-inf")
        vals, cols = jt.topk(x, min(kk + TIE_MARGIN, x.shape[1]), dim=-1)
        lse = x.logsumexp(-1)
        jt.sync([vals, cols, lse])
        return resolve_topk(vals.numpy(), cols.numpy(), lse.numpy(), kk, lambda rows: x[jt.array(rows)].numpy())


def _forward(model, on_device: bool):
    def forward(ids, past, mask):
        with jt.no_grad():
            h, past = model.hidden(ids, past=past, attention_mask=mask)
            logits = model.lm_logits(h[:, -1])
            jt.sync([logits] + [t for kv in (past.generated if isinstance(past, KVCache) else past) for t in kv])
            return (DeviceLogits(logits) if on_device else logits.numpy()), past
    return forward


def _repeat_rows(past, n, mask):
    return KVCache(past, n)


def _reorder(cache, rows):
    cache.reorder(rows)
    jt.gc()  # the cache grows every step: without this the allocator keeps a block per size (5.3 -> 2.9 GB)
    return cache


def beam_search(model, contexts: list, cfg: BeamConfig = BeamConfig(), batch_size: int = 8,
                progress: bool = False, scoring: str = "auto", decode_step: str = "auto") -> list:
    """Beam-decode every context (token ids); inputs are processed ``batch_size`` at a time;
    ``scoring`` as in ``backends.torch.generate.beam_search``. ``decode_step``: "auto" or
    "eager" (jittor has no graph capture: "captured" raises ``ValueError``; its JIT already
    fuses and compiles each step's ops, cached per shape)."""
    check_prompts(contexts, model.config.vocab_size)  # jittor's lookup checks nothing: refused here, as torch
    on_device = scoring_on_device(scoring, bool(jt.flags.use_cuda))
    decode_step_captured(decode_step, bool(jt.flags.use_cuda), "jittor", False)  # validates the choice
    model.eval()
    with model.decoding(rows=batch_size * cfg.beam):
        return beam_search_batched(_forward(model, on_device), _repeat_rows, _reorder, contexts, cfg, batch_size,
                                   progress)


__all__ = ["BeamConfig", "DeviceLogits", "beam_search"]
