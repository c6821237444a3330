"""QLoRA's frozen 4-bit base, framework-free parts: which weights are quantized (every
projection of the Llama family, GPT-2's four linear layers, DistilBERT's six per block;
embeddings, norms, biases and the LM head stay as transformers' 4-bit loading leaves them),
and quantizing a checkpoint while it loads, one memory-mapped tensor at a time (Dettmers et
al. 2023; transformers' ``BitsAndBytesConfig(load_in_4bit=True)`` keeps ``lm_head``
unquantized).

DistilBERT's classification head (``pre_classifier``, ``classifier``) stays in float32: the
head is what a classifier fine-tunes fully (``modules_to_save``), and it is what transformers
leaves unquantized when told ``llm_int8_skip_modules=["pre_classifier", "classifier"]``
(``DISTILBERT_SKIP``, written into the checkpoints we save). Without that list transformers
5.24 quantizes the head too (DistilBERT has no output embedding to skip); such a checkpoint
loads with the head in 4 bits, as it is stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..models.llama import PROJECTIONS
from .nf4 import NF4State, check_blocksize, quantize_nf4

GPT2_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
DISTILBERT_LINEARS = ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin", "ffn.lin1",
                      "ffn.lin2")
DISTILBERT_SKIP = ("pre_classifier", "classifier")  # transformers' llm_int8_skip_modules for our checkpoints


@dataclass(frozen=True)
class QuantConfig:
    """How a base is quantized: ``quant_type`` (only ``"nf4"``), ``blocksize`` (bitsandbytes'
    4-bit sizes), ``double_quant`` (8-bit block scales), ``compute_dtype`` of the products."""

    quant_type: Literal["nf4"] = "nf4"
    blocksize: int = 64
    double_quant: bool = True
    compute_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self):
        if self.quant_type != "nf4":
            raise ValueError(f"quant_type {self.quant_type!r} is not supported; only 'nf4' (bitsandbytes' NF4)")
        check_blocksize(self.blocksize, "QuantConfig.blocksize")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"QuantConfig.compute_dtype must be 'float32' or 'bfloat16', got {self.compute_dtype!r}")


def quant_config(quantize: str | None, **kw) -> QuantConfig | None:
    """``from_pretrained``'s ``quantize=`` argument as a config (None: no quantization)."""
    if quantize is None:
        if kw:
            raise ValueError(f"quantization options {sorted(kw)} given without quantize='nf4'")
        return None
    return QuantConfig(quant_type=quantize, **kw)


def is_quantized_weight(name: str) -> bool:
    """Whether the base weight ``name`` (canonical) is stored in 4 bits."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")]
    return module.rsplit(".", 1)[-1] in PROJECTIONS or module.endswith(GPT2_LINEARS + DISTILBERT_LINEARS)


def quantize_while_loading(tensors: dict, qcfg: QuantConfig) -> dict[str, NF4State]:
    """Replace, in place, every quantized weight of ``tensors`` (numpy arrays, memory maps or
    ``LazyTensor`` s, read here) by its ``NF4State``, one at a time, dropping the
    full-precision reference as it goes;
    returns the states by name (the rest of ``tensors`` is left as it is)."""
    states = {}
    for name in [n for n in tensors if is_quantized_weight(n)]:
        arr = tensors.pop(name)
        states[name] = quantize_nf4(arr, qcfg.blocksize, qcfg.double_quant)
        del arr
    return states


def module_of(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``."""
    return name[: -len(".weight")]


__all__ = ["DISTILBERT_LINEARS", "DISTILBERT_SKIP", "GPT2_LINEARS", "QuantConfig", "is_quantized_weight", "module_of",
           "quant_config", "quantize_while_loading"]
