"""LoRA for any ``torch.nn.Module`` (``transformers`` models included): injection, the
trainable set and adapter files. The spec (matching, plans, formats) is in
``lora_core.lora.targeting``, ``lora_core.lora.injection``, ``lora_core.formats.adapter_io``; the layers are
``backends.torch.lora``'s, holding the replaced module's own weight and bias parameters.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from lora_core.formats import adapter_io
from lora_core.lora.injection import describe_module, inject, require_injection
from lora_core.lora.targeting import LayerPlan

from .lora import LoRAEmbedding, LoRALinear, LoRAMergedLinear
from .quant import LoRALinear4bit


class _FanInFanOut:
    """GPT-2 ``Conv1D`` layout: weight (in, out), ``y = x W + b`` (``transformers.pytorch_utils.Conv1D``);
    the LoRA pair keeps the Linear layout, so the update is transposed (peft ``fan_in_fan_out``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.out_features,)
        flat = x.reshape(-1, x.shape[-1])
        y = (torch.addmm(self.bias, flat, self.weight) if self.bias is not None else flat @ self.weight).view(shape)
        if self.r and not self.merged:
            y = self._lora_out(x, y)
        return y

    def delta_weight(self) -> torch.Tensor:
        return super().delta_weight().t()


class LoRAConv1D(_FanInFanOut, LoRALinear):
    """``LoRALinear`` on a GPT-2 ``Conv1D`` weight (in, out)."""


class LoRAMergedConv1D(_FanInFanOut, LoRAMergedLinear):
    """``LoRAMergedLinear`` (per-slice LoRA) on a GPT-2 ``Conv1D`` weight (in, out)."""


def _lora_kind(m: nn.Module) -> str | None:
    if isinstance(m, (LoRAConv1D, LoRAMergedConv1D)):
        return "conv1d"
    return "embedding" if isinstance(m, LoRAEmbedding) else "linear" if isinstance(m, LoRALinear) else None


def _plain_kind(m: nn.Module) -> str | None:
    # exact types, as for Linear: a subclass (BART's scaled embedding, OPT's learned positions) has
    # a forward of its own that LoRAEmbedding would not run
    if isinstance(m, LoRAEmbedding) or (type(m) is nn.Embedding and m.max_norm is None and not m.sparse):
        return "embedding"
    if type(m) in (nn.Linear, LoRALinear, LoRALinear4bit):
        return "linear"
    if type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers") and m.weight.dim() == 2:
        return "conv1d"
    return None


def _describe(m: nn.Module, adapted_ok: bool = False):
    """``lora_core.lora.injection.describe_module`` with this backend's layer classes."""
    if type(m) is nn.Embedding and (m.max_norm is not None or m.sparse):  # what the refusal names
        return f"Embedding with {'max_norm (its rows renormalised in place)' if m.max_norm is not None else 'sparse=True'}"
    return describe_module(m, _lora_kind, _plain_kind, adapted_ok)


def _replace(parent: nn.Module, child: str, old: nn.Module, plan: LayerPlan, values, dropout: float) -> None:
    if isinstance(old, LoRALinear4bit):  # a QLoRA base layer keeps its 4-bit weight: LoRA goes on in place
        old.add_lora(plan.r, plan.scaling, dropout, values, plan.enable)
        return
    w = old.weight
    bias = getattr(old, "bias", None) is not None
    with torch.device("meta"):  # no throw-away allocation of the base-sized weight
        if plan.kind == "embedding":
            new = LoRAEmbedding(plan.in_features, plan.out_features, plan.r, plan.alpha, getattr(old, "padding_idx", None),
                                getattr(old, "scale_grad_by_freq", False))
        elif plan.enable is not None:
            cls = LoRAMergedConv1D if plan.kind == "conv1d" else LoRAMergedLinear
            new = cls(plan.in_features, plan.out_features, plan.r, plan.alpha, dropout, plan.enable, bias)
        else:
            cls = LoRAConv1D if plan.kind == "conv1d" else LoRALinear
            new = cls(plan.in_features, plan.out_features, plan.r, plan.alpha, dropout, bias)
    new.weight = w
    if bias:
        new.bias = old.bias
    new.lora_A = nn.Parameter(torch.from_numpy(values[0]).to(device=w.device, dtype=w.dtype))
    new.lora_B = nn.Parameter(torch.from_numpy(values[1]).to(device=w.device, dtype=w.dtype))
    new.scaling = plan.scaling
    new.train(old.training)
    setattr(parent, child, new)


def inject_lora(model: nn.Module, config) -> list[str]:
    """Put LoRA on the modules ``config`` targets and freeze all but what it trains.

    Args:
        model: any module (a ``transformers`` model, ``GPT2LMModel(cfg)``, ...).
        config: a ``lora_core.LoRATargetConfig`` (or GPT-2's ``LoRAConfig``).

    Returns:
        The adapted module names, in module order.

    Raises:
        lora_core.lora.targeting.TargetError: listing patterns that matched no module, or
            naming a target of a kind LoRA cannot adapt.
    """
    inj = inject(model, config, _describe, _replace, match_prefix="")
    mark_only_lora_trainable(model)
    return list(inj.plans)


def mark_only_lora_trainable(model: nn.Module) -> None:
    """Train exactly what the injected config trains (LoRA, its biases, ``modules_to_save``)."""
    inj = require_injection(model)
    names = set(inj.trainable(n for n, _ in model.named_parameters()))
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)


def save_lora_adapter(
    model: nn.Module, path: str | os.PathLike, format: str = "lora_core", base: str | None = None
) -> None:
    """Save the adapter of an injected model: ``format="lora_core"`` or ``"peft"`` (loadable
    by ``peft.PeftModel.from_pretrained`` on the matching ``transformers`` model)."""
    adapter_io.save_model_adapter(model, path, _describe, lambda p: p.detach().cpu().float().numpy(), format, base)


def load_lora_adapter(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Load an adapter folder (ours or peft's) into ``model``, injecting its config first
    if the model has none; strict. Returns the adapted module names."""
    inj, tensors = adapter_io.load_model_adapter(model, path, _describe, _replace, mark_only_lora_trainable)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, v in tensors.items():
            params[n].copy_(torch.from_numpy(np.ascontiguousarray(v)).to(params[n].dtype))
    return list(inj.plans)


__all__ = [
    "LoRAConv1D",
    "LoRAMergedConv1D",
    "inject_lora",
    "load_lora_adapter",
    "mark_only_lora_trainable",
    "save_lora_adapter",
]
