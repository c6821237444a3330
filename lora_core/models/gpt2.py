"""GPT-2's whole spec: architecture config and size presets, its built-in LoRA config
(loralib semantics), canonical parameter names and shapes, and seeded initial values.

Sources: Hu et al. 2021 (LoRA), microsoft/LoRA ``loralib`` (names, ``enable_lora`` for the
fused qkv projection, ``reset_parameters``), nanoGPT ``GPTConfig`` and HF ``GPT2Config``.

Names are HF GPT-2's without the ``transformer.`` prefix (``h.0.attn.c_attn.weight``);
LoRA parameters follow loralib (``h.0.attn.c_attn.lora_A``). Every weight is stored
(out, in) like ``nn.Linear``; HF/OpenAI checkpoints store GPT-2's ``Conv1D`` weights
(in, out), and ``TRANSPOSED`` lists them for the one place that transposes
(``lora_core.formats.checkpoint.load_gpt2_checkpoint``), as nanoGPT does.

Initial values: base GPT-2 normal(0, 0.02), residual projections scaled by
1/sqrt(2 n_layer) (GPT-2 paper, nanoGPT), zero biases, unit LayerNorm. LoRA: ``lora_A``
kaiming-uniform(a=sqrt 5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), ``lora_B`` zeros; for
the embedding loralib swaps them (A zeros, B standard normal).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..formats.tensor_files import read_json
from ..lora.naming import LORA_MARK, count_parameters, is_lora_name, matches_target

BiasMode = Literal["none", "all", "lora_only"]
_BIAS_MODES = ("none", "all", "lora_only")
# Modules of a GPT-2 block that LoRA can adapt (canonical HF names, see naming.py).
LORA_TARGETS = ("c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "c_proj", "c_fc", "wte")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA hyper-parameters (loralib semantics).

    Args:
        r: rank of the update; 0 disables LoRA.
        alpha: the update is scaled by ``alpha / r``.
        dropout: dropout on the layer input before ``lora_A`` (training only).
        target_modules: module names or suffixes to adapt (``"c_attn"`` adapts every
            block's fused qkv projection; ``"attn.c_proj"`` only attention outputs).
        enable_lora: for the fused ``c_attn`` (q, k, v), which slices get their own
            LoRA pair; the paper adapts q and v: ``(True, False, True)``. ``None``
            adapts ``c_attn`` as one matrix (one A, one B, as peft does).
        bias: which biases train: ``none``, ``all``, or ``lora_only`` (biases of
            adapted layers).
        seed: seed of the numpy RNG that draws ``lora_A`` (so both backends start equal).
    """

    r: int = 4
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("c_attn",)
    enable_lora: tuple[bool, bool, bool] | None = (True, False, True)
    bias: BiasMode = "none"
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 0:
            raise ValueError(f"LoRAConfig.r must be an int >= 0, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ValueError(f"LoRAConfig.alpha must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.bias not in _BIAS_MODES:
            raise ValueError(f"LoRAConfig.bias must be one of {_BIAS_MODES}, got {self.bias!r}")
        targets = (self.target_modules,) if isinstance(self.target_modules, str) else self.target_modules
        targets = tuple(targets)
        bad = [t for t in targets if t not in LORA_TARGETS]
        if bad or not targets:
            raise ValueError(f"LoRAConfig.target_modules: unknown {bad or targets!r}; choose from {LORA_TARGETS}")
        object.__setattr__(self, "target_modules", targets)
        if self.enable_lora is not None:
            el = tuple(self.enable_lora)
            if len(el) != 3 or not all(isinstance(b, bool) for b in el) or not any(el):
                raise ValueError(
                    f"LoRAConfig.enable_lora must be None or 3 booleans (q, k, v) with at least one True, "
                    f"got {self.enable_lora!r}"
                )
            object.__setattr__(self, "enable_lora", el)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r if self.r else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_modules"] = list(self.target_modules)
        d["enable_lora"] = None if self.enable_lora is None else list(self.enable_lora)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LoRAConfig:
        return cls(**_checked_kwargs(cls, d))


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 architecture (HF ``GPT2Config`` names).

    gelu uses the tanh approximation, LayerNorm eps 1e-5, the LM head is tied to
    ``wte``. Dropouts default to 0 as in the LoRA paper's code: LoRA dropout is
    the only one the recipes use.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    embd_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config.n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"GPT2Config.{name} must be in [0, 1), got {v!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPT2Config:
        return cls(**_checked_kwargs(cls, d))

    @classmethod
    def from_hf_json(cls, path: str) -> GPT2Config:
        """The architecture from an HF ``config.json``. Its dropouts (0.1 in OpenAI's GPT-2
        configs) are not taken: the LoRA paper's code trains with them at 0, our default."""
        d = read_json(path)  # a cut or garbled file: CheckpointError naming it
        if d.get("model_type", "gpt2") != "gpt2":
            from .llama import MODEL_TYPES

            raise ValueError(f"{path}: model_type {d.get('model_type')!r} is not supported; the causal LMs read are "
                             f"{('gpt2',) + MODEL_TYPES} (and 'distilbert' for classification)")  # fmt: skip
        keys = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon")
        cfg = cls(**{k: d[k] for k in keys if k in d})
        _refuse_other_gpt2(path, d, cfg)
        return cfg


def _refuse_other_gpt2(path, d: dict, cfg: GPT2Config) -> None:
    """Refuse, naming the field, what ``transformers``' GPT-2 can be configured to compute and
    ours does not: another activation, unscaled or per-layer-scaled attention scores, another MLP
    width, an untied head (the loader would otherwise give other logits without a word, or fail
    on shapes far from the cause). ``reorder_and_upcast_attn`` only changes half-precision
    rounding in transformers (float32 scores either way), so it is accepted."""
    act = d.get("activation_function", "gelu_new")
    if act not in GELU_TANH_NAMES:
        raise ValueError(f"{path}: activation_function {act!r} is not supported; GPT-2 here uses the tanh GELU "
                         f"({' or '.join(map(repr, GELU_TANH_NAMES))})")  # fmt: skip
    for key, ours in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("tie_word_embeddings", True)):  # fmt: skip
        if key in d and d[key] is not None and bool(d[key]) != ours:
            raise ValueError(f"{path}: {key}={d[key]!r} is not supported (GPT-2 here: {key}={ours})")
    inner = d.get("n_inner")
    if inner is not None and inner != 4 * cfg.n_embd:
        raise ValueError(f"{path}: n_inner={inner} is not supported; GPT-2 here has the MLP width 4 x n_embd = "
                         f"{4 * cfg.n_embd}")  # fmt: skip


