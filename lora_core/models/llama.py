"""The Llama family's whole spec (Llama 2/3/3.1/3.2, Mistral, Qwen2): config read from a
Hugging Face ``config.json``, size presets, canonical parameter names and shapes, seeded
initial values, RoPE tables (default and ``llama3`` scaling) and strict checkpoint loading.

Sources: Touvron et al. 2023 (Llama: pre-RMSNorm, SwiGLU MLP, rotary positions), Ainslie et
al. 2023 (grouped-query attention), transformers' ``LlamaForCausalLM`` /
``MistralForCausalLM`` / ``Qwen2ForCausalLM`` (``modeling_llama.py``, and
``modeling_rope_utils._compute_llama3_parameters`` for Llama 3.1's frequency scaling).

Names are transformers' ``LlamaForCausalLM`` names (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``), so checkpoints and peft adapters load as they are; every weight is
stored (out, in) like ``nn.Linear``. The three ``model_type`` s share one architecture and
differ only in the config: Qwen2 has biases on q, k, v (not o); Llama may have
``attention_bias`` (q, k, v and o) and ``mlp_bias``; Mistral has a sliding window, which only
matters past ``sliding_window`` tokens (refused there, not silently changed).
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

MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "llama3")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Buffers some checkpoints carry that are not parameters (older transformers saved inv_freq).
NON_PARAMETER_SUFFIXES = ("rotary_emb.inv_freq",)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


# What transformers (5.24) takes for a field a config.json leaves out, per model type (its config
# classes' defaults, which differ between the three). ``num_key_value_heads``: Llama's default is
# None, Mistral's 8, Qwen2's 32 (not num_attention_heads); an explicit null means
# num_attention_heads in all three (their ``__post_init__``). ``bos_token_id`` / ``eos_token_id``:
# Llama's and Mistral's 1 / 2, Qwen2's None / None (a Qwen2 config.json names them or names none).
HF_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-6,
                    sliding_window=4096, bos_token_id=1, eos_token_id=2),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  sliding_window=4096, bos_token_id=None, eos_token_id=None),
}  # fmt: skip


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family architecture (transformers' config field names).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``; ``rope_scaling`` is
    ``None`` or the ``llama3`` parameters (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``); ``qkv_bias`` / ``o_bias`` /
    ``mlp_bias`` say which projections have biases (Qwen2: q, k, v).

    ``bos_token_id`` / ``eos_token_id`` (an int, a list of ints, or None): built directly, the
    defaults are Llama's 1 / 2; read from a ``config.json`` (``from_hf_dict``), a key left out
    takes the default of transformers' config class of the model type (Qwen2: None). A None
    ``eos_token_id`` means the config names no end-of-text token: nothing checks a tokenizer's
    end-of-text id against it (``lora_core.data.text.model_eos_ids`` is None, and
    ``check_tokenizer_fits`` then accepts the tokenizer's own, which generation stops at), and
    ``to_hf_dict`` writes it as null, as transformers does.
    """

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # attention window (Mistral); None: full causal attention
    # Qwen2: which layers transformers gives the window ("sliding_attention") and which not (its
    # ``layer_types``, or ``max_window_layers`` on): kept so that a saved config.json means the same
    # model; ours refuses any sequence past the window, whichever layers have it. None: every layer's
    layer_types: tuple[str, ...] | None = None
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | list | None = 2
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"LlamaConfig.model_type {self.model_type!r} is not supported; choose from {MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {v!r}")
        if not self.head_dim:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"LlamaConfig.hidden_size={self.hidden_size} is not divisible by "
                                 f"num_attention_heads={self.num_attention_heads}; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even (rotary pairs), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"LlamaConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        object.__setattr__(self, "rope_scaling", _checked_rope_scaling(self.rope_scaling))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        pad = self.pad_token_id
        if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool)
                                or not -self.vocab_size <= pad < self.vocab_size):  # fmt: skip
            raise ValueError(f"LlamaConfig.pad_token_id must be None or a token id of the {self.vocab_size}-token "
                             f"vocabulary (negative counts from the end, as torch's padding_idx), got {pad!r}")

    @property
    def padding_idx(self) -> int | None:
        """The embedding row of the padding token, whose gradient stays zero (transformers builds
        ``embed_tokens`` with ``padding_idx=pad_token_id``), or None."""
        return None if self.pad_token_id is None else self.pad_token_id % self.vocab_size

    @property
    def kv_groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        keys = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - keys)
        if unknown:
            raise ValueError(f"LlamaConfig: unknown keys {unknown}; known: {sorted(keys)}")
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, d: dict, where: str = "config.json") -> LlamaConfig:
        """From a transformers config dict (v4 ``rope_theta``/``rope_scaling`` or v5
        ``rope_parameters``); refuses what the models do not implement, naming the field."""
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(f"{where}: model_type {mt!r} is not a Llama-family type; supported: {MODEL_TYPES}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} is not supported; the Llama family's MLP uses 'silu'")
        if d.get("pretraining_tp", 1) != 1:
            raise ValueError(f"{where}: pretraining_tp={d['pretraining_tp']} is not supported (only 1)")
        # transformers 5 reads a legacy ``rope_scaling`` over ``rope_parameters`` when both are set
        # (``convert_rope_params_to_dict``: ``rope_scaling or rope_parameters``), its theta from
        # that dict or else the top-level ``rope_theta``
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{where}: rope_scaling type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
        scaling = None
        if rope_type == "llama3":
            scaling = {k: rope[k] for k in _LLAMA3_KEYS if k in rope}
            # transformers 5 (``standardize_rope_params``) takes a top-level
            # ``original_max_position_embeddings`` over the rope dict's (Phi-3's layout), and the
            # model's ``max_position_embeddings`` where neither has one
            old = d.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings"))
            if old is None and "max_position_embeddings" in d:
                old = d["max_position_embeddings"]
            if old is not None:
                scaling["original_max_position_embeddings"] = old
        kv_given = "num_key_value_heads" in d
        d = {**HF_DEFAULTS[mt], **d}
        window = None
        if mt == "mistral":
            window = d.get("sliding_window")
        layer_types = None
        if mt == "qwen2":  # transformers' Qwen2Config: the window on the layers from max_window_layers on
            n, first = d.get("num_hidden_layers", 0), d.get("max_window_layers", 28)
            on = d.get("use_sliding_window") and d.get("sliding_window") is not None
            layer_types = d.get("layer_types") or ["sliding_attention" if on and i >= first else "full_attention"
                                                    for i in range(n)]  # fmt: skip
            if not isinstance(layer_types, list) or len(layer_types) != n or \
                    not set(layer_types) <= {"full_attention", "sliding_attention"}:  # fmt: skip
                raise ValueError(f"{where}: layer_types {layer_types!r}: expected {n} of 'full_attention', "
                                 f"'sliding_attention'")  # fmt: skip
            window = d.get("sliding_window") if "sliding_attention" in layer_types else None
            layer_types = tuple(layer_types) if window is not None else None
        # transformers' Mistral has no biases, its Qwen2 q, k and v biases only: their fields are
        # Llama's alone (``attention_bias`` on q, k, v, o; ``mlp_bias``)
        attention_bias = mt == "llama" and bool(d.get("attention_bias", False))
        fields = dict(
            model_type=mt, rope_theta=float(theta), rope_scaling=scaling, sliding_window=window, layer_types=layer_types,
            qkv_bias=mt == "qwen2" or attention_bias, o_bias=attention_bias,
            mlp_bias=mt == "llama" and bool(d.get("mlp_bias", False)), head_dim=d.get("head_dim") or 0,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "max_position_embeddings", "rms_norm_eps", "initializer_range", "bos_token_id", "eos_token_id",
                  "pad_token_id"):
            if k in d:
                fields[k] = d[k]
        # an explicit null: num_attention_heads (transformers' __post_init__); left out: the type's default
        fields["num_key_value_heads"] = d.get("num_key_value_heads") or fields["num_attention_heads"]
        if not kv_given and isinstance(fields["num_attention_heads"], int) and \
                fields["num_attention_heads"] % fields["num_key_value_heads"]:  # fmt: skip
            raise ValueError(f"{where}: num_key_value_heads is not set, and transformers' {_ARCHITECTURES[mt][:-11]}"
                             f"Config then takes {fields['num_key_value_heads']}, which does not divide "
                             f"num_attention_heads={fields['num_attention_heads']}: set num_key_value_heads")
        return cls(**fields)

    @classmethod
    def from_hf_json(cls, path: str | os.PathLike) -> LlamaConfig:
        return cls.from_hf_dict(read_json(path), str(path))  # a cut or garbled file: CheckpointError naming it

    def to_hf_dict(self) -> dict:
        """A ``config.json`` that transformers reads back as this architecture."""
        d = {
            "architectures": [_ARCHITECTURES[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu", "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling, rope_type="llama3"),
            "tie_word_embeddings": self.tie_word_embeddings, "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type == "mistral":
            d.update(sliding_window=self.sliding_window)
        else:
            d.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window)
            if self.sliding_window is not None:
                types = list(self.layer_types or ("sliding_attention",) * self.num_hidden_layers)
                first = types.index("sliding_attention")
                d.update(layer_types=types, max_window_layers=first)
        return d


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _checked_rope_scaling(rs):
    if rs is None:
        return None
    rs = {k: v for k, v in dict(rs).items() if k not in ("rope_type", "type", "rope_theta")}
    missing = [k for k in _LLAMA3_KEYS if k not in rs]
    extra = sorted(set(rs) - set(_LLAMA3_KEYS))
    if missing or extra:
        raise ValueError(f"LlamaConfig.rope_scaling (llama3): missing {missing}, unknown {extra}")
    if rs["high_freq_factor"] <= rs["low_freq_factor"]:
        raise ValueError(f"LlamaConfig.rope_scaling: high_freq_factor must exceed low_freq_factor, got {rs}")
    return rs


# Model sizes in one table: the shapes of Meta's / Hugging Face's releases (random init for
# benchmarks: no weights can be downloaded here) and tiny ones for tests.
_LLAMA3_ROPE = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True, bos_token_id=128000,
                                eos_token_id=128001),
    "llama-3.2-3b": LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                                rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True, bos_token_id=128000,
                                eos_token_id=128001),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                                rope_scaling=dict(_LLAMA3_ROPE, factor=8.0), bos_token_id=128000,
                                eos_token_id=128001),
    # the bench's CPU shape: Llama-3.2-1B's widths, fewer layers, a small vocabulary
    "llama-bench": LlamaConfig(vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                               num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                               rms_norm_eps=1e-5, rope_theta=500000.0),
    "tiny-llama": LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    "tiny-llama3": LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, original_max_position_embeddings=32),
                               tie_word_embeddings=True),
    "tiny-mistral": LlamaConfig(model_type="mistral", vocab_size=128, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                max_position_embeddings=128, sliding_window=64),
    "tiny-qwen2": LlamaConfig(model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=128, qkv_bias=True, tie_word_embeddings=True),
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    """A preset by name, with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown Llama-family preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def base_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Canonical (transformers) name -> shape of every parameter, in module order."""
    E, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, E)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, (fout, fin), bias in (("q_proj", (q, E), cfg.qkv_bias), ("k_proj", (kv, E), cfg.qkv_bias),
                                        ("v_proj", (kv, E), cfg.qkv_bias), ("o_proj", (E, q), cfg.o_bias)):
            shapes[f"{p}self_attn.{name}.weight"] = (fout, fin)
            if bias:
                shapes[f"{p}self_attn.{name}.bias"] = (fout,)
        for name, (fout, fin) in (("gate_proj", (F, E)), ("up_proj", (F, E)), ("down_proj", (E, F))):
            shapes[f"{p}mlp.{name}.weight"] = (fout, fin)
            if cfg.mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (fout,)
        shapes[p + "input_layernorm.weight"] = (E,)
        shapes[p + "post_attention_layernorm.weight"] = (E,)
    shapes["model.norm.weight"] = (E,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, E)
    return shapes


