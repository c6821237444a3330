"""LoRA for any model: which modules get LoRA, with which rank and alpha (peft ``LoraConfig``
semantics), as a plan that both backends' ``inject_lora`` carry out.

Matching rules are peft's (``peft.tuners.tuners_utils.check_target_module_exists``,
``peft.utils.other.get_pattern_key`` and ``_set_trainable``), so that a peft
``adapter_config.json`` selects the same modules here:

- ``target_modules`` as a tuple: a module whose full name is an entry, or ends with
  ``"." + entry`` (``"q_lin"`` adapts every ``...attention.q_lin``); as a string: a regex
  that must match the full name (``r".*\\.layer\\.[01]\\.attention\\.(q|v)_lin"``).
- ``rank_pattern`` / ``alpha_pattern``: ``{pattern: value}``; the first pattern ``p`` with
  ``re.match(rf"(.*\\.)?({p})$", name)`` overrides ``r`` / ``alpha`` of that module.
- ``modules_to_save``: modules trained fully (a classifier head); as in peft an entry
  selects every module whose name ends with it as a string (``"classifier"`` also selects
  ``pre_classifier``), and such modules never get LoRA.
- ``exclude_modules``: names / suffixes (tuple) or a regex (str) that never get LoRA.
- ``fused_slices``: ``{pattern: enable}`` for fused projections adapted per slice
  (loralib ``MergedLinear``; GPT-2's ``c_attn`` with ``(True, False, True)`` is the paper's
  q, v form). Without an entry a fused layer is adapted as one matrix (peft's form).

Layer kinds (``LAYER_KINDS``): ``linear`` (weight (out, in)), ``conv1d`` (GPT-2's
``Conv1D``, weight (in, out), peft's ``fan_in_fan_out``), ``embedding`` (weight (num, dim)).
The math of each is in ``lora_core.lora.reference``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..models.gpt2 import _BIAS_MODES, BiasMode, LoRAConfig

LAYER_KINDS = ("linear", "conv1d", "embedding")
# peft's sequence-classification models add both names to ``modules_to_save`` (transformers calls the
# head ``classifier`` in BERT-like models, ``score`` in decoder-only ones): one of them matching is
# enough, the other is ignored as peft ignores it; any other entry must match a module
TASK_HEADS = ("classifier", "score")


class TargetError(ValueError):
    """A targeting config that does not fit the model (patterns matching nothing, a target
    of a kind LoRA cannot adapt); the message names the patterns or modules."""


@dataclass(frozen=True)
class LoRATargetConfig:
    """LoRA for any model, peft ``LoraConfig`` semantics (see the module docstring).

    Args:
        r: default rank; ``rank_pattern`` overrides it per module.
        alpha: default ``lora_alpha``; ``alpha_pattern`` overrides it per module.
        target_modules: names / dotted suffixes (tuple), or one regex matching full names (str).
        exclude_modules: modules that never get LoRA, same matching as ``target_modules``.
        rank_pattern, alpha_pattern: ``{pattern: value}`` overrides (peft's matching).
        dropout: dropout on the input of ``lora_A`` (training only).
        bias: which biases train: ``none``, ``all``, ``lora_only`` (biases of adapted layers).
        modules_to_save: modules whose parameters all train (e.g. ``("classifier",)``).
        fused_slices: ``{pattern: enable flags}`` for per-slice LoRA on fused projections.
        use_rslora: scaling ``alpha / sqrt(r)`` (rank-stabilised LoRA) instead of ``alpha / r``.
        seed: seed of the numpy draws of the initial ``lora_A`` (both backends start equal).
    """

    r: int = 8
    alpha: float = 8.0
    target_modules: tuple[str, ...] | str = ()
    exclude_modules: tuple[str, ...] | str = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    dropout: float = 0.0
    bias: BiasMode = "none"
    modules_to_save: tuple[str, ...] = ()
    fused_slices: dict[str, tuple[bool, ...]] = field(default_factory=dict)
    use_rslora: bool = False
    seed: int = 0

    def __post_init__(self):
        _check_int("r", self.r, 1)
        _check_number("alpha", self.alpha)
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRATargetConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.bias not in _BIAS_MODES:
            raise ValueError(f"LoRATargetConfig.bias must be one of {_BIAS_MODES}, got {self.bias!r}")
        targets = self.target_modules if isinstance(self.target_modules, str) else tuple(self.target_modules)
        if not targets or not all(
            isinstance(t, str) and t for t in ((targets,) if isinstance(targets, str) else targets)
        ):
            raise ValueError(f"LoRATargetConfig.target_modules must be non-empty, got {self.target_modules!r}")
        if isinstance(targets, str):
            _check_regex("target_modules", targets)
        object.__setattr__(self, "target_modules", targets)
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
        if isinstance(self.exclude_modules, str):
            _check_regex("exclude_modules", self.exclude_modules)
        else:
            object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules))
        for name, pattern_map, check in (
            ("rank_pattern", self.rank_pattern, lambda v: _check_int("rank_pattern value", v, 1)),
            ("alpha_pattern", self.alpha_pattern, lambda v: _check_number("alpha_pattern value", v)),
        ):
            for p, v in pattern_map.items():
                _check_regex(name, p)
                check(v)
        slices = {}
        for p, enable in self.fused_slices.items():
            _check_regex("fused_slices", p)
            el = tuple(enable)
            if len(el) < 2 or not all(isinstance(b, bool) for b in el) or not any(el):
                raise ValueError(
                    f"LoRATargetConfig.fused_slices[{p!r}] must be >= 2 booleans with one True, got {enable!r}"
                )
            slices[p] = el
        object.__setattr__(self, "fused_slices", slices)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_modules"] = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        d["modules_to_save"] = list(self.modules_to_save)
        if not isinstance(self.exclude_modules, str):
            d["exclude_modules"] = list(self.exclude_modules)
        d["fused_slices"] = {k: list(v) for k, v in self.fused_slices.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LoRATargetConfig:
        keys = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - keys)
        if unknown:
            raise ValueError(f"LoRATargetConfig: unknown keys {unknown}; known: {sorted(keys)}")
        d = dict(d)
        if isinstance(d.get("target_modules"), list):
            d["target_modules"] = tuple(d["target_modules"])
        return cls(**d)

    def meaning(self) -> LoRATargetConfig:
        """The config with what does not change the adapted model left out, for comparing two:
        name lists as sets (peft writes ``target_modules`` as a set), ``seed`` (initial values
        only: a loaded adapter brings its own)."""
        def as_set(v):
            return v if isinstance(v, str) else tuple(sorted(set(v)))

        return dataclasses.replace(self, target_modules=as_set(self.target_modules),
                                   exclude_modules=as_set(self.exclude_modules),
                                   modules_to_save=as_set(self.modules_to_save), seed=0)  # fmt: skip

    @classmethod
    def from_gpt2(cls, lora: LoRAConfig) -> LoRATargetConfig:
        """The same adaptation as GPT-2's ``LoRAConfig`` (its targets are dotted suffixes;
        ``enable_lora`` becomes the per-slice form of ``c_attn``)."""
        slices = {"attn.c_attn": lora.enable_lora} if lora.enable_lora is not None else {}
        return cls(
            r=lora.r,
            alpha=lora.alpha,
            target_modules=lora.target_modules,
            dropout=lora.dropout,
            bias=lora.bias,
            fused_slices=slices,
            seed=lora.seed,
        )


@dataclass(frozen=True)
class LayerPlan:
    """What ``inject_lora`` does to one module (shapes follow ``lora_core.models.gpt2``)."""

    name: str
    kind: str  # one of LAYER_KINDS
    in_features: int  # embedding: num_embeddings
    out_features: int  # embedding: embedding_dim
    r: int
    alpha: float
    scaling: float
    enable: tuple[bool, ...] | None = None  # fused per-slice form

    def shapes(self) -> dict[str, tuple[int, int]]:
        """``lora_A`` / ``lora_B`` shapes under the module name (loralib layouts)."""
        k = 1 if self.enable is None else sum(self.enable)
        out = self.out_features if self.enable is None else self.out_features // len(self.enable) * k
        return {f"{self.name}.lora_A": (k * self.r, self.in_features), f"{self.name}.lora_B": (out, self.r)}


def matches_target(name: str, targets: tuple[str, ...] | str) -> bool:
    """peft's rule: regex full match (str), else the exact name or a dotted suffix."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets or any(name.endswith("." + t) for t in targets)


