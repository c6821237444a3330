"""A QLoRA base from a checkpoint folder, framework-free: either quantized while it loads
(``quantize="nf4"`` on a full-precision checkpoint) or read as it is from a bitsandbytes 4-bit
checkpoint (``config.json``'s ``quantization_config``; ``lora_core.formats.bnb4bit``), for the
Llama family and GPT-2 (DistilBERT's loading: ``lora_core.quant.distilbert4bit``); and the
tensors a 4-bit model of any of the three saves in bitsandbytes' form.

GPT-2: transformers' bitsandbytes integration (``replace_with_bnb_linear``) turns the four
Conv1D layers of each block into ``Linear4bit`` and quantizes their weights transposed, (out,
in), which is our canonical layout; the tied LM head stays ``wte``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ..formats.bnb4bit import quant_storage, quantization_config, split_bnb4bit, write_bnb4bit_checkpoint
from ..formats.checkpoint import check_tensors, resolve_pretrained
from ..formats.hf_checkpoint import find_weights, read_hf_weights
from ..formats.tensor_files import CheckpointError
from ..models import gpt2 as _gpt2
from ..models import llama as _llama
from .nf4 import NF4State
from .qlora import (
    DISTILBERT_SKIP,
    QuantConfig,
    is_quantized_weight,
    module_of,
    quant_config,
    quantize_while_loading,
)

_GPT2_PREFIX = "transformer."
# the 4-bit options' defaults where a checkpoint is quantized while it loads; None (or, while the
# backends' signatures still default to them, these very values) leaves a pre-quantized
# checkpoint's own settings in force
DEFAULTS = {"double_quant": True, "blocksize": 64, "compute_dtype": "float32"}
_CLI = {"double_quant": "--no-double-quant"}  # the command-line option that sets it False (no --blocksize)


def resolved(double_quant, compute_dtype, blocksize) -> tuple[bool, str, int]:
    """The options of a checkpoint quantized while it loads, None meaning the default (``DEFAULTS``)."""
    return (DEFAULTS["double_quant"] if double_quant is None else bool(double_quant),
            compute_dtype or DEFAULTS["compute_dtype"], DEFAULTS["blocksize"] if blocksize is None else blocksize)


def set_options(double_quant=None, blocksize=None) -> dict:
    """The storage options the caller set (not None: the backends' ``from_pretrained`` default to
    None, so ``double_quant=True`` given is told from one left out)."""
    given = {"double_quant": double_quant, "blocksize": blocksize}
    return {k: v for k, v in given.items() if v is not None}


def prequantized_config(path, qc: dict, states: dict, quantize, double_quant, compute_dtype, blocksize,
                         explicit=None) -> QuantConfig:
    """The ``QuantConfig`` a bitsandbytes checkpoint was saved with (products in ``compute_dtype``,
    default float32: its ``bnb_4bit_compute_dtype`` is not taken); the storage options the caller
    set (``set_options``; ``explicit``: whether to compare them at all) that contradict it are
    refused naming the option (nothing is re-quantized)."""
    sizes = {st.blocksize for st in states.values()} or {64}
    nested = {st.nested for st in states.values()} or {bool(qc.get("bnb_4bit_use_double_quant"))}
    if len(sizes) > 1 or len(nested) > 1:
        raise CheckpointError(f"{path}: 4-bit weights with different block sizes {sorted(sizes)} or double "
                              f"quantization {sorted(nested)}; one quantization_config covers them all")
    saved = QuantConfig("nf4", sizes.pop(), nested.pop(), compute_dtype or DEFAULTS["compute_dtype"])
    if quantize not in (None, "nf4"):
        raise ValueError(f"{path}: a pre-quantized bitsandbytes NF4 checkpoint is loaded as it is; quantize={quantize!r} "
                         f"does not match it")
    have = {"double_quant": saved.double_quant, "blocksize": saved.blocksize}
    wrong = [k for k, v in set_options(double_quant, blocksize).items() if explicit is not False and v != have[k]]
    if wrong:
        opts = set_options(double_quant, blocksize)
        given = ", ".join(f"{k}={opts[k]}" + (f" ({_CLI[k]})" if k in _CLI and opts[k] is False else "") for k in wrong)
        raise ValueError(f"{path}: a pre-quantized bitsandbytes NF4 checkpoint (blocksize {saved.blocksize}, "
                         f"double_quant {saved.double_quant}) is loaded as it is; {given} does not match it "
                         f"(leave it out to load the checkpoint's own)")
    return saved


def _gpt2_full_precision(path):
    """GPT-2's canonical base tensors from HF/OpenAI files or a ``save_model`` folder (whose
    weights are stored (out, in) already; LoRA tensors saved with it are left out)."""
    cfg, _, tensors = resolve_pretrained(path, lazy=True)  # Conv1D weights: transposed views of the map
    names = _gpt2.base_shapes(cfg)
    return cfg, {k: v for k, v in tensors.items() if k in names}


def _llama_raw(wpath: Path, cfg_json: Path):
    cfg = _llama.LlamaConfig.from_hf_json(cfg_json)
    tensors = {k: v for k, v in read_hf_weights(wpath).items() if not _llama.is_non_parameter(k)}
    states = split_bnb4bit(tensors, wpath, quant_storage(quantization_config(wpath.parent), cfg_json))
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return cfg, states, tensors, _llama.base_shapes(cfg)


def _gpt2_raw(wpath: Path, cfg_json: Path):
    cfg = _gpt2.GPT2Config.from_hf_json(str(cfg_json))
    raw = read_hf_weights(wpath)
    states = {k[len(_GPT2_PREFIX):] if k.startswith(_GPT2_PREFIX) else k: v
              for k, v in split_bnb4bit(raw, wpath, quant_storage(quantization_config(wpath.parent), cfg_json)).items()}
    tensors = {}
    for k, v in raw.items():
        name = k[len(_GPT2_PREFIX):] if k.startswith(_GPT2_PREFIX) else k
        if name == "lm_head.weight" or _gpt2.is_non_parameter(name):
            continue  # the tied head (transformers keeps it unquantized, = wte)
        tensors[name] = v.T if name.endswith(_gpt2.TRANSPOSED) else v
    return cfg, states, tensors, _gpt2.base_shapes(cfg)


def load_4bit_checkpoint(path: str | os.PathLike, quantize: str | None = "nf4", double_quant: bool | None = None,
                         compute_dtype: str | None = None, blocksize: int | None = None, explicit=None):
    """``(family, cfg, states, tensors, qcfg)`` of a QLoRA base: ``states`` the NF4 weights by
    canonical name, ``tensors`` the rest (memory maps where the format allows, ``LazyTensor`` s
    where a tensor must be read or widened: bfloat16, ``.bin``), ``family``
    ``"llama"`` or ``"gpt2"``. A bitsandbytes 4-bit checkpoint is read as it is (the storage
    options set, ``set_options``, must match it; ``explicit=False``: not compared); otherwise
    ``quantize="nf4"`` quantizes each weight while loading (None: ``DEFAULTS``).

    Raises:
        ValueError: another quantization method or type (GPTQ, AWQ, fp4, 8-bit), a block size
            bitsandbytes does not allow, another model family.
        CheckpointError: a damaged quant state (names the tensor and the file), missing or
            misshapen tensors.
    """
    from ..models.build import checkpoint_family

    family = checkpoint_family(path)
    if family == "distilbert":
        raise ValueError(f"{path}: a DistilBERT classifier: load its 4-bit base with "
                         f"distilbert_from_pretrained(path, quantize='nf4')")
    if family not in ("llama", "gpt2"):
        raise ValueError(f"{path}: a 4-bit base is implemented for the Llama family, GPT-2 and DistilBERT, not {family}")
    qc = quantization_config(path)
    if qc is None:
        if quantize is None:
            raise ValueError(f"{path}: not a 4-bit checkpoint; pass quantize='nf4' to quantize it while loading")
        dq, cd, bs = resolved(double_quant, compute_dtype, blocksize)
        qcfg = quant_config(quantize, double_quant=dq, compute_dtype=cd, blocksize=bs)
        cfg, tensors = (_llama.load_llama_checkpoint(path, lazy=True) if family == "llama"
                        else _gpt2_full_precision(path))
        return family, cfg, quantize_while_loading(tensors, qcfg), tensors, qcfg
    wpath = find_weights(path)
    cfg_json = wpath.parent / "config.json"
    cfg, states, tensors, shapes = (_llama_raw if family == "llama" else _gpt2_raw)(wpath, cfg_json)
    qcfg = prequantized_config(path, qc, states, quantize, double_quant, compute_dtype, blocksize, explicit)
    quantize_stored_full_precision(cfg_json, qc, states, tensors, qcfg, _GPT2_PREFIX if family == "gpt2" else "")
    check_4bit_shapes(wpath, states, tensors, shapes)
    return family, cfg, states, tensors, qcfg


def skipped_module(name: str, patterns, where) -> bool:
    """Whether transformers leaves the module ``name`` (its full name in transformers' model)
    unconverted for ``llm_int8_skip_modules`` ``patterns``: a pattern matching from the start up to
    a module boundary, as a regular expression with that boundary, or as a suffix (transformers'
    ``should_convert_module``)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    try:
        return any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)
    except (re.error, TypeError) as e:
        raise ValueError(f"{where}: quantization_config llm_int8_skip_modules {patterns!r}: not module names or "
                         f"patterns ({e})") from None