def count_flops_per_token(cfg: LlamaConfig, seq_len: int) -> dict[str, float]:
    """Multiply-adds x 2 per token of one forward pass: ``matmul`` (every projection and the
    LM head: 2 x the weights they multiply) and ``attention`` (QK^T and AV, causal: on
    average half of ``seq_len`` keys per query)."""
    shapes = base_shapes(cfg)
    matmul = sum(2 * s[0] * s[1] for n, s in shapes.items() if n.endswith("proj.weight"))
    matmul += 2 * cfg.vocab_size * cfg.hidden_size  # LM head (tied or not)
    attn = cfg.num_hidden_layers * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * (seq_len + 1) / 2
    return {"matmul": float(matmul), "attention": float(attn)}


def init_llama_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded values as transformers' ``_init_weights``: normal(0, initializer_range)
    projections and embeddings, zero biases, unit RMSNorm weights (float32)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in base_shapes(cfg).items():
        if name.endswith("norm.weight"):
            arr = np.ones(shape)
        elif name.endswith(".bias"):
            arr = np.zeros(shape)
        else:
            arr = rng.normal(0.0, cfg.initializer_range, size=shape)
        out[name] = arr.astype(np.float32)
    return out


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """(head_dim / 2,) float32 inverse frequencies, with ``llama3`` scaling if configured
    (transformers' ``_compute_llama3_parameters``, the same float32 steps)."""
    D = cfg.head_dim
    exponent = np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D)
    inv = (1.0 / np.power(np.float32(cfg.rope_theta), exponent, dtype=np.float32)).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    factor, lo, hi, old = (rs[k] for k in _LLAMA3_KEYS)
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((np.float32(old) / wavelen - np.float32(lo)) / np.float32(hi - lo)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: LlamaConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, each (length, head_dim) float32, for positions 0..length-1: the angle
    ``position * inv_freq`` in float32, duplicated over the two halves (``rotate_half``)."""
    if length > cfg.max_position_embeddings:
        raise ValueError(f"{length} positions exceed max_position_embeddings={cfg.max_position_embeddings}")
    freqs = np.arange(length, dtype=np.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def check_length(cfg: LlamaConfig, total: int) -> None:
    """Refuse a sequence the model cannot attend over as transformers would."""
    if total > cfg.max_position_embeddings:
        raise ValueError(f"sequence of {total} tokens exceeds max_position_embeddings={cfg.max_position_embeddings}")
    if cfg.sliding_window is not None and total > cfg.sliding_window:
        raise ValueError(f"sequence of {total} tokens exceeds sliding_window={cfg.sliding_window}: sliding-window "
                         f"attention (model_type {cfg.model_type!r}) is not implemented; use sequences of at most "
                         f"{cfg.sliding_window} tokens")


def is_non_parameter(name: str) -> bool:
    return name.endswith(NON_PARAMETER_SUFFIXES)


def load_llama_checkpoint(path: str | os.PathLike, lazy: bool = False) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """A transformers Llama/Mistral/Qwen2 checkpoint folder (any of ``formats.hf_checkpoint``'s
    layouts), strictly: ``(cfg, tensors)`` with canonical names; arrays are memory maps where
    the format allows (convert one at a time; ``lazy``: ``LazyTensor`` s where a tensor must be
    read or widened, ``read_hf_weights``). A tied model's ``lm_head.weight``, if saved, must
    equal the embedding."""
    wpath = find_weights(path)
    cfg_json = wpath.parent / "config.json"
    if not cfg_json.is_file():
        raise CheckpointError(f"{wpath}: no config.json beside it")
    cfg = LlamaConfig.from_hf_json(cfg_json)
    tensors = {k: v for k, v in read_hf_weights(wpath, lazy).items() if not is_non_parameter(k)}
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        emb = tensors.get("model.embed_tokens.weight")
        if emb is None or head.shape != emb.shape or not np.array_equal(head, emb):
            raise CheckpointError(f"{wpath}: tie_word_embeddings is true but lm_head.weight differs from "
                                  f"model.embed_tokens.weight")
    check_tensors(wpath, tensors, base_shapes(cfg))
    return cfg, tensors


def model_type_of(path: str | os.PathLike) -> str:
    """``model_type`` of the checkpoint folder at ``path`` (its ``config.json``), else ''."""
    p = Path(path)
    cfg = (p if p.is_dir() else p.parent) / "config.json"
    return str(read_json(cfg).get("model_type", "")) if cfg.is_file() else ""


__all__ = [
    "LlamaConfig", "MODEL_TYPES", "PRESETS", "PROJECTIONS", "ROPE_TYPES", "base_shapes", "check_length",
    "count_flops_per_token", "init_llama_weights", "llama_config", "load_llama_checkpoint", "model_type_of",
    "rope_inv_freq", "rope_tables",
]
