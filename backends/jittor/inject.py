"""LoRA for any ``jittor.nn.Module``: injection, the trainable set and adapter files; contract
and docs as in ``backends.torch.inject`` (spec in ``lora_core.lora.targeting`` / ``injection`` /
``adapter_io``). The layers are ``backends.jittor.lora``'s, holding the replaced module's
own weight and bias Vars.
"""

from __future__ import annotations

import os

import jittor as jt
import numpy as np
from jittor import nn

from lora_core.formats import adapter_io
from lora_core.lora.injection import describe_module, inject, require_injection
from lora_core.lora.targeting import LayerPlan

from ._gpu_check import ensure_gpu_ok
from .lora import LoRAEmbedding, LoRALinear, LoRAMergedLinear, assign_keep_grad
from .quant import LoRALinear4bit


class _FanInFanOut:
    """GPT-2 ``Conv1D`` layout (weight (in, out), ``y = x W + b``); the LoRA pair keeps the
    Linear layout, so the update is transposed (peft ``fan_in_fan_out``)."""

    def execute(self, x: jt.Var) -> jt.Var:
        y = jt.matmul(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        if self.r and not self.merged:
            y = self._lora_out(x, y)
        return y

    def delta_weight(self) -> jt.Var:
        return super().delta_weight().transpose()


class LoRAConv1D(_FanInFanOut, LoRALinear):
    """``LoRALinear`` on a GPT-2 ``Conv1D``-style weight (in, out)."""


class LoRAMergedConv1D(_FanInFanOut, LoRAMergedLinear):
    """``LoRAMergedLinear`` (per-slice LoRA) on a ``Conv1D``-style weight (in, out)."""


def _lora_kind(m: nn.Module) -> str | None:
    if isinstance(m, (LoRAConv1D, LoRAMergedConv1D)):
        return "conv1d"
    return "embedding" if isinstance(m, LoRAEmbedding) else "linear" if isinstance(m, LoRALinear) else None


def _plain_kind(m: nn.Module) -> str | None:
    if type(m) in (nn.Embedding, LoRAEmbedding):
        return "embedding"
    if type(m) in (nn.Linear, LoRALinear, LoRALinear4bit):
        return "linear"
    if type(m).__name__ == "Conv1D" and hasattr(m, "nf") and len(m.weight.shape) == 2:  # an HF-style port
        return "conv1d"
    return None


def _describe(m: nn.Module, adapted_ok: bool = False):
    """``lora_core.lora.injection.describe_module`` with this backend's layer classes."""
    return describe_module(m, _lora_kind, _plain_kind, adapted_ok)


def _set_child(parent: nn.Module, child: str, new: nn.Module) -> None:
    if isinstance(parent, nn.Sequential):  # also jittor's ModuleList: children live in .layers
        key = next(k for k in parent.layers if str(k) == child)
        parent.layers[key] = new
    else:
        setattr(parent, child, new)


def _replace(parent: nn.Module, child: str, old: nn.Module, plan: LayerPlan, values, dropout: float) -> None:
    if isinstance(old, LoRALinear4bit):  # a QLoRA base layer keeps its 4-bit weight: LoRA goes on in place
        old.add_lora(plan.r, plan.scaling, dropout, values, plan.enable)
        return
    bias = getattr(old, "bias", None) is not None
    if plan.kind == "embedding":
        new = LoRAEmbedding(plan.in_features, plan.out_features, plan.r, plan.alpha, getattr(old, "padding_idx", None),
                            getattr(old, "scale_grad_by_freq", False))
    elif plan.enable is not None:
        cls = LoRAMergedConv1D if plan.kind == "conv1d" else LoRAMergedLinear
        new = cls(plan.in_features, plan.out_features, plan.r, plan.alpha, dropout, plan.enable, bias)
    else:
        cls = LoRAConv1D if plan.kind == "conv1d" else LoRALinear
        new = cls(plan.in_features, plan.out_features, plan.r, plan.alpha, dropout, bias)
    new.weight = old.weight
    new.bias = old.bias if bias else None
    new.lora_A = jt.array(values[0]).cast(old.weight.dtype)
    new.lora_B = jt.array(values[1]).cast(old.weight.dtype)
    new.scaling = plan.scaling
    new.is_train = old.is_training()
    _set_child(parent, child, new)


def inject_lora(model: nn.Module, config) -> list[str]:
    """Put LoRA on the modules ``config`` targets and freeze all but what it trains."""
    ensure_gpu_ok()
    inj = inject(model, config, _describe, _replace, match_prefix="")
    mark_only_lora_trainable(model)
    return list(inj.plans)


def mark_only_lora_trainable(model: nn.Module) -> None:
    """Train exactly what the injected config trains (LoRA, its biases, ``modules_to_save``).
    jittor's ``eval()``/``train()`` remember trainability once: that memory is reset here."""
    inj = require_injection(model)
    names = set(inj.trainable(n for n, _ in model.named_parameters()))
    for n, p in model.named_parameters():
        p.requires_grad = n in names
    for m in model.modules():
        if hasattr(m, "backup_grad_state"):
            del m.backup_grad_state


def save_lora_adapter(
    model: nn.Module, path: str | os.PathLike, format: str = "lora_core", base: str | None = None
) -> None:
    """Save the adapter of an injected model (``"lora_core"`` or ``"peft"`` format)."""
    adapter_io.save_model_adapter(model, path, _describe, lambda p: p.numpy().astype(np.float32), format, base)


def load_lora_adapter(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Load an adapter folder (ours or peft's) into ``model`` (injecting its config first if
    needed); strict. Returns the adapted module names."""
    inj, tensors = adapter_io.load_model_adapter(model, path, _describe, _replace, mark_only_lora_trainable)
    params = dict(model.named_parameters())
    for n, v in tensors.items():
        assign_keep_grad(params[n], jt.array(np.ascontiguousarray(v)).cast(params[n].dtype))
    return list(inj.plans)


__all__ = [
    "LoRAConv1D",
    "LoRAMergedConv1D",
    "inject_lora",
    "load_lora_adapter",
    "mark_only_lora_trainable",
    "save_lora_adapter",
]