def quantize_stored_full_precision(where, qc: dict, states: dict, tensors: dict, qcfg: QuantConfig,
                                   prefix: str = "") -> None:
    """A checkpoint whose ``config.json`` carries a bitsandbytes ``quantization_config`` over
    weights stored in full precision (all or some): each linear weight of the 4-bit set
    (``qlora.is_quantized_weight``) is quantized while it loads, with the checkpoint's settings
    (``qcfg``), unless ``llm_int8_skip_modules`` names its module (``prefix``: what transformers'
    module names add to ours, ``transformer.`` for GPT-2): what transformers makes of the
    full-precision weights given that ``BitsAndBytesConfig``. (transformers 5.24 loading such a
    folder by its config alone puts the float weights into its 4-bit modules unquantized.) In
    place, one tensor at a time."""
    skip = qc.get("llm_int8_skip_modules") or []
    if isinstance(skip, str):
        skip = [skip]
    full = [n for n in tensors if is_quantized_weight(n) and n not in states
            and not skipped_module(prefix + module_of(n), skip, where)]  # fmt: skip
    states.update(quantize_while_loading({n: tensors.pop(n) for n in full}, qcfg))


def check_4bit_shapes(wpath, states: dict, tensors: dict, shapes: dict) -> None:
    """A pre-quantized checkpoint against the model's ``shapes``: every 4-bit weight one the model
    has, of its shape; the other tensors strictly (``check_tensors``). CheckpointError naming the file."""
    for name, st in states.items():
        if name not in shapes or tuple(st.shape) != tuple(shapes[name]):
            raise CheckpointError(f"{wpath}: {name}: a 4-bit weight of shape {list(st.shape)}, the model "
                                  f"expects {list(shapes.get(name, ())) or 'no such weight'}")
    check_tensors(wpath, tensors, {k: v for k, v in shapes.items() if k not in states})


