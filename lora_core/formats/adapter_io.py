"""Adapters of injected models (``inject_lora``) on disk, in two formats, strict both ways.

- ``lora_core``: ``adapter_config.json`` (``{"lora_core_format": 1, "targets": ...}``) +
  ``adapter.safetensors`` keyed by canonical names (the module paths).
- ``peft``: ``adapter_config.json`` + ``adapter_model.safetensors`` in peft's layout
  (``lora_core.formats.peft_format``), loadable by ``peft.PeftModel.from_pretrained``.

Tensors pass through ``checkpoint.check_tensors`` (missing, unexpected and mis-shaped keys
listed in one ``CheckpointError`` naming the file) and the atomic writers of
``lora_core.formats.checkpoint``. Backends pass numpy arrays and the model's parameter shapes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np

from ..lora import injection
from ..lora.injection import Injection
from ..lora.layers import weight_sharers
from ..lora.targeting import LoRATargetConfig, TargetError, in_saved_module
from . import peft_format as pf
from .checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    FORMAT_VERSION,
    check_tensors,
    write_weights_and_config,
)
from .tensor_files import CheckpointError, read_json, read_tensors

AdapterFormat = Literal["lora_core", "peft"]


def expected_shapes(inj: Injection, param_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor an adapter of this model holds."""
    return {n: tuple(param_shapes[n]) for n in inj.trainable(param_shapes)}


def save(
    path: str | os.PathLike,
    inj: Injection,
    tensors: dict[str, np.ndarray],
    param_shapes: dict[str, tuple[int, ...]],
    format: AdapterFormat = "lora_core",
    module_prefix: str = "",
    base: str | None = None,
) -> None:
    """Write the adapter: ``tensors`` holds at least every name of ``expected_shapes``.

    Args:
        module_prefix: peft format only: the prefix the ``transformers`` model's module
            names have and ours lack (``"transformer."`` for our GPT-2).
        base: which base model it was trained on (peft: ``base_model_name_or_path``).
    """
    path = Path(path)
    expected = expected_shapes(inj, param_shapes)
    check_tensors(path, {k: v for k, v in tensors.items() if k in expected}, expected)
    if format == "lora_core":
        meta = {"lora_core_format": FORMAT_VERSION, "kind": "injected", "targets": inj.config.to_dict(), "base": base}
        if inj.match_prefix:  # the patterns name the modules with this prefix (a peft config loaded into ours)
            meta["match_prefix"] = inj.match_prefix
        write_weights_and_config(path, ADAPTER_WEIGHTS, {k: tensors[k] for k in expected}, None, ADAPTER_CONFIG, meta)
    elif format == "peft":
        cfg = inj.config
        # regexes match full names: they get the prefix unless they were matched with it already
        if inj.match_prefix == module_prefix:
            module_prefix_for_regex = ""
        elif inj.match_prefix:
            raise ValueError(
                f"patterns were matched with prefix {inj.match_prefix!r}, cannot save them for prefix {module_prefix!r}"
            )
        else:
            module_prefix_for_regex = module_prefix
        meta = pf.config_to_peft(cfg, inj.plans, module_prefix_for_regex, base)
        out = pf.tensors_to_peft({k: tensors[k] for k in expected}, inj.plans, module_prefix)
        write_weights_and_config(path, pf.PEFT_WEIGHTS, out, {"format": "pt"}, pf.PEFT_CONFIG, meta)
    else:
        raise ValueError(f"adapter format must be 'lora_core' or 'peft', got {format!r}")


def read_config(path: str | os.PathLike) -> tuple[LoRATargetConfig, AdapterFormat]:
    """The targeting config of an adapter folder of either format (peft's refusals apply)."""
    return _read_config(path)[:2]


