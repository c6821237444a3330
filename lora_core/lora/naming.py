"""LoRA parameter naming shared by every model family: the ``lora_`` mark (loralib), peft's
module matching, and what an adapter of a model holds."""

from __future__ import annotations

LORA_MARK = "lora_"


def matches_target(module: str, target: str) -> bool:
    """peft-style match: the full name or a dotted suffix (``c_proj`` matches both c_proj)."""
    return module == target or module.endswith("." + target)


def is_lora_name(name: str) -> bool:
    return LORA_MARK in name


def count_parameters(shapes: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for s in shapes.values():
        n = 1
        for d in s:
            n *= d
        total += n
    return total


def adapter_names(model) -> set[str]:
    """What an adapter of ``model`` holds: for a model with injected LoRA what its config
    trains; else names from its configs if it has them (``model.config``,
    ``model.lora_config``), else every ``lora_`` parameter name."""
    injected = getattr(model, "lora_injection", None)  # set by inject_lora (lora_core.lora.injection)
    if injected is not None:
        return set(injected.trainable(n for n, _ in model.named_parameters()))
    cfg, lora = getattr(model, "config", None), getattr(model, "lora_config", None)
    if cfg is not None and lora is not None:
        from ..models.gpt2 import trainable_names  # GPT-2's built-in LoRA

        return set(trainable_names(cfg, lora))
    return {n for n, _ in model.named_parameters() if LORA_MARK in n}