def pattern_key(patterns, name: str) -> str | None:
    """The first pattern ``p`` of peft's ``get_pattern_key`` rule that matches ``name``."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", name):
            return p
    return None


def is_saved_module(name: str, modules_to_save: tuple[str, ...]) -> bool:
    """peft's ``_set_trainable`` rule: the name ends with an entry (as a string)."""
    return any(name.endswith(m) for m in modules_to_save)


def _excluded_by_save(name: str, modules_to_save: tuple[str, ...]) -> bool:
    """peft never puts LoRA inside a module to save."""
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in modules_to_save)


def plan_injection(
    modules: dict[str, tuple[str | None, int, int] | str], cfg: LoRATargetConfig, match_prefix: str = ""
) -> dict[str, LayerPlan]:
    """Which modules get LoRA, in the order of ``modules``.

    Args:
        modules: every module name of the model -> ``(kind, in_features, out_features)``
            for the kinds LoRA can adapt, or the module's type name for other modules.
        cfg: the targeting config.
        match_prefix: patterns are matched against ``match_prefix + name`` (a peft config
            written for a ``transformers`` model whose names have a wrapper prefix ours lack).

    Raises:
        TargetError: listing every pattern (``target_modules`` entries, ``rank_pattern``,
            ``alpha_pattern``, ``fused_slices``, ``modules_to_save`` keys) that matched no
            module, or naming a target module LoRA cannot adapt (with its type).
    """
    plans, unsupported = {}, []
    for name, info in modules.items():
        full = match_prefix + name
        if not name or not matches_target(full, cfg.target_modules) or _excluded_by_save(full, cfg.modules_to_save):
            continue
        if cfg.exclude_modules and matches_target(full, cfg.exclude_modules):
            continue
        if isinstance(info, str):
            unsupported.append(f"{name} ({info})")
            continue
        kind, fin, fout = info
        plans[name] = _layer_plan(name, full, kind, fin, fout, cfg)
    if unsupported:
        raise TargetError(
            f"LoRA target modules of a kind LoRA cannot adapt (supported: nn.Linear, GPT-2 Conv1D, "
            f"nn.Embedding): {unsupported}"
        )
    unmatched = _unmatched_patterns([match_prefix + n for n in modules if n], [match_prefix + n for n in plans], cfg)
    if unmatched:
        raise TargetError(f"LoRA config patterns that matched no module of the model: {unmatched}")
    if not plans:
        raise TargetError(f"target_modules {cfg.target_modules!r} matched only modules_to_save: nothing gets LoRA")
    return plans


