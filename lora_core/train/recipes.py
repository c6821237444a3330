"""The LoRA paper's GPT-2 recipes (E2E, WebNLG, DART x gpt2-medium, gpt2-large) as small configs.

Sources:
- Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685),
  appendix D.3, Table 11 ("hyperparameters for GPT-2 LoRA on E2E, WebNLG and DART"):
  AdamW, batch size 8, 5 epochs, 500 warm-up steps, linear schedule, learning rate 2e-4,
  r_q = r_v = 4, alpha 32, beam 10, no-repeat n-gram 4, and per data set
  (E2E / WebNLG / DART): weight decay 0.01 / 0.01 / 0.0, LoRA dropout 0.1 / 0.1 / 0.0,
  label smoothing 0.1 / 0.1 / 0.0, length penalty 0.9 / 0.8 / 0.8. The table gives the
  same values for gpt2-medium and gpt2-large.
- microsoft/LoRA ``examples/NLG/README.md`` (the E2E gpt2-medium commands): ``--clip 0.0``
  (no clipping), ``--adam_beta2 0.999 --correct_bias``, ``--seq_len 512``,
  ``--valid_batch_size 4``, ``--save_interval 1000``, ``--random_seed 110``; beam search
  ``--beam 10 --no_repeat_ngram_size 4 --repetition_penalty 1.0 --eval_len 64``. That
  README's own example decodes with ``--length_penalty 0.8`` for every data set; we follow
  Table 11 (0.9 on E2E) and note it here.
- ``examples/NLG/src/gpt2_ft.py`` defaults: ``--log_interval 100``, ``--eval_interval 2000``;
  ``optimizer.py``: ``--adam_epsilon 1e-6``.

Command-line overrides go through :func:`apply_overrides` (one helper: unknown keys and
ill-typed values raise ``ValueError``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

from ..generate.beam import BeamConfig
from ..lora.targeting import LoRATargetConfig
from ..models.gpt2 import LoRAConfig
from .optim import AdamWConfig
from .precision import LossScaleConfig, check_precision

__all__ = ["TrainConfig", "Recipe", "RECIPES", "ClassifierRecipe", "CLS_RECIPES", "CausalLMRecipe", "LM_RECIPES",
           "get_recipe", "apply_overrides"]


def _check(cond: bool, cls: str, name: str, value, what: str) -> None:
    if not cond:
        raise ValueError(f"{cls}.{name} must be {what}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters (defaults: Table 11's E2E column and the README command).

    Args:
        batch_size: examples per optimizer update (Table 11: 8).
        grad_accum: micro-batches each update is split into, to save memory. Each
            micro-batch's mean loss (over its own loss positions) weighs ``1/grad_accum``, the
            rule of gpt2_ft.py ``--grad_acc``: the update is the unsplit batch's (up to float
            rounding) when the micro-batches hold equal numbers of loss positions (packed LM
            blocks, classification), and weighs the positions of a short micro-batch more when
            they do not (NLG pairs of different lengths).
        epochs: passes over the training set (Table 11: 5).
        max_steps: total optimizer updates and the end of the lr schedule; ``None``:
            ``epochs`` x updates per epoch (gpt2_ft.py ``--max_step``).
        lr, warmup, schedule: peak learning rate, warm-up updates, ``linear`` decay to 0.
        weight_decay, adam_betas, adam_eps, correct_bias: AdamW (``lora_core.train.optim``).
        label_smooth: label smoothing of the training loss (evaluation uses plain NLL).
        max_grad_norm: global gradient-norm clipping; 0 disables (README ``--clip 0.0``).
        lora_r, lora_alpha, lora_dropout: LoRA on the query and value projections.
        seed: seeds LoRA's initial values, the data order and the dropout masks.
        pad_to: ``None`` pads each batch to its longest sequence; 512 reproduces the paper
            code's fixed-length batches (``--seq_len 512``) for exact-behaviour runs.
        last_batch: the last batch of an epoch when the set does not divide evenly:
            ``keep`` it smaller, ``fill`` it up with seeded random examples (what the paper
            code's ``FT_Dataset`` does), or ``drop`` it. ``keep`` and ``fill`` give the
            paper's ceil(N / batch_size) updates per epoch.
        dropout_masks: ``framework``: LoRA dropout from the backend's RNG; ``numpy``: parity
            mode, masks from one seeded numpy stream (``lora_core.lora.dropout``) so that torch
            and jittor runs apply the same masks.
        eval_every: validation NLL every this many updates (0: only at the end).
        eval_batch_size: validation batch size (README ``--valid_batch_size 4``).
        eval_limit: evaluate on the first N validation examples only (``None``: all).
        save_every: adapter + trainer-state checkpoint every this many updates (0: only at the end).
        log_every: one JSONL log line every this many updates.
        precision: ``fp32`` (exact), ``bf16`` or ``fp16`` autocast of the forward pass
            (``lora_core.train.precision``); LoRA parameters and optimizer state stay float32.
        loss_scale: initial dynamic loss scale of ``fp16`` runs (``GradScaler``'s 2**16).
        method: ``lora`` trains the adapter (and what its config trains); ``full`` trains every
            weight of a model without LoRA (checkpoints hold the whole model in transformers'
            layout, ``lora_core.train.full_ft``); the ``lora_*`` fields then do not apply.
        zero: ZeRO stage of a data-parallel run (``lora_core.train.distributed``): 0 (every rank
            holds everything, DDP), 2 (gradients and optimizer state sharded over the ranks), 3
            (parameters sharded too; torch only). One process ignores it; it does not change
            the updates, so a run may resume with another stage or number of processes.
        decay_all: full fine-tuning only: weight decay on every weight; default (False) on
            matrices only, none on norms, biases and embeddings (``lora_core.train.optim.decays``).
            LoRA runs decay every trained tensor, as the paper code does.
    """

    batch_size: int = 8
    grad_accum: int = 1
    epochs: int = 5
    max_steps: int | None = None
    lr: float = 2e-4
    warmup: int = 500
    schedule: Literal["linear", "constant"] = "linear"
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.999)  # README: --adam_beta2 0.999
    adam_eps: float = 1e-6
    correct_bias: bool = True
    label_smooth: float = 0.1
    max_grad_norm: float = 0.0  # README: --clip 0.0
    lora_r: int = 4
    lora_alpha: float = 32.0
    lora_dropout: float = 0.1
    seed: int = 110  # README: --random_seed 110
    pad_to: int | None = None
    last_batch: Literal["keep", "fill", "drop"] = "keep"
    dropout_masks: Literal["framework", "numpy"] = "framework"
    eval_every: int = 2000
    eval_batch_size: int = 4
    eval_limit: int | None = None
    save_every: int = 1000
    log_every: int = 100
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = 2.0**16
    method: Literal["lora", "full"] = "lora"
    decay_all: bool = False
    zero: Literal[0, 2, 3] = 0

    def __post_init__(self):
        c = "TrainConfig"
        _check(_is_int(self.zero) and self.zero in (0, 2, 3), c, "zero", self.zero, "0, 2 or 3")
        _check(self.method in ("lora", "full"), c, "method", self.method, "'lora' or 'full'")
        _check(isinstance(self.decay_all, bool), c, "decay_all", self.decay_all, "a bool")
        _check(not self.decay_all or self.method == "full", c, "decay_all", self.decay_all,
               "False with method='lora' (LoRA decays every trained tensor; decay_all is full fine-tuning's)")
        check_precision(self.precision, f"{c}.precision")
        _check(isinstance(self.loss_scale, (int, float)) and self.loss_scale > 0, c, "loss_scale", self.loss_scale,
               "a number > 0")
        for name in ("batch_size", "grad_accum", "epochs", "eval_batch_size", "log_every"):
            v = getattr(self, name)
            _check(_is_int(v) and v > 0, c, name, v, "a positive int")
        for name in ("warmup", "eval_every", "save_every", "lora_r", "seed"):
            v = getattr(self, name)
            _check(_is_int(v) and v >= 0, c, name, v, "an int >= 0")
        # a LoRA run trains the adapters of this rank (full fine-tuning ignores it)
        _check(self.method != "lora" or self.lora_r >= 1, c, "lora_r", self.lora_r, "an int >= 1 with method 'lora'")
        for name in ("max_steps", "pad_to", "eval_limit"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and v > 0), c, name, v, "None or a positive int")
        _check(
            self.grad_accum <= self.batch_size,
            c,
            "grad_accum",
            self.grad_accum,
            f"at most batch_size={self.batch_size}",
        )
        _check(isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0, c, "lr", self.lr,
               "a finite number > 0")
        for name in ("weight_decay", "max_grad_norm", "adam_eps"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and v >= 0, c, name, v, "a number >= 0")
        for name in ("label_smooth", "lora_dropout"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and 0 <= v < 1, c, name, v, "in [0, 1)")
        _check(self.schedule in ("linear", "constant"), c, "schedule", self.schedule, "'linear' or 'constant'")
        _check(
            self.last_batch in ("keep", "fill", "drop"), c, "last_batch", self.last_batch, "'keep', 'fill' or 'drop'"
        )
        _check(
            self.dropout_masks in ("framework", "numpy"),
            c,
            "dropout_masks",
            self.dropout_masks,
            "'framework' or 'numpy'",
        )
        _check(isinstance(self.correct_bias, bool), c, "correct_bias", self.correct_bias, "a bool")
        betas = tuple(self.adam_betas)
        _check(
            len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas),
            c,
            "adam_betas",
            self.adam_betas,
            "two numbers in [0, 1)",
        )
        object.__setattr__(self, "adam_betas", betas)

    def lora_config(self) -> LoRAConfig:
        """The paper's adaptation: LoRA on q and v of every block's fused ``c_attn``."""
        return LoRAConfig(
            r=self.lora_r,
            alpha=float(self.lora_alpha),
            dropout=float(self.lora_dropout),
            target_modules=("c_attn",),
            enable_lora=(True, False, True),
            seed=self.seed,
        )

    def adamw_config(self) -> AdamWConfig:
        scaling = LossScaleConfig(init_scale=float(self.loss_scale)) if self.precision == "fp16" else None
        return AdamWConfig(
            betas=self.adam_betas,
            eps=self.adam_eps,
            weight_decay=self.weight_decay,
            correct_bias=self.correct_bias,
            loss_scale=scaling,
            decay="matrices" if self.method == "full" and not self.decay_all else "all",
        )

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        return d


