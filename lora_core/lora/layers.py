"""Model-wide LoRA switches shared by the backends (they only walk ``model.modules()``).

A LoRA layer is any module with ``r > 0`` and ``merge``/``unmerge`` methods (the backends'
``LoRALinear``, ``LoRAMergedLinear``, ``LoRAEmbedding``); peft-style explicit merging.
"""

from __future__ import annotations

from contextlib import contextmanager


def lora_layers(model) -> list:
    """The model's LoRA layers that have an update (``r > 0``), in module order."""
    return [m for m in model.modules() if getattr(m, "r", 0) and callable(getattr(m, "merge", None))]


def merge_lora(model) -> None:
    """Merge every LoRA layer of ``model`` into its weight (idempotent; outputs unchanged).

    Raises:
        ValueError: the LM head is tied to an embedding that has LoRA (a Llama-family model with
            ``tie_word_embeddings``): the merged update would reach the head as well, which
            unmerged reads the base table (as transformers + peft compute it), so the outputs
            would change; GPT-2's tied head adds the update itself, merged or not. Or a LoRA
            layer's weight is held by another module as well (a transformers model's tied
            ``lm_head`` and input embedding): merging would change that module's output."""
    layers = lora_layers(model)
    tied = getattr(model, "tied_embedding", None)  # ours: the embedding a tied head reads (transformers': shared)
    tied_module = dict(model.named_modules()).get(tied) if tied else None
    if tied_module is not None and not getattr(model, "tied_head_adds_lora", False) and any(
            m is tied_module for m in layers):  # fmt: skip
        raise ValueError(f"merge_lora: the LM head is tied to {tied}, which has LoRA: merging would change "
                         "the head too (other logits); keep the adapter unmerged, or adapt an untied model")
    shared = _shared_weights(model, layers)
    if shared:
        raise ValueError(f"merge_lora: {shared}: merging would write the update into the weight they share, "
                         "changing the other module's output too; keep the adapter unmerged, or untie the weights")
    for m in layers:
        m.merge()


def weight_sharers(model) -> list[list[tuple[str, object]]]:
    """The groups of ``model``'s modules that hold one weight tensor between them (a transformers
    model's ``lm_head`` tied to its input embedding), each as ``(name, module)`` pairs."""
    owners: dict[int, list[tuple[str, object]]] = {}
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if w is not None and not isinstance(w, (int, float)):
            owners.setdefault(id(w), []).append((name, m))
    return [group for group in owners.values() if len(group) > 1]


def _shared_weights(model, layers) -> str:
    """The LoRA layers whose weight another module of ``model`` holds too (``weight_sharers``),
    described, or ``""``."""
    ids = {id(m) for m in layers}
    return "; ".join(
        f"{', '.join(n for n, m in group if id(m) in ids)} (LoRA) shares its weight with "
        f"{', '.join(n for n, m in group if id(m) not in ids) or 'another LoRA layer'}"
        for group in weight_sharers(model) if any(id(m) in ids for _, m in group))  # fmt: skip


def unmerge_lora(model) -> None:
    """Undo ``merge_lora`` (idempotent)."""
    for m in lora_layers(model):
        m.unmerge()


def set_dropout_source(model, source) -> None:
    """Parity mode: dropout masks of every module that can take them (LoRA layers, the
    DistilBERT models' dropouts: modules with a ``mask_source``) come from ``source``
    (``lora_core.lora.dropout.NumpyDropout``); ``None`` goes back to the framework's dropout."""
    for m in model.modules():
        if hasattr(m, "mask_source"):
            m.mask_source = source


def _merged_is_a_copy(m) -> bool:
    """Whether ``m.merged_weight()`` makes a new weight: a LoRA update to add, or 4-bit codes to unpack."""
    return bool(getattr(m, "is_4bit", False) or (getattr(m, "r", 0) and not getattr(m, "merged", False)))


def _products_in_float32(m) -> bool:
    """Whether ``m``'s products run in float32 (a 4-bit layer with a bfloat16 compute dtype runs
    bitsandbytes' bfloat16 product: decoding leaves it to its own forward, so that decoding
    computes what the model's forward does)."""
    return getattr(m, "compute_dtype_name", "float32") == "float32"


@contextmanager
def decoding_weights(model, pack, no_grad, rows: int, concat=None):
    """The backends' ``model.decoding()``: inside the block every linear layer (a module with
    ``decode_weight``) and the LM head (``model.decode_head``; its weight is
    ``model.head_weight()``) use ``pack(merged_weight, rows)``,
    a framework-specific fast copy of their weight with the LoRA update added; both are reset
    on exit. The parameters are not touched. ``no_grad``: the framework's no-grad context.

    Fused products: with ``concat`` (the framework's concatenation along dim 0), each group of
    ``model.decode_groups()`` (``(owner, modules)``: layers that read the same input, e.g. an
    attention block's q, k and v) whose merged weights are copies anyway (a LoRA update added,
    a 4-bit weight unpacked) gets one packed weight of the rows stacked,
    ``owner.decode_fused = (packed, bias or None)``, and its layers none: one product instead
    of several (a frozen group keeps its own weights: stacking them would copy them)."""
    linears = [m for m in model.modules() if hasattr(m, "decode_weight") and _products_in_float32(m)]
    groups = model.decode_groups() if concat is not None and hasattr(model, "decode_groups") else []
    fused = []
    try:
        with no_grad():
            grouped = set()
            for owner, members in groups:
                biases = [m.bias for m in members]
                with_bias = sum(b is not None for b in biases)
                if (not any(map(_merged_is_a_copy, members)) or 0 < with_bias < len(members)
                        or not all(map(_products_in_float32, members))):
                    continue
                bias = concat(biases) if with_bias else None
                owner.decode_fused = (pack(concat([m.merged_weight() for m in members]), rows), bias)
                fused.append(owner)
                grouped.update(map(id, members))
            for m in linears:
                if id(m) not in grouped:
                    m.decode_weight = pack(m.merged_weight(), rows)
            model.decode_head = pack(model.head_weight(), rows)
        yield model
    finally:
        for m in linears:
            m.decode_weight = None
        for owner in fused:
            owner.decode_fused = None
        model.decode_head = None