def _read_config(path: str | os.PathLike) -> tuple[LoRATargetConfig, AdapterFormat, str | None]:
    """:func:`read_config` and, for our format, the prefix its patterns were matched with
    (None: a peft folder, whose patterns take the model's ``peft_module_prefix``)."""
    cfg_path = Path(path) / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no adapter config (is {path} an adapter folder?)")
    meta = read_json(cfg_path)
    if pf.is_peft_config(meta):
        return pf.config_from_peft(meta, cfg_path), "peft", None
    if meta.get("kind") != "injected" or "targets" not in meta:
        raise CheckpointError(
            f"{cfg_path}: not an adapter of an injected model (GPT-2 adapters load with "
            f"from_pretrained(base, adapter=...))"
        )
    prefix = meta.get("match_prefix", "")
    if not isinstance(prefix, str):
        raise CheckpointError(f"{cfg_path}: match_prefix must be a string, got {prefix!r}")
    try:
        return LoRATargetConfig.from_dict(meta["targets"]), "lora_core", prefix
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: not a valid adapter config ({type(e).__name__}: {e})") from e


def is_injected_adapter(path: str | os.PathLike) -> bool:
    """A peft folder or our injected-model format (not the GPT-2 ``save_adapter`` format)."""
    cfg_path = Path(path) / ADAPTER_CONFIG
    if not cfg_path.is_file():
        return False
    meta = read_json(cfg_path)
    return pf.is_peft_config(meta) or meta.get("kind") == "injected"


def load(
    path: str | os.PathLike, inj: Injection, param_shapes: dict[str, tuple[int, ...]], module_prefix: str = ""
) -> dict[str, np.ndarray]:
    """The adapter's tensors under canonical names, checked against the model (strict: a
    missing LoRA key is an error, never a zero ``lora_B``)."""
    path = Path(path)
    _, fmt = read_config(path)
    expected = expected_shapes(inj, param_shapes)
    if fmt == "lora_core":
        tensors = read_tensors(path / ADAPTER_WEIGHTS)
        check_tensors(path / ADAPTER_WEIGHTS, tensors, expected)
        return tensors
    wpath = path / pf.PEFT_WEIGHTS
    if not wpath.is_file() and (path / "adapter_model.bin").is_file():
        wpath = path / "adapter_model.bin"
    raw = _without_peft_wrapper_copies(read_tensors(wpath), wpath)
    keys = {pf.peft_key(n, inj.plans, module_prefix): n for n in expected}
    # peft also saves the base weights of targeted embedding layers (``save_embedding_layers``,
    # e.g. a resized vocabulary): when present they replace the model's, as peft loads them
    for m in inj.plans:
        key = f"{pf.KEY_PREFIX}{module_prefix}{m}.base_layer.weight"
        if key in raw and f"{m}.weight" in param_shapes:
            keys[key] = f"{m}.weight"
            expected = dict(expected, **{f"{m}.weight": tuple(param_shapes[f"{m}.weight"])})
    check_tensors(wpath, raw, {k: expected[n] for k, n in keys.items()})
    return {keys[k]: np.ascontiguousarray(v, dtype=np.float32) for k, v in raw.items()}


def refuse_peft_tied_head(model, inj: Injection, where) -> None:
    """A peft adapter cannot mean the same model here where the LM head is tied to an embedding
    that the adapter changes: peft's LoRA embedding and its ``modules_to_save`` copy are modules of
    their own, so its tied head keeps reading the base table, where ours reads the table the
    model trains (a ``modules_to_save`` embedding of our Llama or GPT-2, a transformers model's
    shared weight) or adds the embedding's LoRA update (our GPT-2's head). Such an adapter would
    load or save with other logits than peft's: CheckpointError naming the module and ``where``."""
    saves, prefix = inj.config.modules_to_save, inj.match_prefix
    bad = []
    tied = getattr(model, "tied_embedding", None)
    if tied:
        if tied in inj.plans and getattr(model, "tied_head_adds_lora", False):
            bad.append(f"{tied} has LoRA, which the tied LM head reads too")
        if in_saved_module(prefix + tied + ".weight", saves):
            bad.append(f"{tied} is in modules_to_save, and the tied LM head reads the trained table")
    for group in weight_sharers(model):
        names = [n for n, _ in group]
        saved = [n for n in names if in_saved_module(prefix + n + ".weight", saves)]
        if saved:
            bad.append(f"{saved[0]} is in modules_to_save and shares its weight with {sorted(set(names) - {saved[0]})}")
    if bad:
        raise CheckpointError(
            f"{where}: a peft adapter here would not give peft's logits: {'; '.join(bad)} (peft keeps a tied "
            "head on the base embedding table). Use lora_core's adapter format, an untied model, or leave the "
            "embedding out of the adapter")


