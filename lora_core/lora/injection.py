"""``inject_lora`` for any model, the part that touches no tensors (both backends call it).

The backend supplies two functions: ``describe(module)``, giving ``(kind, in, out)`` for a
module LoRA can adapt (kinds of ``lora_core.lora.targeting.LAYER_KINDS``) or the module's type
name otherwise, and ``replace(parent, child_name, old, plan, values, dropout)``, which puts
the backend's LoRA layer (holding ``old``'s weight and bias, not copies) in ``old``'s place
with the numpy ``values`` of ``lora_A`` / ``lora_B``. The result is recorded on the model as
``model.lora_injection`` (an :class:`Injection`), which ``lora_state_dict``, the trainable
set and the adapter formats read. Canonical parameter names are the module paths
(``distilbert.transformer.layer.0.attention.q_lin.lora_A``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.gpt2 import LoRAConfig
from .targeting import (
    LayerPlan,
    LoRATargetConfig,
    TargetError,
    in_saved_module,
    init_lora_arrays,
    plan_injection,
    trainable_names,
)

RECORD = "lora_injection"


@dataclass
class Injection:
    """What ``inject_lora`` did to a model: its config and one plan per adapted module."""

    config: LoRATargetConfig
    plans: dict[str, LayerPlan]
    match_prefix: str = ""  # patterns were matched against match_prefix + module name

    def trainable(self, param_names) -> list[str]:
        """The parameters that train and that an adapter holds, in the given order."""
        return trainable_names(list(param_names), self.plans, self.config, self.match_prefix)

    def refuse_frozen_saved(self, frozen_modules) -> None:
        """``modules_to_save`` trains whole modules; one whose weight is stored frozen (a 4-bit
        layer: packed codes, not a parameter) would train only its bias, silently: TargetError
        naming the modules. ``frozen_modules``: the names of the model's modules of that kind."""
        bad = [n for n in frozen_modules if in_saved_module(self.match_prefix + n + ".weight", self.config.modules_to_save)]
        if bad:
            raise TargetError(
                f"modules_to_save {self.config.modules_to_save!r} matches 4-bit layer(s) {bad}: their weights are "
                "frozen NF4 codes and cannot train (load the base with these modules unquantized, e.g. a 4-bit "
                "checkpoint with them in llm_int8_skip_modules, or leave them out of modules_to_save)")

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        out = {}
        for plan in self.plans.values():
            out.update(plan.shapes())
        return out


def layer_description(kind: str, weight_shape) -> tuple[str, int, int]:
    """``(kind, in, out)`` from a weight's shape: Linear (out, in), GPT-2 ``Conv1D`` (in, out),
    Embedding (num_embeddings, dim), the frameworks' own layouts."""
    a, b = (int(d) for d in weight_shape)
    return (kind, b, a) if kind == "linear" else (kind, a, b)


def describe_module(m, lora_kind, plain_kind, adapted_ok: bool = False):
    """The backends' ``describe``: ``(kind, in, out)`` of a module LoRA can adapt, else a
    string (its type name, or why it cannot be adapted again).

    ``lora_kind(m)``: the base kind of one of the backend's LoRA layers (any ``r``), else
    None. ``plain_kind(m)``: the kind of a framework layer that LoRA can adapt (the backend
    decides which of its ``r = 0`` LoRA layers count), else None. ``adapted_ok``: a layer that
    already has LoRA is described by its base kind (reading an injection back) instead of
    being refused."""
    kind = lora_kind(m)
    if kind is not None and adapted_ok:
        return layer_description(kind, weight_shape(m))
    if kind is not None and m.r:
        return f"{type(m).__name__} already adapted (r={m.r})"
    kind = plain_kind(m)
    return type(m).__name__ if kind is None else layer_description(kind, weight_shape(m))


def weight_shape(m) -> tuple[int, ...]:
    """A layer's weight shape; a 4-bit layer's (its ``packed`` codes) read off without dequantizing it."""
    return tuple(m.shape) if hasattr(m, "packed") else tuple(m.weight.shape)


def as_target_config(config: LoRATargetConfig | LoRAConfig) -> LoRATargetConfig:
    """A GPT-2 ``LoRAConfig`` is accepted too (same modules, same per-slice ``c_attn``)."""
    if isinstance(config, LoRATargetConfig):
        return config
    if isinstance(config, LoRAConfig):
        if config.r == 0:
            raise TargetError("LoRAConfig.r is 0: nothing to inject")
        return LoRATargetConfig.from_gpt2(config)
    raise TypeError(f"inject_lora: config must be a LoRATargetConfig or LoRAConfig, got {type(config).__name__}")


def injection_of(model) -> Injection | None:
    return getattr(model, RECORD, None)


def require_injection(model) -> Injection:
    inj = injection_of(model)
    if inj is None:
        raise TargetError(f"{type(model).__name__} has no injected LoRA: call inject_lora(model, config) first")
    return inj


def record_of(model, describe_adapted) -> Injection:
    """``model.lora_injection``, or for a GPT-2 built with LoRA (``model.lora_config``, the
    built-in per-slice layers) the equivalent record, so that its adapter can be saved in
    either format. ``describe_adapted`` describes LoRA layers by their base kind."""
    inj = injection_of(model)
    lora = getattr(model, "lora_config", None)
    if inj is not None or not isinstance(lora, LoRAConfig) or not lora.r:
        return require_injection(model)
    cfg = LoRATargetConfig.from_gpt2(lora)
    return Injection(cfg, plan_injection({n: describe_adapted(m) for n, m in model.named_modules()}, cfg))


def plan(model, config, describe, match_prefix: str = "") -> Injection:
    """What ``inject`` would do (``plan_injection``, which raises on patterns matching
    nothing), without touching the model."""
    cfg = as_target_config(config)
    if injection_of(model) is not None:
        raise TargetError(
            f"{type(model).__name__} already has injected LoRA ({len(injection_of(model).plans)} "
            f"modules); inject once per model"
        )
    try:
        plans = plan_injection({n: describe(m) for n, m in model.named_modules()}, cfg, match_prefix)
    except TargetError as e:
        tied = getattr(model, "tied_embedding", None)
        if tied and "'lm_head'" in str(e) and "lm_head" not in dict(model.named_modules()):
            raise TargetError(f"{e} (this model's LM head is tied to {tied}: it reads that table and has no "
                              f"lm_head module of its own to adapt)") from None  # fmt: skip
        raise
    return Injection(cfg, plans, match_prefix)


def apply(model, record: Injection, replace, b_std: float = 0.0) -> Injection:
    """Replace every planned module, with seeded initial values (``init_lora_arrays``); what
    would be refused after (a 4-bit layer in ``modules_to_save``) is refused first, the model
    unchanged."""
    record.refuse_frozen_saved([n for n, m in model.named_modules() if getattr(m, "is_4bit", False)])
    modules = dict(model.named_modules())
    values = init_lora_arrays(record.plans, record.config.seed, b_std)
    for name, p in record.plans.items():
        parent, _, child = name.rpartition(".")
        a_name, b_name = p.shapes()
        replace(modules[parent], child, modules[name], p, (values[a_name], values[b_name]), record.config.dropout)
    setattr(model, RECORD, record)
    return record


def inject(model, config, describe, replace, b_std: float = 0.0, match_prefix: str = "") -> Injection:
    """``plan`` then ``apply``."""
    return apply(model, plan(model, config, describe, match_prefix), replace, b_std)


__all__ = [
    "Injection",
    "RECORD",
    "apply",
    "as_target_config",
    "inject",
    "injection_of",
    "plan",
    "record_of",
    "require_injection",
]