def float_skip_modules(tensors, states, heads=("lm_head",), prefix: str = "", heads_alone: bool = False) -> list[str] | None:
    """``llm_int8_skip_modules`` of a saved 4-bit checkpoint: every module of the family's 4-bit
    set (``qlora.is_quantized_weight``, plus its ``heads``) whose weight is in full precision
    (in ``tensors``, not in ``states``), with transformers' names (``prefix`` added), each as
    the shortest suffix that names no 4-bit module (transformers' ``should_convert_module``:
    ``down_proj`` where every layer's is float). transformers 5 takes that list instead of its
    own defaults, so the float heads are listed too. None (transformers' defaults) where only
    the heads are float, unless ``heads_alone`` (DistilBERT: transformers would quantize its
    head)."""
    float_heads = [h for h in heads if f"{h}.weight" not in states]
    body = [module_of(n) for n in tensors if is_quantized_weight(n) and n not in states]
    if not body and not (heads_alone and float_heads):
        return None
    quantized = [prefix + module_of(n) for n in states]
    out: list[str] = []
    for m in float_heads + [prefix + b for b in body]:
        parts = m.split(".")
        pick = next((p for p in (".".join(parts[i:]) for i in range(len(parts) - 1, -1, -1))
                     if not any(skipped_module(q, [p], "llm_int8_skip_modules") for q in quantized)), m)
        if pick not in out and not skipped_module(m, out, "llm_int8_skip_modules"):
            out.append(pick)
    return out


def save_4bit_checkpoint(folder: str | os.PathLike, cfg, tensors: dict[str, np.ndarray],
                         states: dict[str, NF4State], compute_dtype: str = "float32") -> None:
    """Write a 4-bit model (its canonical full-precision ``tensors`` and NF4 ``states``) as a
    bitsandbytes checkpoint that transformers loads (``formats.bnb4bit.write_bnb4bit_checkpoint``);
    the 4-bit set's modules kept in full precision (a checkpoint loaded with
    ``llm_int8_skip_modules``; DistilBERT's head) are named in its ``llm_int8_skip_modules``
    (``float_skip_modules``), so that transformers and ours leave them so."""
    from ..train.full_ft import hf_config  # transformers' config.json of each family

    if isinstance(cfg, _gpt2.GPT2Config):
        hf = {_GPT2_PREFIX + n: (v.T if n.endswith(_gpt2.TRANSPOSED) else v) for n, v in tensors.items()}
        write_bnb4bit_checkpoint(folder, hf_config(cfg), hf, {_GPT2_PREFIX + n: s for n, s in states.items()},
                                 compute_dtype, float_skip_modules(tensors, states, prefix=_GPT2_PREFIX))
    elif isinstance(cfg, _llama.LlamaConfig):
        write_bnb4bit_checkpoint(folder, cfg.to_hf_dict(), tensors, states, compute_dtype,
                                 float_skip_modules(tensors, states))
    else:  # DistilBERT: the head stays float32 (transformers told so by llm_int8_skip_modules)
        write_bnb4bit_checkpoint(folder, hf_config(cfg), tensors, states, compute_dtype,
                                 float_skip_modules(tensors, states, DISTILBERT_SKIP, heads_alone=True))