def _without_peft_wrapper_copies(raw: dict, wpath) -> dict:
    """peft with ``bias="all"`` and ``modules_to_save`` also writes the biases inside its wrapper of
    each saved module: ``X.modules_to_save.bias`` (the trained one again, beside ``X.bias``) and
    ``X.original_module.bias`` (the base module's, which the adapted model does not use). They are
    dropped where ``X.bias`` is there; a ``modules_to_save`` copy that differs from it is an error."""
    out = dict(raw)
    for key in raw:
        for part in (".modules_to_save.", ".original_module."):
            plain = key.replace(part, ".", 1)
            if part in key and plain in raw:
                if part == ".modules_to_save." and not np.array_equal(raw[key], raw[plain]):
                    raise CheckpointError(f"{wpath}: {key} differs from {plain}: which is the trained tensor?")
                out.pop(key, None)
    return out


def save_model_adapter(model, path: str | os.PathLike, describe, to_numpy, format: AdapterFormat = "lora_core",
                       base: str | None = None) -> None:
    """The backends' ``save_lora_adapter``: the trainable set of an injected model (or of a
    GPT-2 built with LoRA) written in ``format``. ``describe``: the backend's module
    description (called with ``adapted_ok=True``); ``to_numpy(param)``: a float32 copy."""
    inj = injection.record_of(model, lambda m: describe(m, adapted_ok=True))
    if format == "peft":
        refuse_peft_tied_head(model, inj, Path(path))
    params = dict(model.named_parameters())
    names = set(inj.trainable(params))
    tensors = {n: to_numpy(p) for n, p in params.items() if n in names}
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    save(path, inj, tensors, shapes, format, getattr(model, "peft_module_prefix", ""), base)


def load_model_adapter(model, path: str | os.PathLike, describe, replace, mark_trainable) -> tuple[Injection, dict]:
    """The backends' ``load_lora_adapter`` up to the copy into the parameters: read the
    folder's config (ours or peft's), check it against the model's injection or plan one
    (before the model is changed), read the tensors strictly, then inject if the model had
    no LoRA (``replace``, then ``mark_trainable(model)``). Returns the injection and the
    arrays to copy, by parameter name."""
    cfg, fmt, saved_prefix = _read_config(path)
    prefix = getattr(model, "peft_module_prefix", "")
    inj = injection.injection_of(model)
    fresh = inj is None
    if fresh:
        try:
            inj = injection.plan(model, cfg, describe, match_prefix=prefix if fmt == "peft" else saved_prefix)
        except TargetError as e:
            raise TargetError(f"{Path(path) / ADAPTER_CONFIG}: {e}") from e
    elif inj.config.meaning() != cfg.meaning():
        raise TargetError(f"{path}: adapter config {cfg} differs from the model's injected {inj.config}")
    if fmt == "peft":
        refuse_peft_tied_head(model, inj, Path(path) / ADAPTER_CONFIG)
    shapes = dict({n: tuple(p.shape) for n, p in model.named_parameters()}, **inj.lora_shapes())
    tensors = load(path, inj, shapes, prefix)
    if fresh:
        injection.apply(model, inj, replace)
        mark_trainable(model)
    return inj, tensors


__all__ = ["AdapterFormat", "expected_shapes", "is_injected_adapter", "load", "load_model_adapter", "read_config",
           "refuse_peft_tied_head", "save", "save_model_adapter"]