@dataclass(frozen=True)
class Recipe:
    """A data set's recipe: which model, how to train, how to decode (``lora_core.generate.beam.BeamConfig``;
    its ``stop_ids`` default to GPT-2's, a pipeline with another tokenizer sets its own)."""

    name: str
    dataset: Literal["e2e", "webnlg", "dart", "toy"]
    model: str  # a key of lora_core.models.gpt2.PRESETS
    train: TrainConfig = field(default_factory=TrainConfig)
    beam: BeamConfig = field(default_factory=BeamConfig)


# Table 11 columns: what differs per data set (everything else is TrainConfig's default).
# Beam settings of the README command, spelled out so that they do not follow BeamConfig's defaults.
_BEAM = dict(beam=10, max_new_tokens=64, no_repeat_ngram_size=4, repetition_penalty=1.0, min_length=0)
_PER_DATASET = {
    "e2e": (dict(weight_decay=0.01, lora_dropout=0.1, label_smooth=0.1), dict(length_penalty=0.9)),
    "webnlg": (dict(weight_decay=0.01, lora_dropout=0.1, label_smooth=0.1), dict(length_penalty=0.8)),
    "dart": (dict(weight_decay=0.0, lora_dropout=0.0, label_smooth=0.0), dict(length_penalty=0.8)),
}

