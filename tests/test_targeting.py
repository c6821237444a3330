"""The framework-free spec of LoRA for any model: peft's matching rules, plans, errors,
the peft config reader's refusals, and the numpy reference of the Conv1D form."""

from __future__ import annotations

import re

import numpy as np
import pytest

from lora_core.formats.peft_format import config_from_peft, config_to_peft, peft_key, sliced_as_whole
from lora_core.lora import reference as ref
from lora_core.lora.targeting import LoRATargetConfig, TargetError, init_lora_arrays, plan_injection, trainable_names
from lora_core.models.gpt2 import LoRAConfig

# module name -> (kind, in, out) or type name: a DistilBERT-like layout
MODULES = {
    "": "Model",
    "bert": "Bert",
    "bert.emb": ("embedding", 100, 32),
    **{f"bert.layer.{i}.attention.{p}": ("linear", 32, 32) for i in range(2) for p in ("q_lin", "k_lin", "v_lin")},
    "bert.layer.0.attention": "Attention",
    "pre_classifier": ("linear", 32, 32),
    "classifier": ("linear", 32, 2),
}
PARAMS = [f"{m}.{leaf}" for m, info in MODULES.items() if isinstance(info, tuple) for leaf in ("weight", "bias")]


def test_suffix_exact_and_regex_matching():
    by_suffix = plan_injection(
        MODULES, LoRATargetConfig(r=4, alpha=8, target_modules=("q_lin", "bert.layer.1.attention.v_lin"))
    )
    assert list(by_suffix) == [
        "bert.layer.0.attention.q_lin",
        "bert.layer.1.attention.q_lin",
        "bert.layer.1.attention.v_lin",
    ]
    by_regex = plan_injection(MODULES, LoRATargetConfig(target_modules=r"bert\.layer\.0\.attention\.(q|v)_lin"))
    assert list(by_regex) == ["bert.layer.0.attention.q_lin", "bert.layer.0.attention.v_lin"]
    # a regex must match the whole name (peft: re.fullmatch)
    with pytest.raises(TargetError, match="q_lin"):
        plan_injection(MODULES, LoRATargetConfig(target_modules="q_lin"))


def test_rank_alpha_patterns_and_rslora():
    cfg = LoRATargetConfig(
        r=4,
        alpha=8,
        target_modules=("q_lin", "v_lin"),
        rank_pattern={r"layer\.1\.attention\.q_lin": 2},
        alpha_pattern={"v_lin": 16},
    )
    plans = plan_injection(MODULES, cfg)
    assert plans["bert.layer.1.attention.q_lin"].r == 2 and plans["bert.layer.0.attention.q_lin"].r == 4
    assert plans["bert.layer.0.attention.v_lin"].scaling == 16 / 4
    assert plans["bert.layer.1.attention.q_lin"].shapes() == {
        "bert.layer.1.attention.q_lin.lora_A": (2, 32),
        "bert.layer.1.attention.q_lin.lora_B": (32, 2),
    }
    rs = plan_injection(MODULES, LoRATargetConfig(r=16, alpha=8, target_modules=("q_lin",), use_rslora=True))
    assert rs["bert.layer.0.attention.q_lin"].scaling == ref.rslora_scaling(8, 16) == 2.0


def test_every_unmatched_pattern_is_listed():
    cfg = LoRATargetConfig(
        target_modules=("q_lin", "query", "value"), rank_pattern={"nothing": 2}, modules_to_save=("score",)
    )
    with pytest.raises(TargetError) as e:
        plan_injection(MODULES, cfg)
    msg = str(e.value)
    for pattern in ("'query'", "'value'", "rank_pattern 'nothing'", "modules_to_save 'score'"):
        assert pattern in msg
    assert "'q_lin'" not in msg


def test_target_of_unsupported_kind_is_named():
    with pytest.raises(TargetError, match=r"bert\.layer\.0\.attention \(Attention\)"):
        plan_injection(MODULES, LoRATargetConfig(target_modules=("attention",)))


def test_modules_to_save_and_bias_follow_peft():
    # peft selects modules to save by a string suffix: "classifier" also takes pre_classifier,
    # and never puts LoRA inside them
    cfg = LoRATargetConfig(target_modules=("q_lin", "classifier"), modules_to_save=("classifier",), bias="lora_only")
    plans = plan_injection(MODULES, cfg)
    assert list(plans) == ["bert.layer.0.attention.q_lin", "bert.layer.1.attention.q_lin"]
    names = trainable_names(PARAMS + [f"{m}.lora_{x}" for m in plans for x in "AB"], plans, cfg)
    assert set(names) == {
        "pre_classifier.weight",
        "pre_classifier.bias",
        "classifier.weight",
        "classifier.bias",
        *(f"{m}.{leaf}" for m in plans for leaf in ("bias", "lora_A", "lora_B")),
    }


