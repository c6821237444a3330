"""DistilBERT's QLoRA base (Sanh et al. 2019; Dettmers et al. 2023), framework-free: a
``DistilBertForSequenceClassification`` checkpoint quantized while it loads (the six linear
weights of each block NF4, one tensor at a time, read or memory-mapped as it is quantized:
``lora_core.quant.qlora``), or
a bitsandbytes 4-bit checkpoint read as it is (transformers' names are ours, weights (out,
in) as in ``nn.Linear``), and the ``quantization_config`` our saved checkpoints carry.

Which layers are 4-bit: the blocks' ``q_lin``, ``k_lin``, ``v_lin``, ``out_lin``, ``lin1``,
``lin2``; the head (``pre_classifier``, ``classifier``), embeddings and LayerNorms stay float32,
as transformers leaves them with ``llm_int8_skip_modules=["pre_classifier", "classifier"]``
(``qlora.DISTILBERT_SKIP``). A transformers checkpoint saved without that list (transformers
5.24 then quantizes the head as well) loads with its head in 4 bits, as stored.
"""

from __future__ import annotations

import os

from ..formats.bnb4bit import quant_storage, quantization_config, split_bnb4bit
from ..formats.hf_checkpoint import find_weights, read_hf_weights
from ..formats.tensor_files import CheckpointError
from ..models import distilbert as _db
from .checkpoint4bit import (
    assemble_4bit_model,
    check_4bit_shapes,
    float_skip_modules,
    prequantized_config,
    quantize_stored_full_precision,
    resolved,
)
from .qlora import DISTILBERT_SKIP, quant_config, quantize_while_loading


def _prequantized(path, num_labels, head_seed):
    """``(cfg, states, tensors, has_head)`` of a bitsandbytes 4-bit DistilBERT checkpoint (an MLM
    checkpoint's head, quantized or not, is dropped by name; a missing classification head is
    drawn from ``head_seed``)."""
    wpath = find_weights(path)
    cfg_json = wpath.parent / "config.json"
    if not cfg_json.is_file():
        raise CheckpointError(f"{wpath}: no config.json beside it")
    cfg = _db.DistilBertConfig.from_hf_json(cfg_json, num_labels)
    raw = read_hf_weights(wpath)
    states = split_bnb4bit(raw, wpath, quant_storage(quantization_config(wpath.parent), cfg_json))
    mlm = [k for k in _db.MLM_HEAD_KEYS if k in raw or k in states]
    for k in mlm:
        raw.pop(k, None)
        states.pop(k, None)
    has_head = any(k in raw or k in states for k in _db.HEAD_KEYS)
    if mlm and has_head:
        raise CheckpointError(f"{wpath}: holds both an MLM head {mlm} and a classification head")
    if not has_head:
        raw.update(_db.init_head(cfg, head_seed))
    check_4bit_shapes(wpath, states, raw, _db.base_shapes(cfg))
    return cfg, states, raw, wpath


def load_distilbert_4bit(path: str | os.PathLike, quantize: str | None = "nf4", double_quant: bool | None = None,
                         compute_dtype: str | None = None, blocksize: int | None = None, explicit=None,
                         num_labels: int | None = None, head_seed: int = 0):
    """``(cfg, states, tensors, qcfg)`` of a DistilBERT classifier's QLoRA base: ``states`` the NF4
    weights by name, ``tensors`` the rest (memory maps of a ``.safetensors`` file as they are,
    ``LazyTensor`` s where a tensor must be read or widened: bfloat16, ``.bin``; a checkpoint
    without a classification head gets ``init_head(cfg, head_seed)``).
    A bitsandbytes 4-bit checkpoint is read as it is (the storage options set must match it:
    ``checkpoint4bit.prequantized_config``); otherwise ``quantize="nf4"`` quantizes while loading
    (None: ``checkpoint4bit.DEFAULTS``).

    Raises:
        ValueError: another quantization method or type, a block size bitsandbytes does not
            allow, quantization options a pre-quantized checkpoint contradicts.
        CheckpointError: a damaged quant state (names the tensor and the file), missing or
            misshapen tensors.
    """
    qc = quantization_config(path)
    if qc is None:
        if quantize is None:
            raise ValueError(f"{path}: not a 4-bit checkpoint; pass quantize='nf4' to quantize it while loading")
        dq, cd, bs = resolved(double_quant, compute_dtype, blocksize)
        qcfg = quant_config(quantize, double_quant=dq, compute_dtype=cd, blocksize=bs)
        cfg, tensors, has_head = _db.load_distilbert_checkpoint(path, num_labels=num_labels, lazy=True)
        if not has_head:
            tensors.update(_db.init_head(cfg, head_seed))
        return cfg, quantize_while_loading(tensors, qcfg), tensors, qcfg
    cfg, states, tensors, wpath = _prequantized(path, num_labels, head_seed)
    qcfg = prequantized_config(path, qc, states, quantize, double_quant, compute_dtype, blocksize, explicit)
    quantize_stored_full_precision(wpath.parent / "config.json", qc, states, tensors, qcfg)
    return cfg, states, tensors, qcfg


def build_4bit_classifier(model_cls, empty_model, to_4bit, load_adapter, path, adapter=None,
                          num_labels: int | None = None, head_seed: int = 0, quantize=None,
                          double_quant: bool | None = None, compute_dtype: str | None = None,
                          blocksize: int | None = None, explicit=None):
    """The backends' 4-bit ``distilbert_from_pretrained``: ``load_distilbert_4bit``, the model
    from the backend's ``empty_model(model_cls, cfg)``, its quantized layers made 4-bit
    (``to_4bit(model, states, qcfg)``), the other weights (strict), then the adapter folder."""
    cfg, *loaded = load_distilbert_4bit(path, quantize, double_quant, compute_dtype, blocksize, explicit, num_labels,
                                        head_seed)
    return assemble_4bit_model(model_cls, cfg, tuple(loaded), empty_model, to_4bit, load_adapter, adapter)


def skip_modules(cfg, quantized) -> list[str] | None:
    """``llm_int8_skip_modules`` of a saved 4-bit DistilBERT checkpoint whose 4-bit weights are
    named in ``quantized``: its head modules kept in float32 (``checkpoint4bit.float_skip_modules``,
    which also lists float block linears; None for another family's config)."""
    if not isinstance(cfg, _db.DistilBertConfig):
        return None
    return float_skip_modules({}, quantized, DISTILBERT_SKIP, heads_alone=True)


__all__ = ["build_4bit_classifier", "load_distilbert_4bit", "skip_modules"]
