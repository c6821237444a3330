"""Jittor backend of lora_core (same modules, names and signatures as ``backends.torch``).

Importing it configures jittor for this machine first (``_env``): CPU when no NVIDIA
driver, or no CUDA toolkit, is present. It never imports torch.
"""

from __future__ import annotations

from ._env import configure as _configure
from ._env import import_jittor as _import_jittor

_configure()
_import_jittor()

from lora_core.models import build as _build
from lora_core.quant import checkpoint4bit as _quant4

from ._gpu_check import ensure_gpu_ok as _ensure_gpu_ok
from .compile import set_compile
from .device import peak_gpu_mb, reset_peak_gpu, to_device
from .distributed import (
    all_reduce_sum,
    check_zero,
    data_parallel,
    evaluation,
    full_parameters,
    init_process_group,
    parallel_adamw,
    parallel_train_step,
    shutdown_process_group,
    weights_fingerprint,
)
from .generate import beam_search
from .gpt2 import GPT2LMModel, KVCache, set_grad_checkpoint
from .lora import (
    LoRAEmbedding,
    LoRALinear,
    LoRAMergedLinear,
    count_trainable,
    lora_state_dict,
    mark_only_lora_as_trainable,
    merge_lora,
    set_dropout_source,
    trainable_parameters,
    unmerge_lora,
)
from .optim import AdamW
from .precision import set_precision
from .train import eval_nll, lm_loss, manual_seed, train_step

NAME = "jittor"


def build_model(cfg, lora=None, base=None, lora_weights=None, trainable: bool = True):
    """A ``GPT2LMModel`` holding ``base`` (+ LoRA values); see ``lora_core.models.build.build_model``."""
    return _build.build_model(GPT2LMModel, mark_only_lora_as_trainable, cfg, lora, base, lora_weights, trainable)


@_build.in_eval_mode
def from_pretrained(path, lora=None, adapter=None, trainable: bool = True, quantize: str | None = None,
                    double_quant: bool | None = None, compute_dtype: str | None = None, blocksize: int | None = None):
    """Load a checkpoint of any causal-LM family (GPT-2, or Llama/Mistral/Qwen2 by its
    ``config.json``), optionally with an adapter (ours or peft's); see
    ``lora_core.models.build.from_pretrained`` and ``causal_lm_from_pretrained``. ``quantize="nf4"``:
    a QLoRA base (``lora_core.quant.qlora``), quantized while loading."""
    _ensure_gpu_ok()  # before reading the checkpoint (the models' constructors check too)
    if _quant4.wants_4bit(path, quantize, double_quant, compute_dtype, blocksize):
        from .quant import from_pretrained_4bit

        explicit = _quant4.check_4bit_request(path, lora, quantize, double_quant, blocksize)
        return from_pretrained_4bit(path, adapter, quantize, double_quant, compute_dtype, blocksize, explicit)
    other = _build.pretrained_for_family(path, lora, adapter, {"llama": llama_from_pretrained})
    if other is not None:
        return other
    return _build.from_pretrained(GPT2LMModel, mark_only_lora_as_trainable, path, lora, adapter, trainable,
                                  load_lora_adapter)


__all__ = [
    "NAME", "AdamW", "GPT2LMModel", "KVCache", "LoRAEmbedding", "LoRALinear", "LoRAMergedLinear", "beam_search",
    "build_model", "count_trainable", "eval_nll", "from_pretrained", "lm_loss", "lora_state_dict", "manual_seed",
    "mark_only_lora_as_trainable", "merge_lora", "set_dropout_source", "train_step", "trainable_parameters", "unmerge_lora",
    # data parallelism (backends/*/distributed.py)
    "all_reduce_sum", "data_parallel", "evaluation", "full_parameters", "init_process_group", "parallel_adamw",
    "parallel_train_step", "shutdown_process_group", "check_zero", "weights_fingerprint",
    # device, precision, activation checkpointing, compiled step (device.py, precision.py, model.py, compile.py)
    "peak_gpu_mb", "reset_peak_gpu", "set_compile", "set_grad_checkpoint", "set_precision", "to_device",
]

# LoRA for any model (lora_core.lora.targeting / injection / peft_format)
from .classify import cls_eval, cls_loss, cls_predict, cls_train_step  # noqa: E402
from .distilbert import DistilBertForSequenceClassification, distilbert_from_pretrained  # noqa: E402
from .inject import inject_lora, load_lora_adapter, mark_only_lora_trainable, save_lora_adapter  # noqa: E402
from .llama import LlamaForCausalLM, llama_from_pretrained  # noqa: E402

__all__ += ["DistilBertForSequenceClassification", "cls_eval", "cls_loss", "cls_predict", "cls_train_step", "distilbert_from_pretrained",
            "inject_lora", "load_lora_adapter", "mark_only_lora_trainable", "save_lora_adapter",
            "LlamaForCausalLM", "llama_from_pretrained"]

# QLoRA: a 4-bit base saved as a bitsandbytes checkpoint (quant.py)
from .quant import save_quantized  # noqa: E402

__all__ += ["save_quantized"]
