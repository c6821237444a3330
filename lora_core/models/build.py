"""Model construction shared by the backends: weights come from the spec, the backend
supplies only its model class and its freezing function."""

from __future__ import annotations

from ..formats.adapter_io import is_injected_adapter
from ..formats.checkpoint import full_weights, resolve_pretrained
from ..lora.naming import is_lora_name


def build_model(model_cls, mark_trainable, cfg, lora=None, base=None, lora_weights=None, trainable=True):
    """Instantiate ``model_cls(cfg, lora)``, load ``base`` (+ LoRA values, seeded init by
    default) strictly, and, with ``trainable``, freeze all but LoRA (and ``lora.bias``)."""
    model = model_cls(cfg, lora)
    model.load_weights(full_weights(cfg, lora, base, lora_weights))
    if lora is not None and trainable:
        mark_trainable(model, lora.bias)
    return model


def from_pretrained(model_cls, mark_trainable, path, lora=None, adapter=None, trainable=True, load_injected=None):
    """A GPT-2 checkpoint (HF/OpenAI files or ``save_model`` output) plus an optional adapter.

    A peft adapter folder, or one saved from an injected model (``lora_core.formats.adapter_io``), is
    loaded by the backend's ``load_lora_adapter`` (``load_injected``) onto the base; the model
    then trains what that adapter's config trains."""
    if adapter is not None and is_injected_adapter(adapter):
        if lora is not None:
            raise ValueError(f"{adapter}: an adapter folder brings its own LoRA config; do not pass lora= too")
        if load_injected is None:
            raise ValueError(f"{adapter}: a peft / injected-model adapter needs the backend's load_lora_adapter")
        model = from_pretrained(model_cls, mark_trainable, path, None, None, trainable)
        load_injected(model, adapter)
        return model
    cfg, lora, tensors = resolve_pretrained(path, lora, adapter)
    base = {k: v for k, v in tensors.items() if not is_lora_name(k)}
    lora_w = {k: v for k, v in tensors.items() if is_lora_name(k)} or None
    return build_model(model_cls, mark_trainable, cfg, lora, base, lora_w, trainable)