def _layer_plan(name: str, full: str, kind: str, fin: int, fout: int, cfg: LoRATargetConfig) -> LayerPlan:
    rk, ak = pattern_key(cfg.rank_pattern, full), pattern_key(cfg.alpha_pattern, full)
    r = cfg.rank_pattern[rk] if rk is not None else cfg.r
    alpha = cfg.alpha_pattern[ak] if ak is not None else cfg.alpha
    sk = pattern_key(cfg.fused_slices, full)
    enable = cfg.fused_slices[sk] if sk is not None else None
    if enable is not None and (kind == "embedding" or fout % len(enable)):
        raise TargetError(f"{name}: fused_slices {enable} cannot split a {kind} layer with {fout} outputs")
    scaling = alpha / math.sqrt(r) if cfg.use_rslora else alpha / r
    return LayerPlan(name, kind, fin, fout, r, float(alpha), scaling, enable)


def _unmatched_patterns(names: list[str], plans: list[str], cfg: LoRATargetConfig) -> list[str]:
    out = []
    if isinstance(cfg.target_modules, str):  # (a target that matched only modules to save did match)
        if not any(matches_target(n, cfg.target_modules) for n in names):
            out.append(f"target_modules {cfg.target_modules!r}")
    else:
        out += [f"target_modules {t!r}" for t in cfg.target_modules if not any(matches_target(n, (t,)) for n in names)]
    for label, patterns in (
        ("rank_pattern", cfg.rank_pattern),
        ("alpha_pattern", cfg.alpha_pattern),
        ("fused_slices", cfg.fused_slices),
    ):
        out += [f"{label} {p!r}" for p in patterns if not any(pattern_key((p,), n) for n in plans)]
    saves = [m for m in cfg.modules_to_save if any(n.endswith(m) for n in names)]
    out += [f"modules_to_save {m!r}" for m in cfg.modules_to_save if m not in saves
            and not (m in TASK_HEADS and any(h in saves for h in TASK_HEADS))]  # fmt: skip
    excludes = (cfg.exclude_modules,) if isinstance(cfg.exclude_modules, str) else cfg.exclude_modules
    out += [
        f"exclude_modules {e!r}"
        for e in excludes
        if not any(matches_target(n, e if isinstance(cfg.exclude_modules, str) else (e,)) for n in names)
    ]
    return out


