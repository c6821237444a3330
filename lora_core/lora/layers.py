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
    """Merge every LoRA layer of ``model`` into its weight (idempotent; outputs unchanged)."""
    for m in lora_layers(model):
        m.merge()


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


@contextmanager
def decoding_weights(model, pack, no_grad, rows: int):
    """The backends' ``model.decoding()``: inside the block every linear layer (a module with
    ``decode_weight``) and the LM head (``model.decode_head``; its weight is
    ``model.head_weight()``) use ``pack(merged_weight, rows)``,
    a framework-specific fast copy of their weight with the LoRA update added; both are reset
    on exit. The parameters are not touched. ``no_grad``: the framework's no-grad context."""
    linears = [m for m in model.modules() if hasattr(m, "decode_weight")]
    try:
        with no_grad():
            for m in linears:
                m.decode_weight = pack(m.merged_weight(), rows)
            model.decode_head = pack(model.head_weight(), rows)
        yield model
    finally:
        for m in linears:
            m.decode_weight = None
        model.decode_head = None