RECIPES: dict[str, Recipe] = {
    f"{ds}-{size}": Recipe(f"{ds}-{size}", ds, f"gpt2-{size}", TrainConfig(**t), BeamConfig(**_BEAM, **b))
    for ds, (t, b) in _PER_DATASET.items()
    for size in ("medium", "large")
}
# Full fine-tuning of GPT-2 Medium on E2E (the LoRA paper's "FT" row, Table 3: BLEU 68.2).
# Sources: Hu et al. 2021 (arXiv:2106.09685), appendix D.3: the GPT-2 runs use AdamW with a linear
# schedule for 5 epochs and take batch size, learning rate and beam size from Li & Liang 2021
# (Prefix-Tuning, arXiv:2101.00190). Checked against the authors' code (github.com/XiangLi1999/
# PrefixTuning): its README's fine-tuning baseline is `train_e2e.py --tuning_mode finetune --epoch 5
# --learning_rate 0.00005 --bsz 5`; train_e2e.py passes --weight_decay 0.0 and, for full-data runs,
# no --warmup_steps (transformers' Trainer default 0, linear decay); no label smoothing. One
# difference: their GPT-2 trains with its config's 0.1 embedding/attention/residual dropout, which
# our GPT-2 keeps at 0 in every recipe (GPT2Config). Beam 5; decoding otherwise as Table 11's E2E column.
RECIPES["e2e-medium-ft"] = Recipe(
    "e2e-medium-ft",
    "e2e",
    "gpt2-medium",
    TrainConfig(method="full", batch_size=5, epochs=5, lr=5e-5, warmup=0, weight_decay=0.0, label_smooth=0.0,
                lora_dropout=0.0),
    BeamConfig(**dict(_BEAM, beam=5), length_penalty=0.9),
)
# The embedded demo: a tiny GPT-2 on the toy restaurant set (lora_core.data.toy), minutes on a CPU.
# Not from the paper: a larger lr and a short warm-up because the run is a few hundred updates.
RECIPES["toy"] = Recipe(
    "toy",
    "toy",
    "demo",
    TrainConfig(
        epochs=2,
        lr=2e-3,
        warmup=30,
        weight_decay=0.01,
        label_smooth=0.0,
        lora_dropout=0.1,
        seed=0,
        eval_every=100,
        eval_batch_size=16,
        save_every=100,
        log_every=1,
        dropout_masks="numpy",  # parity mode: both backends apply the same LoRA dropout masks
    ),
    BeamConfig(**_BEAM, length_penalty=0.9),
)