def trainable_names(
    param_names: list[str], plans: dict[str, LayerPlan], cfg: LoRATargetConfig, match_prefix: str = ""
) -> list[str]:
    """Parameter names that train (and that an adapter holds), in the given order: LoRA
    parameters, the biases ``cfg.bias`` selects, every parameter of ``modules_to_save``
    (matched, as the targets were, against ``match_prefix + name``)."""
    saved = {n for n in param_names if in_saved_module(match_prefix + n, cfg.modules_to_save)}
    out = []
    for n in param_names:
        module, _, leaf = n.rpartition(".")
        if leaf in ("lora_A", "lora_B") and module in plans:
            out.append(n)
        elif n in saved:
            out.append(n)
        elif leaf == "bias" and (cfg.bias == "all" or (cfg.bias == "lora_only" and module in plans)):
            out.append(n)
    return out


def in_saved_module(param: str, modules_to_save: tuple[str, ...]) -> bool:
    """A parameter inside a saved module (any prefix of its module path ends with an entry)."""
    parts = param.split(".")[:-1]
    return any(is_saved_module(".".join(parts[:i]), modules_to_save) for i in range(1, len(parts) + 1))


def init_lora_arrays(plans: dict[str, LayerPlan], seed: int = 0, b_std: float = 0.0) -> dict[str, np.ndarray]:
    """Initial LoRA values, seeded per module name (so they do not depend on module order).

    loralib / peft init: ``lora_A`` kaiming-uniform(a=sqrt 5) = U(-1/sqrt(in), 1/sqrt(in)),
    ``lora_B`` zeros; embeddings swapped (A zeros, B standard normal). ``b_std > 0`` draws
    the non-embedding ``lora_B`` from normal(0, b_std) (tests: a non-zero update).
    """
    out = {}
    for name, plan in plans.items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        (a_name, a_shape), (b_name, b_shape) = plan.shapes().items()
        if plan.kind == "embedding":
            a, b = np.zeros(a_shape), rng.normal(0.0, 1.0, size=b_shape)
        else:
            bound = 1.0 / math.sqrt(a_shape[1])
            a = rng.uniform(-bound, bound, size=a_shape)
            b = rng.normal(0.0, b_std, size=b_shape) if b_std > 0 else np.zeros(b_shape)
        out[a_name], out[b_name] = a.astype(np.float32), b.astype(np.float32)
    return out


def _check_int(what: str, v, low: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"LoRATargetConfig.{what} must be an int >= {low}, got {v!r}")


def _check_number(what: str, v) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"LoRATargetConfig.{what} must be a number > 0, got {v!r}")


def _check_regex(what: str, p) -> None:
    if not isinstance(p, str) or not p:
        raise ValueError(f"LoRATargetConfig.{what}: patterns must be non-empty strings, got {p!r}")
    try:
        re.compile(p)
    except re.error as e:
        raise ValueError(f"LoRATargetConfig.{what}: {p!r} is not a valid regex ({e})") from e


__all__ = [
    "LAYER_KINDS",
    "LayerPlan",
    "LoRATargetConfig",
    "TargetError",
    "init_lora_arrays",
    "is_saved_module",
    "matches_target",
    "pattern_key",
    "plan_injection",
    "trainable_names",
]