# transformers' names of the tanh-approximated GELU GPT-2 uses (its default "gelu_new")
GELU_TANH_NAMES = ("gelu_new", "gelu_pytorch_tanh")


# Model sizes in one table (HF / OpenAI GPT-2; tiny ones for tests and the demo).
PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20),
    "tiny": GPT2Config(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=4),
    # the embedded demo's base (examples/nlg/demo.py); vocab_size follows its tokenizer
    "demo": GPT2Config(vocab_size=512, n_positions=256, n_embd=128, n_layer=3, n_head=4),
    "tiny-32": GPT2Config(vocab_size=500, n_positions=64, n_embd=32, n_layer=2, n_head=2),
}


def gpt2_config(name: str, **overrides) -> GPT2Config:
    """A preset by name, with field overrides (e.g. ``vocab_size`` of a small tokenizer)."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT-2 preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def check_length(cfg: GPT2Config, total: int) -> None:
    """Refuse a sequence past the learned position table (transformers' GPT-2 fails on it)."""
    if total > cfg.n_positions:
        raise ValueError(f"sequence of {total} tokens exceeds n_positions={cfg.n_positions}")


def _checked_kwargs(cls, d: dict) -> dict:
    keys = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - keys)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; known: {sorted(keys)}")
    d = dict(d)
    for k in ("target_modules", "enable_lora"):
        if isinstance(d.get(k), list):
            d[k] = tuple(d[k])
    return d

# -------------------- names and shapes

# Conv1D weights in HF/OpenAI checkpoints, stored (in, out): transposed once on load.
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers some checkpoints carry that are not parameters (the causal mask): dropped by name.
NON_PARAMETER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def is_non_parameter(name: str) -> bool:
    """``h.3.attn.bias`` (a mask buffer), not ``h.3.attn.c_attn.bias`` (a parameter)."""
    return name.startswith("h.") and name.count(".") == 3 and name.endswith(NON_PARAMETER_SUFFIXES)


