"""lora_core: the framework-agnostic spec of LoRA for GPT-2 (Hu et al. 2021).

Configs, parameter naming, seeded initial values, checkpoint and adapter formats, the
numpy reference of the LoRA math, schedules, data and beam-search bookkeeping. Tensor
code lives in the backends, chosen with ``get_backend("torch" | "jittor")``. Importing
this package imports neither torch nor jittor.
"""

from . import batching, beam, optim
from .backend import BACKENDS, get_backend
from .checkpoint import (
    CheckpointError,
    load_adapter,
    load_gpt2_checkpoint,
    load_model,
    save_adapter,
    save_model,
)
from .config import PRESETS, GPT2Config, LoRAConfig, gpt2_config
from .init import init_gpt2_weights, init_lora_weights
from .naming import base_shapes, count_parameters, lora_shapes, trainable_names
from .schedule import linear_warmup_decay, lr_at

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "get_backend", "CheckpointError", "load_adapter", "load_gpt2_checkpoint", "load_model",
    "save_adapter", "save_model", "PRESETS", "GPT2Config", "LoRAConfig", "gpt2_config",
    "init_gpt2_weights", "init_lora_weights", "base_shapes", "count_parameters", "lora_shapes",
    "trainable_names", "linear_warmup_decay", "lr_at", "batching", "beam", "optim",
]

# LoRA for any model: peft-like targeting (injection is in the backends: bk.inject_lora)
from . import adapter_io, peft_format  # noqa: E402
from .targeting import LoRATargetConfig, TargetError  # noqa: E402

__all__ += ["LoRATargetConfig", "TargetError", "adapter_io", "peft_format"]