def build_4bit_model(model_classes: dict, empty_model, to_4bit, load_adapter, path, adapter=None, quantize=None,
                     double_quant: bool | None = None, compute_dtype: str | None = None, blocksize: int | None = None,
                     explicit=None):
    """The backends' ``from_pretrained_4bit``: ``load_4bit_checkpoint``, then the family's model
    (``model_classes[family]``, built by the backend's ``empty_model(cls, cfg)``), its frozen
    projections made 4-bit (``to_4bit(model, states, qcfg)``), the rest of the weights (strict),
    and the adapter folder (``load_adapter(model, adapter)``)."""
    family, cfg, states, tensors, qcfg = load_4bit_checkpoint(path, quantize, double_quant, compute_dtype, blocksize,
                                                              explicit)
    return assemble_4bit_model(model_classes[family], cfg, (states, tensors, qcfg), empty_model, to_4bit,
                               load_adapter, adapter, partial=family == "llama")


def assemble_4bit_model(model_cls, cfg, loaded: tuple, empty_model, to_4bit, load_adapter, adapter=None,
                        partial: bool = False):
    """A backend's 4-bit model from ``loaded = (states, tensors, qcfg)``: ``empty_model(model_cls,
    cfg)``, its quantized layers made 4-bit (``to_4bit``), the other weights (``load_weights``,
    strict; ``partial``: the Llama loader's form), then the adapter folder."""
    states, tensors, qcfg = loaded
    model = empty_model(model_cls, cfg)
    to_4bit(model, states, qcfg)
    del states
    if partial:
        model.load_weights(tensors, partial=True)
    else:
        model.load_weights(tensors)
    del tensors
    if adapter is not None:
        load_adapter(model, adapter)
    return model


def save_4bit_model(model, folder, layer_cls, state_of) -> None:
    """The backends' ``save_quantized``: every ``layer_cls`` module's NF4 state (``state_of``) and
    the model's other non-LoRA tensors, as ``save_4bit_checkpoint`` writes them."""
    from ..lora.naming import is_lora_name

    layers = {n: m for n, m in model.named_modules() if isinstance(m, layer_cls)}
    if not layers:
        raise ValueError("save_quantized: the model has no 4-bit layer (load it with quantize='nf4')")
    states = {n + ".weight": state_of(m) for n, m in layers.items()}
    tensors = {n: v for n, v in model.state_numpy().items() if not is_lora_name(n)}
    dtypes = {m.compute_dtype_name for m in layers.values()}
    save_4bit_checkpoint(folder, model.config, tensors, states, dtypes.pop() if len(dtypes) == 1 else "float32")




def wants_4bit(path, quantize, double_quant: bool | None, compute_dtype: str | None, blocksize: int | None) -> bool:
    """Whether the backends' ``from_pretrained`` call asks for a 4-bit base: ``quantize`` or a
    4-bit option set (not None), or a checkpoint whose config.json has a
    bitsandbytes ``quantization_config`` (another quantization method or type raises ValueError
    naming what is supported)."""
    if quantize is not None or set_options(double_quant, blocksize) or compute_dtype not in (None, "float32"):
        return True
    return path is not None and quantization_config(path) is not None


def check_4bit_request(path, lora, quantize, double_quant: bool | None = None, blocksize: int | None = None) -> bool:
    """Refuse what a 4-bit load cannot take (GPT-2's ``lora=``; 4-bit options without
    ``quantize`` on a full-precision checkpoint); returns ``explicit``: a storage option was set
    (``set_options``: None reads as not set), which a pre-quantized checkpoint
    must then match (its codes are loaded as they are; ``quantize="nf4"`` alone takes its
    settings). The compute dtype is the caller's (default float32), not the checkpoint's
    ``bnb_4bit_compute_dtype``."""
    if lora is not None:
        raise ValueError(f"{path}: a 4-bit base takes LoRA from inject_lora or an adapter folder, not lora=")
    if quantize is None and not (path is not None and quantization_config(path) is not None):
        raise ValueError("double_quant / compute_dtype / blocksize apply to quantize='nf4' only")
    return bool(set_options(double_quant, blocksize))


__all__ = ["DEFAULTS", "assemble_4bit_model", "build_4bit_model", "check_4bit_request", "check_4bit_shapes",
           "float_skip_modules", "load_4bit_checkpoint", "prequantized_config", "resolved", "save_4bit_checkpoint",
           "save_4bit_model", "set_options", "wants_4bit"]