def test_gpt2_config_keeps_per_slice_and_whole_forms():
    gpt2 = {"h.0.attn.c_attn": ("conv1d", 32, 96), "h.0.attn.c_proj": ("conv1d", 32, 32)}
    sliced = plan_injection(gpt2, LoRATargetConfig.from_gpt2(LoRAConfig(r=4)))
    assert list(sliced) == ["h.0.attn.c_attn"] and sliced["h.0.attn.c_attn"].enable == (True, False, True)
    assert sliced["h.0.attn.c_attn"].shapes()["h.0.attn.c_attn.lora_B"] == (64, 4)
    whole = plan_injection(gpt2, LoRATargetConfig.from_gpt2(LoRAConfig(r=4, enable_lora=None)))
    assert whole["h.0.attn.c_attn"].enable is None and whole["h.0.attn.c_attn"].shapes()["h.0.attn.c_attn.lora_B"] == (
        96,
        4,
    )


def test_config_round_trip_and_seeded_init():
    cfg = LoRATargetConfig(
        r=4,
        alpha=8,
        target_modules=("q_lin",),
        rank_pattern={"a": 2},
        modules_to_save=("classifier",),
        fused_slices={"qkv": (True, False, True)},
        dropout=0.1,
        bias="all",
    )
    assert LoRATargetConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown keys"):
        LoRATargetConfig.from_dict({**cfg.to_dict(), "rank": 4})
    with pytest.raises(ValueError, match="not a valid regex"):
        LoRATargetConfig(target_modules="q_lin(")
    plans = plan_injection(MODULES, LoRATargetConfig(target_modules=("q_lin", "emb")))
    a, b = init_lora_arrays(plans, seed=3), init_lora_arrays(dict(reversed(plans.items())), seed=3)
    assert all(np.array_equal(a[k], b[k]) for k in a)  # per-module seeds: order does not matter
    assert np.abs(a["bert.layer.0.attention.q_lin.lora_A"]).max() <= 1 / np.sqrt(32)
    assert not a["bert.emb.lora_A"].any() and a["bert.emb.lora_B"].any()  # embedding: A zeros, B normal


def _peft_meta(**over):
    meta = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_lin"],
        "lora_dropout": 0.0,
        "bias": "none",
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "task_type": "SEQ_CLS",
    }
    meta.update(over)
    return meta


@pytest.mark.parametrize(
    "over, named",
    [
        ({"use_dora": True}, "DoRA"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"target_modules": None}, "target_modules is not set"),
        ({"init_lora_weights": "pissa"}, "pissa"),
        ({"some_new_feature": 3}, "some_new_feature"),
    ],
)
def test_peft_config_refuses_by_name(over, named):
    with pytest.raises(ValueError, match=named) as e:
        config_from_peft(_peft_meta(**over), "x/adapter_config.json")
    assert "x/adapter_config.json" in str(e.value)


def test_peft_config_read_and_keys():
    cfg = config_from_peft(
        _peft_meta(
            rank_pattern={"q_lin": 2},
            use_rslora=True,
            modules_to_save=["classifier"],
            fan_in_fan_out=True,
            base_model_name_or_path="x",
        ),
        "p",
    )
    assert cfg.rank_pattern == {"q_lin": 2} and cfg.use_rslora and cfg.modules_to_save == ("classifier",)
    plans = plan_injection({**MODULES, "classifier": "Linear"}, cfg)
    meta = config_to_peft(cfg, plans)
    assert meta["peft_type"] == "LORA" and meta["r"] == 4 and meta["use_rslora"] and meta["fan_in_fan_out"] is False
    q = "bert.layer.0.attention.q_lin"
    assert peft_key(f"{q}.lora_A", plans) == f"base_model.model.{q}.lora_A.weight"
    assert peft_key(f"{q}.bias", plans, "m.") == f"base_model.model.m.{q}.base_layer.bias"
    assert peft_key("classifier.weight", plans) == "base_model.model.classifier.weight"
    emb = plan_injection(MODULES, LoRATargetConfig(target_modules=("emb",)))
    assert peft_key("bert.emb.lora_B", emb) == "base_model.model.bert.emb.lora_embedding_B"


