"""DistilBERT for sequence classification (Sanh et al. 2019): config, canonical names and
shapes, seeded initial values, strict checkpoint loading. The backends' models
(``backends.*.distilbert``) have exactly the module names of ``transformers``'
``DistilBertForSequenceClassification``, so its checkpoints, and peft adapters trained on
it, load by name.

Checkpoints: ``model.safetensors`` or ``pytorch_model.bin`` of a
``DistilBertForSequenceClassification`` (encoder + head), or of the pre-trained
``DistilBertForMaskedLM`` (``distilbert-base-uncased``): then its MLM head
(``MLM_HEAD_KEYS``) is dropped by name and the classification head must be given
explicitly (``init_head``), as for any model without one; nothing else is left out.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..formats.checkpoint import check_tensors
from ..formats.hf_checkpoint import find_weights, read_hf_weights
from ..formats.tensor_files import CheckpointError, read_json

MLM_HEAD_KEYS = (
    "vocab_transform.weight",
    "vocab_transform.bias",
    "vocab_layer_norm.weight",
    "vocab_layer_norm.bias",
    "vocab_projector.weight",
    "vocab_projector.bias",
)
HEAD_KEYS = ("pre_classifier.weight", "pre_classifier.bias", "classifier.weight", "classifier.bias")


@dataclass(frozen=True)
class DistilBertConfig:
    """DistilBERT architecture (HF ``DistilBertConfig`` names); gelu (erf form), LayerNorm
    eps 1e-12, learned positions, first token pooled by ``pre_classifier`` + ReLU."""

    vocab_size: int = 30522
    max_position_embeddings: int = 512
    dim: int = 768
    n_layers: int = 6
    n_heads: int = 12
    hidden_dim: int = 3072
    dropout: float = 0.1
    attention_dropout: float = 0.1
    seq_classif_dropout: float = 0.2
    num_labels: int = 2
    pad_token_id: int = 0
    initializer_range: float = 0.02
    # the classes' names (config.json's id2label), kept into a full fine-tuning checkpoint; None: LABEL_i
    label_names: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in ("vocab_size", "max_position_embeddings", "dim", "n_layers", "n_heads", "hidden_dim", "num_labels"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"DistilBertConfig.{name} must be a positive int, got {v!r}")
        if self.label_names is not None:
            object.__setattr__(self, "label_names", tuple(self.label_names))
            if len(self.label_names) != self.num_labels:
                raise ValueError(f"DistilBertConfig.label_names: {len(self.label_names)} names for "
                                 f"{self.num_labels} labels")  # fmt: skip
        if self.dim % self.n_heads:
            raise ValueError(f"DistilBertConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}")
        for name in ("dropout", "attention_dropout", "seq_classif_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"DistilBertConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_hf_json(cls, path: str | os.PathLike, num_labels: int | None = None) -> DistilBertConfig:
        """From an HF ``config.json``; refuses what the model does not implement (sinusoidal
        positions, another activation) by name."""
        d = read_json(path)
        if d.get("model_type", "distilbert") != "distilbert":
            raise ValueError(f"{path}: model_type {d.get('model_type')!r} is not distilbert")
        if d.get("sinusoidal_pos_embds") or d.get("activation", "gelu") != "gelu":
            raise ValueError(
                f"{path}: sinusoidal_pos_embds={d.get('sinusoidal_pos_embds')!r}, "
                f"activation={d.get('activation')!r}: only learned positions and gelu are implemented"
            )
        keys = [f.name for f in dataclasses.fields(cls) if f.name not in ("num_labels", "label_names")]
        labels = num_labels or (len(d["id2label"]) if "id2label" in d else d.get("num_labels", 2))
        names = None
        if isinstance(d.get("id2label"), dict) and len(d["id2label"]) == labels:  # (another count: a new head)
            try:
                names = tuple(str(d["id2label"][k]) for k in sorted(d["id2label"], key=int))
            except (TypeError, ValueError):
                raise ValueError(f"{path}: id2label keys must be the label ids 0..{labels - 1}") from None
            if names == tuple(f"LABEL_{i}" for i in range(labels)):
                names = None
        return cls(**{k: d[k] for k in keys if k in d}, num_labels=labels, label_names=names)


PRESETS = {
    "distilbert-base-uncased": DistilBertConfig(),
    "tiny": DistilBertConfig(vocab_size=120, max_position_embeddings=32, dim=32, n_layers=2, n_heads=2, hidden_dim=64),
}


def base_shapes(cfg: DistilBertConfig, head: bool = True) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every parameter, in module order (HF names)."""
    E, p = cfg.dim, "distilbert."
    shapes = {
        p + "embeddings.word_embeddings.weight": (cfg.vocab_size, E),
        p + "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, E),
        p + "embeddings.LayerNorm.weight": (E,),
        p + "embeddings.LayerNorm.bias": (E,),
    }
    for i in range(cfg.n_layers):
        q = f"{p}transformer.layer.{i}."
        for lin in ("q_lin", "k_lin", "v_lin", "out_lin"):
            shapes.update({f"{q}attention.{lin}.weight": (E, E), f"{q}attention.{lin}.bias": (E,)})
        shapes.update(
            {
                q + "sa_layer_norm.weight": (E,),
                q + "sa_layer_norm.bias": (E,),
                q + "ffn.lin1.weight": (cfg.hidden_dim, E),
                q + "ffn.lin1.bias": (cfg.hidden_dim,),
                q + "ffn.lin2.weight": (E, cfg.hidden_dim),
                q + "ffn.lin2.bias": (E,),
                q + "output_layer_norm.weight": (E,),
                q + "output_layer_norm.bias": (E,),
            }
        )
    if head:
        shapes.update(
            {
                "pre_classifier.weight": (E, E),
                "pre_classifier.bias": (E,),
                "classifier.weight": (cfg.num_labels, E),
                "classifier.bias": (cfg.num_labels,),
            }
        )
    return shapes


