"""Full fine-tuning (``TrainConfig.method = "full"``): every weight of a model without LoRA
trains, with AdamW's weight decay on matrices only unless ``decay_all`` (``optim.decays``).

The trainer stays the one of LoRA runs (data order, schedule, resume, several processes); what
differs is what a checkpoint holds, and that is the task's business: :class:`FullFineTuning`
wraps a task (``LMTask``, ``ClassificationTask``) and gives it :class:`FullModelFiles`, which
write the whole model into each ``ckpt-N/`` as ``config.json`` + ``model.safetensors`` in
transformers' layout, so that ``transformers.AutoModelFor...from_pretrained(ckpt)`` and our
``bk.from_pretrained(ckpt)`` (``distilbert_from_pretrained`` for DistilBERT) both load it:

- GPT-2: ``GPT2LMHeadModel``'s names (``transformer.`` prefix, the tied ``lm_head`` left out as
  ``save_pretrained`` does) with the Conv1D weights (``TRANSPOSED``) back in (in, out) layout;
- the Llama family: our names are transformers' (``LlamaConfig.to_hf_dict()``);
- DistilBERT: ``DistilBertForSequenceClassification``'s names and config.

The optimizer moments stay in ``trainer_state.safetensors`` under our canonical names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..formats.bnb4bit import quantization_config
from ..formats.checkpoint import MODEL_CONFIG, MODEL_WEIGHTS, check_tensors, load_gpt2_checkpoint
from ..formats.hf_checkpoint import write_hf_checkpoint
from ..lora.injection import injection_of
from ..models.distilbert import DistilBertConfig, load_distilbert_checkpoint
from ..models.gpt2 import TRANSPOSED, GPT2Config
from ..models.llama import LlamaConfig, load_llama_checkpoint

__all__ = ["FullFineTuning", "FullModelFiles", "check_full_ft_input", "hf_config", "hf_tensors", "lora_of"]

_GPT2_PREFIX = "transformer."


def hf_config(cfg) -> dict:
    """The transformers ``config.json`` of a GPT-2, Llama-family or DistilBERT config."""
    if isinstance(cfg, LlamaConfig):
        return cfg.to_hf_dict()
    if isinstance(cfg, GPT2Config):
        eos = min(50256, cfg.vocab_size - 1)
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.n_positions, "n_ctx": cfg.n_positions, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.layer_norm_epsilon, "embd_pdrop": cfg.embd_pdrop, "attn_pdrop": cfg.attn_pdrop,
            "resid_pdrop": cfg.resid_pdrop, "initializer_range": cfg.initializer_range, "tie_word_embeddings": True,
            "bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "float32",
        }
    if isinstance(cfg, DistilBertConfig):
        labels = dict(enumerate(cfg.label_names or [f"LABEL_{i}" for i in range(cfg.num_labels)]))
        return {
            "architectures": ["DistilBertForSequenceClassification"], "model_type": "distilbert",
            **{k: v for k, v in cfg.to_dict().items() if k not in ("num_labels", "label_names")},
            "activation": "gelu", "sinusoidal_pos_embds": False, "qa_dropout": 0.1, "tie_weights_": True,
            "id2label": labels, "label2id": {v: k for k, v in labels.items()}, "torch_dtype": "float32",
        }
    raise ValueError(f"full fine-tuning checkpoints know GPT-2, the Llama family and DistilBERT, not {type(cfg).__name__}")


def hf_tensors(cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our canonical tensors under transformers' names and layout (GPT-2: prefix, Conv1D (in, out))."""
    if not isinstance(cfg, GPT2Config):
        return dict(tensors)
    return {_GPT2_PREFIX + n: (v.T if n.endswith(TRANSPOSED) else v) for n, v in tensors.items()}


def _same_config(saved, cfg) -> bool:
    if isinstance(cfg, GPT2Config):  # transformers' config.json carries no dropout we read back
        keys = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon")
        return all(getattr(saved, k) == getattr(cfg, k) for k in keys)
    return saved == cfg


def _read(folder: Path, cfg) -> tuple[object, dict[str, np.ndarray]]:
    if isinstance(cfg, GPT2Config):
        return load_gpt2_checkpoint(folder)
    if isinstance(cfg, LlamaConfig):
        return load_llama_checkpoint(folder)
    saved, tensors, _ = load_distilbert_checkpoint(folder)
    return saved, tensors


