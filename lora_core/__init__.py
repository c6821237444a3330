"""lora_core: the framework-agnostic spec of LoRA (Hu et al. 2021) for GPT-2, DistilBERT and
the Llama family.

Configs, parameter naming, seeded initial values, checkpoint and adapter formats, the
numpy reference of the LoRA math, schedules, data and beam-search bookkeeping. Tensor
code lives in the backends, chosen with ``get_backend("torch" | "jittor")``. Importing
this package imports neither torch nor jittor.

Layout (one concern per subpackage):

- ``models/``: each model family's whole spec (``gpt2``, ``distilbert``, ``llama``) and
  the construction the backends share (``build``).
- ``lora/``: LoRA for any model: targeting, injection plans, naming, dropout, the numpy
  reference of the math.
- ``formats/``: files: tensors (safetensors, torch pickles), checkpoints, adapters (ours
  and peft's).
- ``train/``: the trainer, its tasks, recipes, data order, schedules, optimizer spec,
  precision, data parallelism, run folders.
- ``generate/``: beam search bookkeeping and scoring, caches, masks, decoding to files.
- ``data/``: NLG data (JSONL, converters), tokenizers, batching, SST-2, the toy set.
"""

from .backend import BACKENDS, get_backend
from .data import batching
from .formats import adapter_io, peft_format
from .formats.checkpoint import (
    CheckpointError,
    load_adapter,
    load_gpt2_checkpoint,
    load_model,
    save_adapter,
    save_model,
)
from .generate import beam
from .lora.naming import count_parameters
from .lora.targeting import LoRATargetConfig, TargetError
from .models.gpt2 import (
    PRESETS,
    GPT2Config,
    LoRAConfig,
    base_shapes,
    gpt2_config,
    init_gpt2_weights,
    init_lora_weights,
    lora_shapes,
    trainable_names,
)
from .train import optim
from .train.schedule import linear_warmup_decay, lr_at

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "get_backend", "CheckpointError", "load_adapter", "load_gpt2_checkpoint", "load_model",
    "save_adapter", "save_model", "PRESETS", "GPT2Config", "LoRAConfig", "gpt2_config",
    "init_gpt2_weights", "init_lora_weights", "base_shapes", "count_parameters", "lora_shapes",
    "trainable_names", "linear_warmup_decay", "lr_at", "batching", "beam", "optim",
    # LoRA for any model: peft-like targeting (injection is in the backends: bk.inject_lora)
    "LoRATargetConfig", "TargetError", "adapter_io", "peft_format",
]