@dataclass(frozen=True)
class ClassifierRecipe:
    """A sentence-classification recipe (``lora_core.train.tasks.ClassificationTask``): how
    to train (``train``; its GPT-2 ``lora_*`` fields are not used) and which modules get LoRA
    (``lora``, peft ``LoraConfig`` semantics)."""

    name: str
    dataset: Literal["sst2"]
    train: TrainConfig
    lora: LoRATargetConfig


# The DistilBERT + LoRA study on GLUE SST-2 (its PEFT version): r=4, alpha 8 on q_lin and v_lin,
# the classifier trained fully, AdamW lr 2e-4, weight decay 0.01, batch 16 with gradient
# accumulation 2 (an update = 2 micro-batches of 16), 5 epochs. What the study leaves to
# transformers' Trainer defaults is spelled out: linear decay without warm-up, clipping at 1.0,
# Adam eps 1e-8, seed 42; LoRA dropout 0.1 (peft examples); no label smoothing.
_SST2 = dict(
    batch_size=32, grad_accum=2, epochs=5, lr=2e-4, warmup=0, weight_decay=0.01, adam_eps=1e-8, label_smooth=0.0,
    max_grad_norm=1.0, seed=42, eval_every=500, eval_batch_size=64, save_every=500, log_every=50,
)
_SST2_LORA = dict(r=4, alpha=8.0, target_modules=("q_lin", "v_lin"), modules_to_save=("classifier",), dropout=0.1)
CLS_RECIPES: dict[str, ClassifierRecipe] = {
    "sst2-distilbert": ClassifierRecipe(
        "sst2-distilbert", "sst2", TrainConfig(**_SST2), LoRATargetConfig(**_SST2_LORA, seed=42)
    ),
    # The CPU demo (examples.cls.demo): a small base pre-trained here, one pass over a part of
    # the training set; parity mode (both backends draw the same dropout masks).
    "sst2-demo": ClassifierRecipe(
        "sst2-demo",
        "sst2",
        TrainConfig(**dict(_SST2, epochs=1, lr=1e-3, seed=0, eval_every=50, save_every=125, log_every=10,
                           dropout_masks="numpy")),
        LoRATargetConfig(**_SST2_LORA, seed=0),
    ),
}


@dataclass(frozen=True)
class CausalLMRecipe:
    """A causal-LM recipe on packed text blocks (``examples.lm``; ``LMTask`` with injected
    LoRA): how to train (``train``; its GPT-2 ``lora_*`` fields are not used), which modules
    get LoRA (``lora``, peft ``LoraConfig`` semantics) and the block size of the data."""

    name: str
    train: TrainConfig
    lora: LoRATargetConfig
    block_size: int = 512


# The Llama-3.2-3B study on wikitext-2-raw: LoRA r=8, alpha 16, dropout 0.05 on q, k, v, o;
# batch 4 of 512-token blocks, 2 epochs. What it leaves to transformers' Trainer defaults is
# spelled out: AdamW lr 2e-4, linear decay without warm-up, no weight decay, clipping at 1.0,
# Adam eps 1e-8, seed 42, no label smoothing.
_CLM = dict(batch_size=4, epochs=2, lr=2e-4, warmup=0, weight_decay=0.0, adam_eps=1e-8, label_smooth=0.0,
            max_grad_norm=1.0, seed=42, eval_every=500, eval_batch_size=4, save_every=500, log_every=10)
