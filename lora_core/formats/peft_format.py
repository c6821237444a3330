"""peft's adapter format (``adapter_config.json`` + ``adapter_model.safetensors``), both ways.

Key layout written by ``peft.PeftModel.save_pretrained`` for LoRA (peft 0.x,
``peft.utils.save_and_load.get_peft_model_state_dict``), for a module path ``m`` of the
base model:

- Linear / Conv1D: ``base_model.model.{m}.lora_A.weight`` (r, in), ``...lora_B.weight`` (out, r)
- Embedding: ``base_model.model.{m}.lora_embedding_A`` (r, num), ``...lora_embedding_B`` (dim, r)
- the bias of an adapted layer: ``base_model.model.{m}.base_layer.bias``; other trained
  parameters (other biases, ``modules_to_save``): ``base_model.model.{name}``.

These are our canonical names and layouts with other spellings, so conversion is a renaming.
Our models may name modules without a wrapper prefix that the ``transformers`` model has
(our GPT-2 has ``h.0...``, ``GPT2LMHeadModel`` ``transformer.h.0...``): ``module_prefix``
is that prefix, declared by the model class, never guessed. The config's fields are read,
and every feature we cannot represent (DoRA, layer replication, ...) is refused by name.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..lora.targeting import LayerPlan, LoRATargetConfig, matches_target, pattern_key

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PeftModel.base_model (LoraModel) .model (the wrapped model)

# peft LoraConfig fields that change what the adapter computes and that we do not implement:
# refused when set to anything but their "off" value.
UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "LoRA bias on lora_B",
    "layers_to_transform": "layers_to_transform",
    "layers_pattern": "layers_pattern",
    "layer_replication": "layer replication",
    "target_parameters": "target_parameters (LoRA on nn.Parameter)",
    "trainable_token_indices": "trainable tokens",
    "use_qalora": "QA-LoRA",
    "megatron_config": "Megatron layers",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "arrow_config": "Arrow routing",
    "loftq_config": "LoftQ",
    "use_bdlora": "BD-LoRA",
    "corda_config": "CorDA",
    "eva_config": "EVA",
    "modules_to_tie": "modules_to_tie",
    "kasa_config": "KaSA",
    "lora_ga_config": "LoRA-GA",
    "monteclora_config": "MonteCLoRA",
    "velora_config": "VeLoRA",
}
# Fields that only describe the adapter (provenance, bookkeeping): read and not needed.
METADATA = (
    "base_model_name_or_path",
    "revision",
    "task_type",
    "inference_mode",
    "auto_mapping",
    "peft_version",
    "qalora_group_size",
    "megatron_core",
    "ensure_weight_tying",
)
# init_lora_weights values that only choose the initial lora_A/lora_B (loaded values replace them);
# the others (pissa, olora, corda, loftq, eva, orthogonal...) also change the base weights.
_PLAIN_INITS = (True, False, "gaussian")


def is_peft_config(meta: dict) -> bool:
    return "peft_type" in meta


def config_from_peft(meta: dict, path) -> LoRATargetConfig:
    """Our targeting config from a peft ``adapter_config.json`` (already parsed).

    Raises:
        ValueError: naming ``path`` and the feature, for a non-LoRA peft type, a feature
            of ``UNSUPPORTED``, a base-changing ``init_lora_weights``, missing
            ``target_modules`` (peft would pick per-model defaults: not guessed here),
            or any unknown field that is set.
    """
    if meta.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {meta.get('peft_type')!r} is not supported (only LORA)")
    refused = [f"{UNSUPPORTED[k]} ({k}={v!r})" for k, v in meta.items() if k in UNSUPPORTED and _is_set(v)]
    known = (
        set(UNSUPPORTED)
        | set(METADATA)
        | {
            "peft_type",
            "r",
            "lora_alpha",
            "target_modules",
            "exclude_modules",
            "rank_pattern",
            "alpha_pattern",
            "lora_dropout",
            "bias",
            "modules_to_save",
            "fan_in_fan_out",
            "use_rslora",
            "init_lora_weights",
        }
    )
    refused += [f"unknown field {k}={v!r}" for k, v in meta.items() if k not in known and _is_set(v)]
    if meta.get("init_lora_weights", True) not in _PLAIN_INITS:
        refused.append(f"init_lora_weights={meta['init_lora_weights']!r} (changes the base weights)")
    if meta.get("target_modules") in (None, [], ""):
        refused.append("target_modules is not set (peft's per-model defaults are not guessed)")
    if not isinstance(meta.get("fan_in_fan_out", False), bool):
        refused.append(f"fan_in_fan_out={meta['fan_in_fan_out']!r} is not a boolean")
    if refused:
        raise ValueError(f"{path}: peft adapter uses what lora_core cannot represent: {refused}")
    targets, exclude = meta["target_modules"], meta.get("exclude_modules") or ()
    try:
        return LoRATargetConfig(
            r=meta["r"],
            alpha=meta["lora_alpha"],
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            exclude_modules=exclude if isinstance(exclude, str) else tuple(exclude),
            rank_pattern=dict(meta.get("rank_pattern") or {}),
            alpha_pattern=dict(meta.get("alpha_pattern") or {}),
            dropout=meta.get("lora_dropout", 0.0),
            bias=meta.get("bias", "none"),
            modules_to_save=tuple(meta.get("modules_to_save") or ()),
            use_rslora=bool(meta.get("use_rslora", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid peft LoRA config ({type(e).__name__}: {e})") from e


def config_to_peft(
    cfg: LoRATargetConfig,
    plans: dict[str, LayerPlan],
    module_prefix: str = "",
    base_model_name_or_path: str | None = None,
    task_type: str | None = None,
) -> dict:
    """``adapter_config.json`` for ``peft.PeftModel.from_pretrained``.

    ``fan_in_fan_out`` is True when a Conv1D layer is adapted (what peft sets for GPT-2).
    ``module_prefix``: the prefix peft's module names have and those our patterns were matched
    against lack (``"transformer."`` for our GPT-2; ``""`` when they are the same). peft matches
    every pattern against its full names, so each pattern is rewritten to select under peft's
    rules, on ``module_prefix + name``, exactly the modules it selects here on ``name``
    (``_target_for_peft``, ``_key_for_peft``); one that cannot be rewritten faithfully (a
    lookbehind, a numbered backreference, verbose mode, a comment group) is refused with a ValueError naming it.
    A per-slice fused layer (GPT-2's q, v ``c_attn``) has no peft layer; it is written exactly
    as one matrix of rank ``k*r`` (``sliced_as_whole``) with its own ``rank_pattern`` /
    ``alpha_pattern`` entry keeping the scaling."""
    targets = _for_peft(cfg.target_modules, module_prefix, "target_modules")
    exclude = _for_peft(cfg.exclude_modules, module_prefix, "exclude_modules")
    rank_pattern = {_key_for_peft(p, module_prefix, "rank_pattern"): v for p, v in cfg.rank_pattern.items()}
    alpha_pattern = {_key_for_peft(p, module_prefix, "alpha_pattern"): v for p, v in cfg.alpha_pattern.items()}
    for name, plan in plans.items():
        if plan.enable is None:
            continue
        # the module's own entries come after the user's and peft takes the first that matches:
        # no user pattern may match it (checked on our names, as plan_injection matched them)
        clash = [p for p in (*cfg.rank_pattern, *cfg.alpha_pattern) if pattern_key((p,), name)]
        if clash:
            raise ValueError(
                f"{name}: per-slice LoRA and rank/alpha patterns {clash} on the same module have no peft form"
            )
        key = re.escape(module_prefix + name)
        others = [n for n in plans if n != name and pattern_key((key,), module_prefix + n)]
        if others:
            raise ValueError(f"{name}: its peft rank/alpha entry {key!r} would also select {others}")
        r_whole = plan.r * sum(plan.enable)
        rank_pattern[key] = r_whole
        alpha_pattern[key] = plan.scaling * (math.sqrt(r_whole) if cfg.use_rslora else r_whole)
    if module_prefix:
        _check_same_plans(plans, module_prefix, targets, exclude or (), rank_pattern, alpha_pattern, cfg)
    return {
        "peft_type": "LORA",
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "target_modules": targets,
        "exclude_modules": exclude or None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "lora_dropout": cfg.dropout,
        "bias": cfg.bias,
        "modules_to_save": list(cfg.modules_to_save) or None,
        "fan_in_fan_out": any(p.kind == "conv1d" for p in plans.values()),
        "use_rslora": cfg.use_rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "base_model_name_or_path": base_model_name_or_path,
        "task_type": task_type,
    }


def _check_same_plans(plans, prefix, targets, exclude, rank_pattern, alpha_pattern, cfg: LoRATargetConfig) -> None:
    """Guard of the rewrite: under peft's rules, on peft's names, every adapted module is targeted,
    not excluded, and gets the r and alpha (hence the scaling) it has here."""
    bad = []
    for name, plan in plans.items():
        full = prefix + name
        r_key, a_key = pattern_key(rank_pattern, full), pattern_key(alpha_pattern, full)
        r = rank_pattern[r_key] if r_key is not None else cfg.r
        alpha = alpha_pattern[a_key] if a_key is not None else cfg.alpha
        scaling = alpha / math.sqrt(r) if cfg.use_rslora else alpha / r
        r_here = plan.r * (1 if plan.enable is None else sum(plan.enable))
        if (not matches_target(full, targets) or (exclude and matches_target(full, exclude))
                or r != r_here or not math.isclose(scaling, plan.scaling, rel_tol=1e-12)):  # fmt: skip
            bad.append(name)
    if bad:
        raise ValueError(f"the patterns written for peft would not adapt {bad} as here (lora_core bug: please report)")


def sliced_as_whole(plan: LayerPlan, B: np.ndarray) -> np.ndarray:
    """``lora_B`` of a per-slice layer as one (out, k*r) matrix: block j (enabled slice i)
    holds ``B[j*o:(j+1)*o]`` at rows of slice i, columns ``j*r:(j+1)*r``; zeros elsewhere.
    With the stacked ``lora_A`` (k*r, in) unchanged, ``B' A = `` the per-slice update."""
    o, r = plan.out_features // len(plan.enable), plan.r
    whole = np.zeros((plan.out_features, r * sum(plan.enable)), dtype=B.dtype)
    for j, i in enumerate(i for i, on in enumerate(plan.enable) if on):
        whole[i * o : (i + 1) * o, j * r : (j + 1) * r] = B[j * o : (j + 1) * o]
    return whole


def tensors_to_peft(
    tensors: dict[str, np.ndarray], plans: dict[str, LayerPlan], module_prefix: str = ""
) -> dict[str, np.ndarray]:
    """Canonical adapter tensors -> peft's keys (per-slice ``lora_B`` made whole)."""
    out = {}
    for name, v in tensors.items():
        module, _, leaf = name.rpartition(".")
        plan = plans.get(module)
        if plan is not None and plan.enable is not None and leaf == "lora_B":
            v = sliced_as_whole(plan, v)
        out[peft_key(name, plans, module_prefix)] = v
    return out


def peft_key(name: str, plans: dict[str, LayerPlan], module_prefix: str = "") -> str:
    """Canonical parameter name -> its key in ``adapter_model.safetensors``."""
    module, _, leaf = name.rpartition(".")
    plan = plans.get(module)
    full = KEY_PREFIX + module_prefix + module
    if plan is not None and leaf in ("lora_A", "lora_B"):
        return f"{full}.lora_embedding_{leaf[-1]}" if plan.kind == "embedding" else f"{full}.{leaf}.weight"
    if plan is not None and leaf == "bias":
        return f"{full}.base_layer.bias"
    return KEY_PREFIX + module_prefix + name


def _for_peft(patterns: tuple[str, ...] | str, module_prefix: str, what: str):
    """``target_modules`` / ``exclude_modules`` for peft: names / suffixes as a sorted list (a
    name or dotted suffix of ours is one of peft's full name: the same modules), a regex
    rewritten by ``_target_for_peft``."""
    if isinstance(patterns, str):
        return _target_for_peft(patterns, module_prefix, what)
    return sorted(patterns)


# peft 0.x matching, on its full module names ("transformer.h.0.attn.c_attn"):
# - target_modules / exclude_modules as a str, ``peft.utils.other.match_target_against_key``:
#       return re.fullmatch(target_pattern, key)
# - rank_pattern / alpha_pattern keys, ``peft.utils.other.get_pattern_key`` (first key that matches wins):
#       for key in pattern_keys:
#           match = re.match(rf"(.*\.)?({key})$", key_to_match)
# Ours (``lora_core.lora.targeting``) are the same on our names ("h.0.attn.c_attn"). For a prefix P
# a pattern is rewritten so that, on P + name, it matches iff the original matches name:
# - a regex target t: ``P(?:t')``, a key k: ``^P(?:.*\.)?(?:k')`` (the ``^`` forces peft's ``(.*\.)?``
#   to be empty, so the optional dotted head is matched inside our name only, as here);
# - t', k': each ``^`` / ``\A`` (start of our name) becomes ``(?<=^P)``, true exactly where our name
#   starts in P + name. ``$``, ``\Z``, ``\b``, ``\B`` mean the same at both (P ends with ".").
# Group numbers stay (the added groups are non-capturing, peft's own two groups are ours too).
# A lookbehind could see P, a numbered backreference could name peft's groups where ours are not
# (the pattern's own groups keep their numbers), verbose mode and comments change what ``^`` and
# ``[`` are: refused. A plain dotted name that cannot start inside P is kept as it is (it
# already selects the same modules).
_LEADING_FLAGS = re.compile(r"\(\?[aiLmsux]+\)")
_PLAIN_NAME = re.compile(r"(?:[\w-]|\\\.)+")


def _target_for_peft(p: str, prefix: str, what: str) -> str:
    if not prefix:
        return p
    flags, body = _split_flags(p, what)
    return f"{flags}{re.escape(prefix)}(?:{_anchor_at(body, prefix, p, what)})"


def _key_for_peft(p: str, prefix: str, what: str) -> str:
    if not prefix:
        return p
    if _PLAIN_NAME.fullmatch(p):
        name = p.replace("\\.", ".")
        heads = [prefix[i + 1 :] for i, c in enumerate(prefix) if c == "."] + [prefix]
        if not any(h and name.startswith(h) for h in heads):
            return p
    flags, body = _split_flags(p, what)
    return f"{flags}^{re.escape(prefix)}(?:.*\\.)?(?:{_anchor_at(body, prefix, p, what)})"


def _split_flags(p: str, what: str) -> tuple[str, str]:
    """Leading global flags (``(?i)``: Python wants them first) and the rest."""
    flags = ""
    while m := _LEADING_FLAGS.match(p, len(flags)):
        flags = p[: m.end()]
    if "x" in flags:
        raise _unfaithful(what, p, "verbose mode")
    return flags, p[len(flags) :]


def _anchor_at(body: str, prefix: str, p: str, what: str) -> str:
    """``body`` with each start anchor (``^``, ``\\A`` outside a character class) meaning the start
    of our name inside ``prefix + name``."""
    start = f"(?<=^{re.escape(prefix)})"
    if not prefix.endswith("."):
        raise _unfaithful(what, p, f"module prefix {prefix!r} does not end with '.'")
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            nxt = body[i + 1 : i + 2]
            if nxt == "A":
                out.append(start)
            elif nxt and nxt in "123456789":
                raise _unfaithful(what, p, "a numbered backreference")
            else:
                out.append(body[i : i + 2])
            i += 2
        elif c == "[":  # a character class, copied: "^" / "]" first in it are no anchor / no end
            j = i + 1
            j += body[j : j + 1] == "^"
            j += body[j : j + 1] == "]"
            while j < len(body) and body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            out.append(body[i : j + 1])
            i = j + 1
        elif c == "^":
            out.append(start)
            i += 1
        else:
            if body.startswith(("(?<=", "(?<!"), i):
                raise _unfaithful(what, p, "a lookbehind")
            if body.startswith("(?#", i):
                raise _unfaithful(what, p, "a comment group")
            m = re.compile(r"\(\?[aiLmsux-]+[:)]").match(body, i)
            if m and "x" in m.group():
                raise _unfaithful(what, p, "verbose mode")
            out.append(c)
            i += 1
    return "".join(out)


def _unfaithful(what: str, p: str, why: str) -> ValueError:
    return ValueError(
        f"{what} pattern {p!r} ({why}) cannot be rewritten for peft's full module names so that it "
        f"selects the same modules: not saved in peft's format (the lora_core format keeps it)"
    )


def _is_set(v) -> bool:
    return v not in (None, False, "", [], {}, ())


__all__ = [
    "KEY_PREFIX",
    "PEFT_CONFIG",
    "PEFT_WEIGHTS",
    "UNSUPPORTED",
    "config_from_peft",
    "config_to_peft",
    "is_peft_config",
    "peft_key",
    "sliced_as_whole",
    "tensors_to_peft",
]