def init_weights(cfg: DistilBertConfig, seed: int = 0, head_only: bool = False) -> dict[str, np.ndarray]:
    """Seeded values as HF's ``_init_weights``: normal(0, 0.02) weights, zero biases, unit
    LayerNorm, the padding token's embedding row zero."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in base_shapes(cfg).items():
        if head_only and name not in HEAD_KEYS:
            continue
        if "LayerNorm" in name or "layer_norm" in name:
            arr = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith(".bias"):
            arr = np.zeros(shape)
        else:
            arr = rng.normal(0.0, cfg.initializer_range, size=shape)
            if name.endswith("word_embeddings.weight"):
                arr[cfg.pad_token_id] = 0.0
        out[name] = arr.astype(np.float32)
    return out


def init_head(cfg: DistilBertConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """A new classification head (for an encoder-only / MLM checkpoint)."""
    return init_weights(cfg, seed, head_only=True)


def load_distilbert_checkpoint(
    path: str | os.PathLike, cfg: DistilBertConfig | None = None, num_labels: int | None = None, lazy: bool = False
) -> tuple[DistilBertConfig, dict[str, np.ndarray], bool]:
    """Load HF DistilBERT weights strictly.

    Args:
        path: a weights file or a folder with ``model.safetensors`` / ``pytorch_model.bin`` or
            either's shards with their index (``hf_checkpoint.find_weights``).
        cfg: the architecture; default: ``config.json`` beside the weights.
        num_labels: overrides the config's label count (a new head).
        lazy: leave each tensor as the file gives it (a memory map, or a ``LazyTensor`` where
            it must be read or widened: ``read_tensors``) for a consumer that converts one at a
            time (the 4-bit loader); default: float32 arrays.

    Returns:
        ``(cfg, tensors, has_head)``; without a head (an MLM or encoder checkpoint) the
        caller adds ``init_head(cfg)`` explicitly.
    """
    path = Path(path)
    wpath = find_weights(path)  # a weights file, or an index of shards
    if cfg is None:
        cfg_json = wpath.parent / "config.json"
        if not cfg_json.is_file():
            raise CheckpointError(f"{wpath}: no config.json beside it; pass a DistilBertConfig")
        cfg = DistilBertConfig.from_hf_json(cfg_json, num_labels)
    raw = read_hf_weights(wpath, lazy=lazy)
    mlm = [k for k in raw if k in MLM_HEAD_KEYS]
    tensors = {k: v if lazy else np.ascontiguousarray(v, dtype=np.float32) for k, v in raw.items()
               if k not in MLM_HEAD_KEYS}
    has_head = any(k in tensors for k in HEAD_KEYS)
    if mlm and has_head:
        raise CheckpointError(f"{wpath}: holds both an MLM head {mlm} and a classification head")
    check_tensors(wpath, tensors, base_shapes(cfg, head=has_head))
    return cfg, tensors, has_head


def classifier_from_pretrained(
    model_cls, load_adapter, path: str | os.PathLike, adapter: str | os.PathLike | None = None,
    num_labels: int | None = None, head_seed: int = 0,
):
    """The backends' ``distilbert_from_pretrained``: ``model_cls(cfg)`` (a backend's
    ``DistilBertForSequenceClassification``) holding the HF weights at ``path`` (a checkpoint
    without a classification head gets ``init_head(cfg, head_seed)``), then the adapter folder
    ``adapter`` (ours or peft's) through the backend's ``load_adapter(model, adapter)``."""
    cfg, tensors, has_head = load_distilbert_checkpoint(path, num_labels=num_labels)
    model = model_cls(cfg)
    model.load_weights(tensors if has_head else dict(tensors, **init_head(cfg, head_seed)))
    if adapter is not None:
        load_adapter(model, adapter)
    return model


def pack_indices(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Indices that let the model run its per-token layers on the real tokens only.

    Args:
        mask: (B, T) attention mask, 1 on real tokens (right padding: position 0 is real).

    Returns:
        ``None`` when nothing is padded, else ``(token_index, pad_index, cls_index)``:
        ``token_index`` (N,) flat positions of the N real tokens; ``pad_index`` (B*T,) the
        packed row of every position, N (an appended zero row) for padding; ``cls_index``
        (B,) the packed row of each sequence's first token.
    """
    flat = np.asarray(mask).reshape(-1) != 0
    if flat.all():
        return None
    B, T = np.asarray(mask).shape
    token_index = np.flatnonzero(flat)
    pad_index = np.where(flat, np.cumsum(flat) - 1, len(token_index))
    cls_index = pad_index[np.arange(B) * T]
    if (cls_index == len(token_index)).any():
        raise ValueError("attention_mask: a sequence whose first token is padding (only right padding is supported)")
    return token_index.astype(np.int64), pad_index.astype(np.int64), cls_index.astype(np.int64)


def attention_scale(cfg: DistilBertConfig) -> float:
    """HF's ``attention_head_size ** -0.5``."""
    return (cfg.dim // cfg.n_heads) ** -0.5 if cfg.dim // cfg.n_heads else math.nan


__all__ = [
    "DistilBertConfig",
    "HEAD_KEYS",
    "MLM_HEAD_KEYS",
    "PRESETS",
    "attention_scale",
    "base_shapes",
    "classifier_from_pretrained",
    "init_head",
    "init_weights",
    "load_distilbert_checkpoint",
]