_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
LM_RECIPES: dict[str, CausalLMRecipe] = {
    "wikitext2-llama": CausalLMRecipe("wikitext2-llama", TrainConfig(**_CLM),
                                      LoRATargetConfig(r=8, alpha=16.0, dropout=0.05, target_modules=_QKVO, seed=42)),
    # the 30B study's adaptation (r=64, alpha 128 on all seven projections)
    "wikitext2-llama-r64": CausalLMRecipe(
        "wikitext2-llama-r64", TrainConfig(**_CLM),
        LoRATargetConfig(r=64, alpha=128.0, dropout=0.05, target_modules=(*_QKVO, "gate_proj", "up_proj", "down_proj"),
                         seed=42)),
    # the CPU demo and tests: small blocks, parity mode (both backends draw the same dropout masks)
    "lm-demo": CausalLMRecipe(
        "lm-demo",
        TrainConfig(**dict(_CLM, epochs=1, lr=1e-3, eval_every=20, save_every=20, log_every=5, seed=0,
                           dropout_masks="numpy")),
        LoRATargetConfig(r=4, alpha=8.0, dropout=0.05, target_modules=("q_proj", "v_proj"), seed=0), block_size=64),
}


def get_recipe(name: str) -> Recipe | ClassifierRecipe:
    """A recipe by name (``e2e-medium``, ``webnlg-large``, ``toy``, ``sst2-distilbert``, ...)."""
    if name in CLS_RECIPES:
        return CLS_RECIPES[name]
    if name in LM_RECIPES:
        return LM_RECIPES[name]
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose from {sorted(RECIPES) + sorted(CLS_RECIPES) + sorted(LM_RECIPES)}")
    return RECIPES[name]


# --------------------------------------------------------------------------- overrides


def _parse(text: str, tp, key: str):
    """``text`` as a value of type ``tp`` (int, float, bool, str, Literal, X | None, tuple)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _parse(text, inner[0], key)
    if origin is Literal:  # the choices may be ints (zero: 0, 2, 3): matched by how they print
        for a in args:
            if str(a) == text:
                return a
        raise ValueError(f"override {key}={text!r}: choose one of {list(args)}")
    if origin is tuple:
        parts = [p.strip() for p in text.split(",")]
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
            return tuple(_parse(p, args[0], key) for p in parts)
        if len(parts) != len(args):
            raise ValueError(f"override {key}={text!r}: expected {len(args)} comma-separated values")
        return tuple(_parse(p, a, key) for p, a in zip(parts, args, strict=True))
    if tp is bool:
        low = text.lower()
        if low in ("true", "yes", "1"):
            return True
        if low in ("false", "no", "0"):
            return False
        raise ValueError(f"override {key}={text!r}: expected true or false")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"override {key}={text!r}: expected an int") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"override {key}={text!r}: expected a number") from None
    if tp is str:
        return text
    raise ValueError(f"override {key}: field type {tp} cannot be set from the command line")


def apply_overrides(cfg, overrides: list[str]):
    """Return ``cfg`` (a frozen dataclass) with ``key=value`` overrides applied.

    Values are parsed with the field's type (``none`` for optional fields, ``a,b`` for
    tuples); dotted keys reach nested configs (``beam.length_penalty=0.8`` on a
    :class:`Recipe`). The config's own ``__post_init__`` then checks the ranges.

    Raises:
        ValueError: a malformed item, an unknown key (the message lists the known ones),
            a value of the wrong type, or one the config rejects.
    """
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value")
        cfg = _set(cfg, key, text.strip(), key)
    return cfg


def _set(cfg, path: str, text: str, full_key: str):
    head, _, rest = path.partition(".")
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    if head not in fields:
        # a field of a nested config given without its prefix (``save_every`` for ``train.save_every``)
        nested = [f"{n}.{path}" for n, f in fields.items() if dataclasses.is_dataclass(getattr(cfg, n))
                  and path.partition(".")[0] in {g.name for g in dataclasses.fields(getattr(cfg, n))}]  # fmt: skip
        hint = f" (did you mean {' or '.join(nested)}?)" if nested else ""
        raise ValueError(f"unknown setting {full_key!r} for {type(cfg).__name__}{hint}; known: {sorted(fields)}")
    current = getattr(cfg, head)
    if rest:
        if not dataclasses.is_dataclass(current):
            raise ValueError(f"unknown setting {full_key!r}: {head} is not a nested config")
        return dataclasses.replace(cfg, **{head: _set(current, rest, text, full_key)})
    if dataclasses.is_dataclass(current):
        raise ValueError(f"setting {full_key!r} is a nested config; set one of its fields, e.g. {head}.<field>")
    tp = typing.get_type_hints(type(cfg))[head]
    return dataclasses.replace(cfg, **{head: _parse(text, tp, full_key)})
