"""Captured training step for PyTorch: ``torch.compile`` of the per-micro-batch forward pass
and loss, on shapes padded to the buckets of ``lora_core.train.buckets`` (so they repeat).

Contract (same in every backend): ``set_compile(model, enabled=True)``; with it,
``train_step`` runs each micro-batch's forward pass and loss through one compiled graph per
bucket (the backward pass is compiled with it); results match the eager step up to float
rounding. Evaluation and decoding stay eager; the data-parallel step refuses a compiled model.
"""

from __future__ import annotations

import torch
from torch._dynamo.backends.registry import lookup_backend

from lora_core.data.batching import check_token_ids
from lora_core.train.buckets import bucket_shape, pad_to_bucket
from lora_core.train.tasks import max_positions

from .lora import LoRALinear
from .precision import autocast

# Compilations allowed beyond one per bucket met (dynamo's default limit): a switch between
# train and eval mode, a change of dropout layout. dynamo's own limits (8 per function, 256 in
# all) are too few for the buckets of a run (DART at batch 8: 95 over its 5 epochs), and with
# fullgraph=True going past them is a hard FailOnRecompileLimitHit, not a fall-back to eager.
RECOMPILE_HEADROOM = 8
_buckets_met = 0  # by every CompiledLoss of the process (they share _bucket_loss's compile cache)


def _allow_compiles(n: int) -> None:
    """Raise dynamo's recompile limits (per function and in all) to at least ``n``."""
    config = torch._dynamo.config
    names = ("recompile_limit", "accumulated_recompile_limit") if hasattr(config, "recompile_limit") else \
        ("cache_size_limit", "accumulated_cache_size_limit")
    for name in names:
        setattr(config, name, max(getattr(config, name), n))


class _FixedMask:
    """A parity-mode dropout mask drawn before the compiled call (numpy cannot be traced),
    given to one LoRA layer inside it; the same each time it is asked (so activation
    checkpointing's recomputation needs no replay: ``fixed``)."""

    fixed = True

    def __init__(self):
        self.m = None

    def mask(self, shape: tuple[int, ...], p: float) -> torch.Tensor:
        if tuple(self.m.shape) != tuple(shape):
            raise RuntimeError(f"compiled step: a LoRA layer asked for a mask of shape {tuple(shape)}, "
                               f"drawn {tuple(self.m.shape)}")
        return self.m


def _bucket_loss(model, holders, masks, ids, tok, pad, loss_index, targets, weight, label_smooth: float):
    from .train import _token_nll  # (train imports this module)

    for h, m in zip(holders, masks):
        h.m = m
    with autocast(model):
        hidden = model.hidden_unpadded(ids, tok, pad).index_select(0, loss_index)
        nll = _token_nll(model.lm_logits(hidden), targets, label_smooth)
    return (nll * weight).sum() / weight.sum()


class CompiledLoss:
    """``lm_loss`` through ``torch.compile`` (``backend``: a dynamo backend name, ``inductor``
    for real runs); ``graphs`` counts the compilations, ``buckets`` the shapes met. Each new
    bucket raises dynamo's recompile limits to the buckets met so far (in the process) plus
    ``RECOMPILE_HEADROOM``: the limit follows the buckets a run reaches, and still stops a
    step that recompiles within a bucket."""

    def __init__(self, backend: str = "inductor", length_multiple: int = 32):
        inner = lookup_backend(backend)
        self.backend, self.length_multiple, self.graphs, self.buckets = backend, length_multiple, 0, set()
        self.holders: list[_FixedMask] = []  # one per LoRA layer with parity dropout (kept: dynamo guards them)

        def counting(gm, example_inputs):
            self.graphs += 1
            return inner(gm, example_inputs)

        self.fn = torch.compile(_bucket_loss, backend=counting, fullgraph=True, dynamic=False)

    def __call__(self, model, batch: dict, label_smooth: float = 0.0) -> torch.Tensor:
        global _buckets_met
        for key, what in (("targets", "targets"), ("input_ids", "input ids")):  # host arrays, in lm_loss's order
            check_token_ids(batch[key], model.config.vocab_size, what)
        shape = bucket_shape(batch, max_positions(model), self.length_multiple)
        if shape not in self.buckets:
            self.buckets.add(shape)
            _buckets_met += 1
            _allow_compiles(_buckets_met + RECOMPILE_HEADROOM)
        padded = pad_to_bucket(batch, shape)
        dev = next(model.parameters()).device
        t = {k: torch.from_numpy(v).to(dev) for k, v in padded.items()}
        layers = _parity_layers(model)
        n = len(batch["token_index"])
        masks = tuple(_padded_mask(m.mask_source.mask((n, m.in_features), m.p), shape.tokens, dev) for m in layers)
        self.holders += [_FixedMask() for _ in range(len(layers) - len(self.holders))]
        holders = self.holders[: len(layers)]
        others = [m for m in model.modules() if getattr(m, "mask_source", None) is not None and m not in layers]
        sources = [m.mask_source for m in layers + others]
        for m, h in zip(layers + others, holders + [None] * len(others)):  # the others draw nothing
            m.mask_source = h
        try:
            loss = self.fn(model, holders, masks, t["input_ids"], t["token_index"], t["pad_index"],
                           t["packed_loss_index"], t["targets"], t["loss_weight"], float(label_smooth))
        finally:
            for m, src in zip(layers + others, sources):
                m.mask_source = src
            for h in holders:
                h.m = None
        return loss


def _parity_layers(model) -> list:
    """LoRA layers that draw a numpy dropout mask in a training forward pass, in forward order."""
    if not model.training:
        return []
    return [m for m in model.modules() if isinstance(m, LoRALinear) and m.r and not m.merged and m.p > 0
            and m.mask_source is not None]


def _padded_mask(mask, rows: int, dev) -> torch.Tensor:
    out = torch.zeros((rows, mask.shape[1]), dtype=torch.float32)
    out[: mask.shape[0]] = torch.from_numpy(mask)
    return out.to(dev)


def set_compile(model, enabled: bool = True, backend: str = "inductor") -> None:
    """Run ``train_step``'s forward passes and loss through ``torch.compile`` (one graph per
    shape bucket, ``lora_core.train.buckets``); ``backend``: the dynamo backend (``aot_eager``
    compiles fast, for tests). The same updates as eager up to float rounding where dropout is
    off or its masks come from numpy (``dropout_masks="numpy"``); the framework's dropout draws
    its masks inside the compiled graph, from another random stream than eager's (statistically
    the same run, not the same numbers).

    Raises:
        ValueError: ``backend`` is not one of dynamo's backends; the model has a 4-bit base
            (its bitsandbytes kernels are found and called through ctypes, which dynamo cannot
            trace)."""
    if enabled:
        known = sorted(torch._dynamo.list_backends(exclude_tags=()))
        if not isinstance(backend, str) or backend not in known:
            raise ValueError(f"--compile {backend!r}: not a torch.compile backend; choose from {known}")
        if any(getattr(m, "is_4bit", False) for m in model.modules()):
            raise ValueError("--compile with a 4-bit base (--quantize nf4) is not supported: its dequantization "
                             "calls bitsandbytes' kernels through ctypes, which torch.compile cannot trace; drop one")
    model.compiled_loss = CompiledLoss(backend) if enabled else None


__all__ = ["set_compile"]