def base_shapes(cfg: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every base parameter, in module order."""
    E, V = cfg.n_embd, cfg.vocab_size
    shapes = {"wte.weight": (V, E), "wpe.weight": (cfg.n_positions, E)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (E,), p + "ln_1.bias": (E,),
            p + "attn.c_attn.weight": (3 * E, E), p + "attn.c_attn.bias": (3 * E,),
            p + "attn.c_proj.weight": (E, E), p + "attn.c_proj.bias": (E,),
            p + "ln_2.weight": (E,), p + "ln_2.bias": (E,),
            p + "mlp.c_fc.weight": (4 * E, E), p + "mlp.c_fc.bias": (4 * E,),
            p + "mlp.c_proj.weight": (E, 4 * E), p + "mlp.c_proj.bias": (E,),
        })
    shapes.update({"ln_f.weight": (E,), "ln_f.bias": (E,)})
    return shapes


def module_dims(cfg: GPT2Config) -> dict[str, tuple[int, int]]:
    """Adaptable module name -> (in_features, out_features); ``wte`` is (vocab, n_embd)."""
    E = cfg.n_embd
    dims = {"wte": (cfg.vocab_size, E)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        dims.update({p + "attn.c_attn": (E, 3 * E), p + "attn.c_proj": (E, E),
                     p + "mlp.c_fc": (E, 4 * E), p + "mlp.c_proj": (4 * E, E)})
    return dims


def lora_modules(cfg: GPT2Config, lora: LoRAConfig) -> list[str]:
    """Names of the modules that ``lora`` adapts, in module order."""
    if lora.r == 0:
        return []
    return [m for m in module_dims(cfg) if any(matches_target(m, t) for t in lora.target_modules)]


def lora_shapes(cfg: GPT2Config, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every LoRA parameter (loralib layouts).

    Linear: A (r, in), B (out, r). Fused qkv with ``enable_lora`` of k slices:
    A (k*r, in), B (k*out/3, r) (loralib ``MergedLinear``). Embedding: A (r, vocab),
    B (n_embd, r) (loralib ``Embedding``: ``delta = (B @ A).T``).
    """
    shapes = {}
    for m in lora_modules(cfg, lora):
        fin, fout = module_dims(cfg)[m]
        k = 1
        if m.endswith("attn.c_attn") and lora.enable_lora is not None:
            k = sum(lora.enable_lora)
            fout = fout // 3 * k
        shapes[f"{m}.lora_A"] = (k * lora.r, fin)
        shapes[f"{m}.lora_B"] = (fout, lora.r)
    return shapes


def trainable_names(cfg: GPT2Config, lora: LoRAConfig) -> list[str]:
    """Names of what trains under ``lora.bias``: LoRA parameters and the chosen biases."""
    names = list(lora_shapes(cfg, lora))
    if lora.bias == "all":
        names += [n for n in base_shapes(cfg) if n.endswith(".bias")]
    elif lora.bias == "lora_only":
        names += [f"{m}.bias" for m in lora_modules(cfg, lora) if m != "wte"]
    return names


def count_flops_per_token(cfg: GPT2Config, seq_len: int) -> dict[str, float]:
    """Multiply-adds x 2 per token of one forward pass, as ``lora_core.models.llama``'s:
    ``matmul`` (every block's ``c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj`` and the
    LM head tied to ``wte``: 2 x the weights they multiply) and ``attention`` (QK^T and AV,
    causal: on average half of ``seq_len`` keys per query)."""
    matmul = sum(2 * fin * fout for m, (fin, fout) in module_dims(cfg).items() if m != "wte")
    matmul += 2 * cfg.vocab_size * cfg.n_embd  # LM head (tied)
    attn = cfg.n_layer * 2 * 2 * cfg.n_embd * (seq_len + 1) / 2
    return {"matmul": float(matmul), "attention": float(attn)}

# -------------------- seeded initial values

def init_gpt2_weights(cfg: GPT2Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random GPT-2 weights (float32, canonical names, (out, in) layout)."""
    rng = np.random.default_rng(seed)
    std = cfg.initializer_range
    out = {}
    for name, shape in base_shapes(cfg).items():
        if name.startswith("ln") or ".ln_" in name:
            arr = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith(".bias"):
            arr = np.zeros(shape)
        else:
            s = std / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else std
            arr = rng.normal(0.0, s, size=shape)
        out[name] = arr.astype(np.float32)
    return out


def init_lora_weights(cfg: GPT2Config, lora: LoRAConfig, seed: int | None = None,
                      b_std: float = 0.0) -> dict[str, np.ndarray]:
    """LoRA initial values drawn from ``np.random.default_rng(seed or lora.seed)``.

    Args:
        b_std: if > 0, ``lora_B`` is drawn from normal(0, b_std) instead of zeros
            (tests use it so that the update is not zero).
    """
    rng = np.random.default_rng(lora.seed if seed is None else seed)
    out = {}
    for name, shape in lora_shapes(cfg, lora).items():
        is_embedding = name.startswith("wte.")
        if name.endswith("lora_A"):
            if is_embedding:
                arr = np.zeros(shape)
            else:
                bound = 1.0 / math.sqrt(shape[1])
                arr = rng.uniform(-bound, bound, size=shape)
        else:
            if is_embedding:
                arr = rng.normal(0.0, 1.0, size=shape)
            else:
                arr = rng.normal(0.0, b_std, size=shape) if b_std > 0 else np.zeros(shape)
        out[name] = arr.astype(np.float32)
    return out


__all__ = [
    "LoRAConfig", "GPT2Config", "PRESETS", "gpt2_config", "LORA_TARGETS", "BiasMode", "TRANSPOSED",
    "base_shapes", "count_flops_per_token", "module_dims", "lora_modules", "lora_shapes", "trainable_names",
    "init_gpt2_weights", "init_lora_weights", "LORA_MARK", "count_parameters", "is_lora_name", "matches_target",
]