def test_per_slice_layer_in_peft_form_is_exact():
    cfg = LoRATargetConfig(r=2, alpha=6, target_modules=("qkv",), fused_slices={"qkv": (True, False, True)})
    plan = plan_injection({"m.qkv": ("linear", 8, 24)}, cfg)
    meta = config_to_peft(cfg, plan)
    assert meta["rank_pattern"] == {r"m\.qkv": 4} and meta["alpha_pattern"] == {r"m\.qkv": 3.0 * 4}
    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(4, 8)), rng.normal(size=(16, 2))
    whole = sliced_as_whole(plan["m.qkv"], B)
    np.testing.assert_allclose(12.0 / 4 * whole @ A, ref.lora_delta(A, B, 3.0, 24, (True, False, True)), rtol=1e-12)
    with pytest.raises(ValueError, match="no peft form"):
        config_to_peft(
            LoRATargetConfig(target_modules=("qkv",), rank_pattern={"qkv": 2}, fused_slices={"qkv": (True, True)}),
            plan_injection(
                {"m.qkv": ("linear", 8, 24)},
                LoRATargetConfig(target_modules=("qkv",), rank_pattern={"qkv": 2}, fused_slices={"qkv": (True, True)}),
            ),
        )


def test_reference_conv1d_is_transposed_linear():
    rng = np.random.default_rng(0)
    x, W, b = rng.normal(size=(3, 8)), rng.normal(size=(8, 12)), rng.normal(size=12)
    A, B = rng.normal(size=(2 * 2, 8)), rng.normal(size=(8, 2))
    y = ref.lora_conv1d(x, W, b, A, B, 0.5, (True, False, True))
    merged = ref.merge_conv1d(W, A, B, 0.5, (True, False, True))
    np.testing.assert_allclose(y, x @ merged + b, rtol=1e-12)
    assert np.array_equal(y[:, 4:8], x @ W[:, 4:8] + b[4:8])  # the disabled (k) slice is untouched


def test_exclude_modules():
    cfg = LoRATargetConfig(target_modules=("q_lin", "v_lin"), exclude_modules=("layer.0.attention.q_lin",))
    assert "bert.layer.0.attention.q_lin" not in plan_injection(MODULES, cfg)
    regex = LoRATargetConfig(target_modules=("q_lin", "v_lin"), exclude_modules=r".*layer\.1\..*")
    assert all(".layer.0." in n for n in plan_injection(MODULES, regex))
    with pytest.raises(TargetError, match="exclude_modules 'nothing'"):
        plan_injection(MODULES, LoRATargetConfig(target_modules=("q_lin",), exclude_modules=("nothing",)))
    assert LoRATargetConfig.from_dict(regex.to_dict()) == regex and LoRATargetConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("fmt", ["lora_core", "peft"])
def test_overlapping_patterns_keep_their_order_on_disk(fmt, tmp_path):
    """Two ``alpha_pattern`` / ``rank_pattern`` entries matching one module: the first wins (peft's
    rule), so the saved config keeps the patterns' order (JSON files were written with every key
    sorted, which put ``layers\\.0...`` first and gave layer 0's q_proj alpha 5 and rank 2 once
    reloaded: logits 2e-2 apart), and the reloaded adapter gives the same logits."""
    import torch

    import lora_core as lc
    from lora_core.models.llama import init_llama_weights, llama_config

    bk = lc.get_backend("torch")
    cfg = llama_config("tiny-llama")

    def model():
        m = bk.LlamaForCausalLM(cfg)
        m.load_weights(init_llama_weights(cfg, 0))
        return m

    rank = {"q_proj": 4, r"layers\.0\.self_attn\.q_proj": 2}
    alpha = {"q_proj": 3, r"layers\.0\.self_attn\.q_proj": 5}
    m = model()
    bk.inject_lora(m, lc.LoRATargetConfig(r=8, alpha=8, target_modules=("q_proj",), rank_pattern=rank,
                                          alpha_pattern=alpha))  # fmt: skip
    assert m.model.layers[0].self_attn.q_proj.lora_A.shape[0] == 4
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ids = torch.tensor([[1, 5, 9, 17, 33, 65]])
    m.eval()
    with torch.no_grad():
        ref_logits = m(ids)[0]
    bk.save_lora_adapter(m, tmp_path / "a", format=fmt)
    text = (tmp_path / "a" / "adapter_config.json").read_text()
    assert text.index('"q_proj": 3') < text.index('"layers\\\\.0\\\\.self_attn\\\\.q_proj": 5'), text
    m2 = model()
    bk.load_lora_adapter(m2, tmp_path / "a")
    m2.eval()
    assert m2.model.layers[0].self_attn.q_proj.lora_A.shape[0] == 4
    with torch.no_grad():
        np.testing.assert_allclose(m2(ids)[0].numpy(), ref_logits.numpy(), rtol=0, atol=1e-6)


