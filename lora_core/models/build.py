"""Model construction shared by the backends: weights come from the spec, the backend
supplies only its model class and its freezing function."""

from __future__ import annotations

import functools

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


def in_eval_mode(load):
    """The backends' loaders (``from_pretrained``, ``llama_from_pretrained``,
    ``distilbert_from_pretrained``) return the model in evaluation mode, as transformers'
    ``from_pretrained`` does: dropout off, ``model(input_ids)`` deterministic. A training step
    puts it in training mode itself (``train_step``)."""

    @functools.wraps(load)
    def loader(*args, **kwargs):
        model = load(*args, **kwargs)
        model.eval()
        return model

    return loader


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


def checkpoint_family(path) -> str:
    """Which model family the checkpoint at ``path`` holds, from its ``config.json``'s
    ``model_type``: ``"llama"`` (llama, mistral, qwen2), ``"distilbert"``, else ``"gpt2"``
    (GPT-2's own files, OpenAI's, and ``save_model`` folders)."""
    from .llama import MODEL_TYPES, model_type_of

    if path is None:
        return "gpt2"
    mt = model_type_of(path)
    return "llama" if mt in MODEL_TYPES else "distilbert" if mt == "distilbert" else "gpt2"


def causal_lm_from_pretrained(model_cls, load_adapter, path, adapter=None):
    """The backends' ``llama_from_pretrained``: ``model_cls(cfg)`` (a backend's
    ``LlamaForCausalLM``) holding the checkpoint at ``path`` (memory-mapped, copied in one
    tensor at a time), then the adapter folder ``adapter`` (ours or peft's) through the
    backend's ``load_adapter(model, adapter)``, which freezes all but what it trains."""
    from .llama import load_llama_checkpoint

    cfg, tensors = load_llama_checkpoint(path)
    model = model_cls(cfg)
    model.load_weights(tensors)
    del tensors  # the maps: nothing of the file stays referenced
    if adapter is not None:
        load_adapter(model, adapter)
    return model


def pretrained_for_family(path, lora, adapter, family_loaders: dict):
    """Route ``from_pretrained`` to the family's loader (``family_loaders[family](path, adapter)``)
    when the checkpoint is not GPT-2's; returns None for GPT-2. A GPT-2 ``LoRAConfig``
    (``lora=``) is refused for other families (use ``inject_lora`` with a ``LoRATargetConfig``)."""
    family = checkpoint_family(path)
    if family == "gpt2":
        return None
    if lora is not None:
        raise ValueError(f"{path}: a {family} checkpoint; lora= (GPT-2's LoRAConfig) does not apply: pass "
                         f"adapter=, or call inject_lora(model, LoRATargetConfig(...)) on the loaded model")
    if family not in family_loaders:
        raise ValueError(f"{path}: a {family} checkpoint is not a causal LM: load it with {family}_from_pretrained")
    return family_loaders[family](path, adapter)


def quantized_causal_lm_from_pretrained(make_model, to_4bit, load_adapter, path, qcfg, adapter=None):
    """``causal_lm_from_pretrained`` with a 4-bit base (``lora_core.quant.qlora``): the model
    from ``make_model(cfg)`` (no weight memory committed yet), each projection's weight
    quantized from the memory map one at a time and handed to ``to_4bit(model, states, qcfg)``
    (the backend's 4-bit layers), the rest copied in; then the adapter."""
    from ..quant.qlora import quantize_while_loading
    from .llama import load_llama_checkpoint

    cfg, tensors = load_llama_checkpoint(path)
    model = make_model(cfg)
    states = quantize_while_loading(tensors, qcfg)
    to_4bit(model, states, qcfg)
    del states
    model.load_weights(tensors, partial=True)
    del tensors
    if adapter is not None:
        load_adapter(model, adapter)
    return model