class FullModelFiles:
    """The whole model in a checkpoint folder, transformers' layout (module docstring); strict:
    refused when the folder holds another architecture or a tensor of another shape."""

    FILES = (MODEL_CONFIG, MODEL_WEIGHTS)

    def __init__(self, model_config, param_shapes: dict[str, tuple[int, ...]], base: str | None = None):
        hf_config(model_config)  # a family we cannot write is refused before training
        self.model_config, self.param_shapes, self.base = model_config, dict(param_shapes), base

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.param_shapes)

    def write(self, folder: Path, tensors: dict) -> None:
        check_tensors(Path(folder) / MODEL_WEIGHTS, tensors, self.param_shapes)
        write_hf_checkpoint(folder, hf_config(self.model_config), hf_tensors(self.model_config, tensors))

    def read(self, folder: Path) -> dict[str, np.ndarray]:
        saved, tensors = _read(Path(folder), self.model_config)
        if not _same_config(saved, self.model_config):
            raise ValueError(f"{folder}: the checkpoint holds {saved}, the model is {self.model_config}")
        check_tensors(Path(folder) / MODEL_WEIGHTS, tensors, self.param_shapes)
        return {n: np.array(v, dtype=np.float32) for n, v in tensors.items()}  # copies, not file maps


def lora_of(model) -> str | None:
    """What LoRA ``model`` has (a GPT-2 built with ``lora=``, or ``inject_lora``), else None."""
    inj = injection_of(model)
    if inj is not None:
        return f"injected LoRA on {list(inj.config.target_modules)}"
    lora = getattr(model, "lora_config", None)
    return None if lora is None or not lora.r else f"GPT-2 LoRA r={lora.r} on {list(lora.target_modules)}"


class FullFineTuning:
    """``task`` (``LMTask`` or ``ClassificationTask``) with every weight trained: the same examples,
    batches, loss and evaluation; checkpoints hold the whole model (:class:`FullModelFiles`)."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):  # examples, collate, train_step, evaluate, loss, ...
        return getattr(self.task, name)

    def check_config(self, cfg, model) -> None:
        lora = lora_of(model)
        if lora is not None:
            raise ValueError(f"method='full' trains every weight of a model without LoRA; this model has {lora}: "
                             "build it without lora= / inject_lora")
        if self.task.name == "lm":
            self.task.check_config(cfg, model)
        elif cfg.pad_to is not None:
            raise ValueError(f"pad_to is not used by {self.task.name} (batches are padded to their longest)")

    def check_trainable(self, backend, model) -> None:
        """Every parameter must train (``trainable_parameters`` is AdamW's set)."""
        frozen = sorted(set(model.state_numpy()) - set(backend.trainable_parameters(model)))
        if frozen:
            raise ValueError(f"method='full': {len(frozen)} parameters are frozen (e.g. {frozen[0]}); "
                             "full fine-tuning trains every weight")

    def describe(self, model) -> dict:
        return {"model": model.config.to_dict(), "method": "full"}

    def trained_tensors(self, backend, model) -> dict[str, np.ndarray]:
        return model.state_numpy()

    def adapter_files(self, backend, model, base: str | None) -> FullModelFiles:
        shapes = {n: tuple(v.shape) for n, v in backend.trainable_parameters(model).items()}
        return FullModelFiles(model.config, shapes, base)


# --------------------------------------------------------------------------- command-line checks

ADAPTER_FILES = ("adapter_config.json",)  # ours and peft's adapter folders


def check_full_ft_input(option: str, path, overrides: list[str]) -> None:
    """The train commands' bad input to ``--method full``, refused before any model is loaded:
    an adapter folder where the model to fine-tune is expected (``option path``), and a
    ``--set`` of a LoRA setting (``lora.*``, ``lora_*``), which full fine-tuning has no use for.

    Raises:
        ValueError: one line naming the option and what is wrong.
    """
    if path is not None and Path(path).is_dir() and any((Path(path) / n).is_file() for n in ADAPTER_FILES):
        raise ValueError(f"{option} {path}: an adapter folder (adapter_config.json), but --method full trains "
                         "a whole model: give the base checkpoint it was trained on")
    if path is not None and quantization_config(path) is not None:  # it loads 4-bit without --quantize: frozen
        raise ValueError(f"{option} {path}: a bitsandbytes 4-bit checkpoint (quantization_config in its "
                         "config.json), a frozen base that --method full cannot train: use --method lora "
                         "(QLoRA), or a full-precision checkpoint")
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.split(".")[0] == "lora" or key.split(".")[-1].startswith("lora_"):
            raise ValueError(f"--set {item}: a LoRA setting, but --method full trains every weight and has no LoRA")