# GPT-2's module names here (ours) and in transformers' GPT2LMHeadModel (peft's): "transformer." + ours
_GPT2 = {**{f"h.{i}.{m}": ("conv1d", 8, 24 if m == "attn.c_attn" else 8) for i in range(3)
            for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")},
         "wte": ("embedding", 50, 8), "wpe": ("embedding", 16, 8), "h.0": "Block", "h.1.attn": "Attention"}  # fmt: skip


def _peft_rule(meta: dict, names) -> dict:
    """What peft 0.x makes of ``meta`` on its full names (its own matching functions): module ->
    (r, alpha) of every targeted one."""
    other = pytest.importorskip("peft.utils.other")
    out = {}
    for n in names:
        targets, exclude = meta["target_modules"], meta["exclude_modules"] or ()
        hit = other.match_target_against_key(targets, n) if isinstance(targets, str) else (
            n in targets or any(n.endswith("." + t) for t in targets))  # fmt: skip
        if exclude and (re.fullmatch(exclude, n) if isinstance(exclude, str) else
                        n in exclude or any(n.endswith("." + e) for e in exclude)):  # fmt: skip
            hit = False
        if hit:
            r_key = other.get_pattern_key(meta["rank_pattern"].keys(), n)
            a_key = other.get_pattern_key(meta["alpha_pattern"].keys(), n)
            out[n] = (meta["rank_pattern"].get(r_key, meta["r"]), meta["alpha_pattern"].get(a_key, meta["lora_alpha"]))
    return out


@pytest.mark.parametrize("kw", [
    dict(target_modules=("c_attn",), alpha_pattern={r"^h\.1\.attn\.c_attn": 32.0}),
    dict(target_modules=("c_attn",), rank_pattern={r"^h\.0\.attn\.c_attn": 2}),
    dict(target_modules=r"^h\.1\.(attn|mlp)\..*"),
    dict(target_modules=r"(?i)\AH\.[01]\.(attn|mlp)\.c_(attn|fc)", exclude_modules=r"^h\.0\.mlp\..*",
         rank_pattern={r"[^.]\.0\.attn\.c_attn|\Ah\.1\.mlp\.c_fc": 2, "c_fc": 3}, alpha_pattern={"h.1.attn.c_attn": 5.0}),
    dict(target_modules=("c_attn", "mlp.c_proj", "wte"), rank_pattern={r"h\.\d\.mlp\.c_proj$": 2, "wte": 3},
         alpha_pattern={r"h\.[01]\..*c_attn|wte": 7.0}, fused_slices={r"^h\.2\.attn\.c_attn": (True, False, True)}),
], ids=["anchored-alpha", "anchored-rank", "anchored-regex-target", "mixed", "unanchored-and-sliced"])  # fmt: skip
def test_patterns_saved_for_peft_select_the_same_modules_under_its_prefix(kw):
    """Our GPT-2's patterns are matched on ``h.0.attn.c_attn``, peft's on
    ``transformer.h.0.attn.c_attn``: written for peft, each module is targeted or not, and gets
    r and alpha, as here (peft's own matching functions on every module name); read back with
    the prefix, the same plans."""
    cfg = LoRATargetConfig(r=4, alpha=8.0, **kw)
    plans = plan_injection(_GPT2, cfg)
    meta = config_to_peft(cfg, plans, "transformer.")
    got = _peft_rule(meta, ["transformer." + n for n in _GPT2])
    want = {"transformer." + n: (p.r * (1 if p.enable is None else sum(p.enable)),
                                 p.alpha if p.enable is None else p.scaling * p.r * sum(p.enable))
            for n, p in plans.items()}  # fmt: skip
    assert got == want
    back = plan_injection(_GPT2, config_from_peft(meta, "adapter_config.json"), match_prefix="transformer.")
    assert {n: (p.r * (1 if p.enable is None else sum(p.enable)), p.scaling) for n, p in back.items()} == \
        {n: (p.r * (1 if p.enable is None else sum(p.enable)), p.scaling) for n, p in plans.items()}  # fmt: skip
    assert config_to_peft(cfg, plans)["rank_pattern"] == {**cfg.rank_pattern, **{
        re.escape(n): p.r * sum(p.enable) for n, p in plans.items() if p.enable}}  # no prefix: as they are  # fmt: skip


@pytest.mark.parametrize("kw", [dict(alpha_pattern={r"(?<!\.)h\.1\.attn\.c_attn": 4.0}),
                                dict(rank_pattern={r"(h)\.1\.attn\.c_attn(?!\1)": 2}),
                                dict(target_modules=r"(?x) h \. 1 \. attn \. c_attn"),
                                dict(target_modules=r"(?#[)^h\.1\.attn\.c_attn")],
                         ids=["lookbehind", "backreference", "verbose", "comment"])  # fmt: skip
def test_patterns_peft_would_read_otherwise_are_refused_by_name(kw):
    cfg = LoRATargetConfig(r=4, alpha=8.0, **{"target_modules": ("c_attn",), **kw})
    plans = plan_injection(_GPT2, cfg)
    (pattern,) = (kw.get("alpha_pattern") or kw.get("rank_pattern") or {kw["target_modules"]: 0}).keys()
    with pytest.raises(ValueError, match=re.escape(repr(pattern))):
        config_to_peft(cfg, plans, "transformer.")
