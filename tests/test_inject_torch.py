"""``inject_lora`` on tiny random ``transformers`` models (GPT-2, DistilBERT, Llama) against
``peft`` (the independent reference): logits, LoRA gradients, merge/unmerge, adapters in
peft's format both ways, and the bad-input errors."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close

from lora_core import CheckpointError, LoRATargetConfig, TargetError
from lora_core.formats.peft_format import PEFT_WEIGHTS

peft = pytest.importorskip("peft")
tf = pytest.importorskip("transformers")
bt = pytest.importorskip("backends.torch")

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=120, n_positions=32, n_embd=32, n_layer=2, n_head=2))


def _distilbert(dim=32):
    return tf.DistilBertForSequenceClassification(
        tf.DistilBertConfig(
            vocab_size=120, dim=dim, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32, num_labels=2
        )
    )


def _llama():
    return tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=120,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )


CASES = {  # name: (model factory, our config)
    "gpt2": (_gpt2, LoRATargetConfig(r=4, alpha=8, target_modules=("c_attn", "c_proj", "wte"), bias="lora_only")),
    "distilbert": (
        _distilbert,
        LoRATargetConfig(
            r=4,
            alpha=8,
            target_modules=("q_lin", "v_lin"),
            modules_to_save=("classifier",),
            rank_pattern={r"layer\.1\.attention\.q_lin": 2},
        ),
    ),
    "llama": (_llama, LoRATargetConfig(r=64, alpha=16, target_modules=LLAMA_TARGETS, use_rslora=True)),
}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 120, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded row
    return ids, mask


def _models(name):
    """(base, ours): a random model and a copy with our LoRA, B made non-zero."""
    torch.manual_seed(0)
    factory, cfg = CASES[name]
    base = factory().eval()
    ours = copy.deepcopy(base)
    adapted = bt.inject_lora(ours, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if n.endswith("lora_B") or n.endswith("lora_A"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return base, ours, adapted


def _logits(model, seed=0):
    ids, mask = _inputs(seed)
    return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_grads_match_peft(name, tmp_path):
    base, ours, adapted = _models(name)
    assert adapted and all(n in dict(ours.named_modules()) for n in adapted)
    bt.save_lora_adapter(ours, tmp_path, format="peft")
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path, is_trainable=True).eval()
    a, b = _logits(ours), _logits(ref)
    assert_close(f"inject {name}: logits vs peft", a, b, 1e-5)
    assert (a - _logits(base)).abs().max() > 1e-3 * b.abs().max()  # the update is not zero
    a.square().mean().backward()
    b.square().mean().backward()
    theirs = dict(ref.named_parameters())
    trained = bt.trainable_parameters(ours)
    assert set(trained) == set(bt.lora_state_dict(ours))
    assert sum(p.numel() for p in trained.values()) == sum(p.numel() for p in theirs.values() if p.requires_grad)
    for n, p in trained.items():
        q = theirs[_peft_param(n, ours)]
        assert_close(f"inject {name}: grad {n.split('.')[-1]} vs peft", p.grad, q.grad, 1e-5)


def _peft_param(name, model):
    """Our parameter name -> the live peft parameter name (adapter 'default')."""
    module, _, leaf = name.rpartition(".")
    lora = module in model.lora_injection.plans
    pre = "base_model.model."
    if lora and leaf in ("lora_A", "lora_B"):
        emb = model.lora_injection.plans[module].kind == "embedding"
        return f"{pre}{module}.lora_embedding_{leaf[-1]}.default" if emb else f"{pre}{module}.{leaf}.default.weight"
    if lora:
        return f"{pre}{module}.base_layer.{leaf}"
    saved = next((m for m in model.lora_injection.config.modules_to_save if module.endswith(m)), None)
    return f"{pre}{module}.modules_to_save.default.{leaf}" if saved else pre + name


@pytest.mark.parametrize("name", ["gpt2", "distilbert"])
def test_peft_written_adapter_loads(name, tmp_path):
    torch.manual_seed(0)
    factory, cfg = CASES[name]
    base = factory().eval()
    pcfg = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        target_modules=list(cfg.target_modules),
        bias=cfg.bias,
        modules_to_save=list(cfg.modules_to_save) or None,
        rank_pattern=cfg.rank_pattern,
        init_lora_weights=False,
    )  # random B: a non-zero update
    theirs = peft.get_peft_model(copy.deepcopy(base), pcfg).eval()
    with torch.no_grad():  # trained-looking saved modules and biases
        for n, p in theirs.named_parameters():
            if p.requires_grad and "lora_" not in n:
                p.add_(0.1)
    theirs.save_pretrained(tmp_path)
    ours = copy.deepcopy(base)
    adapted = bt.load_lora_adapter(ours, tmp_path)
    assert set(adapted) == {
        n[len("base_model.model.") :]
        for n, m in theirs.named_modules()
        if hasattr(m, "lora_A") and hasattr(m, "base_layer")
    }
    assert_close(f"peft folder -> ours {name}: logits", _logits(ours), _logits(theirs), 1e-5)


def test_merge_unmerge_exactness_and_idempotence():
    _, ours, _ = _models("llama")
    before = _logits(ours).detach()
    w0 = {n: p.detach().clone() for n, p in ours.named_parameters() if n.endswith(".weight")}
    bt.merge_lora(ours)
    merged = {n: p.detach().clone() for n, p in ours.named_parameters()}
    bt.merge_lora(ours)  # twice: nothing changes
    assert all(torch.equal(merged[n], p) for n, p in ours.named_parameters())
    assert_close("inject llama: merged logits", _logits(ours), before, 1e-5)
    bt.unmerge_lora(ours)
    bt.unmerge_lora(ours)
    assert all(torch.equal(p, w0[n]) for n, p in ours.named_parameters() if n in w0)  # exact
    assert torch.equal(_logits(ours), before)


def test_adapter_round_trip_ours_format(tmp_path):
    _, ours, _ = _models("distilbert")
    bt.save_lora_adapter(ours, tmp_path)
    fresh = copy.deepcopy(_models("distilbert")[0])
    bt.load_lora_adapter(fresh, tmp_path)
    assert torch.equal(_logits(fresh), _logits(ours))
    assert {n for n, p in fresh.named_parameters() if p.requires_grad} == set(bt.lora_state_dict(ours))


def test_bad_inputs_name_the_problem(tmp_path):
    torch.manual_seed(0)
    with pytest.raises(TargetError, match=r"'query'.*'value'"):
        bt.inject_lora(_distilbert(), LoRATargetConfig(target_modules=("q_lin", "query", "value")))
    with pytest.raises(TargetError, match=r"layer\.0\.attention \(\w+Attention\)"):
        bt.inject_lora(_distilbert(), LoRATargetConfig(target_modules=("attention",)))
    _, ours, _ = _models("distilbert")
    with pytest.raises(TargetError, match="already has injected LoRA"):
        bt.inject_lora(ours, CASES["distilbert"][1])
    bt.save_lora_adapter(ours, tmp_path / "a", format="peft")
    # base shapes differ: a wider model; it is left unchanged
    wide = _distilbert(dim=48)
    with pytest.raises(
        CheckpointError,
        match=r"(?s)adapter_model.safetensors.*shape mismatches \(11\).*q_lin.lora_A.weight: file \(4, 32\) != model \(4, 48\)",
    ):
        bt.load_lora_adapter(wide, tmp_path / "a")
    assert not hasattr(wide, "lora_injection") and not any("lora_" in n for n, _ in wide.named_parameters())
    # a missing LoRA key is an error, not a zero B
    from safetensors.numpy import load_file, save_file

    w = load_file(tmp_path / "a" / PEFT_WEIGHTS)
    del w[next(k for k in w if k.endswith("lora_B.weight"))]
    save_file(w, tmp_path / "a" / PEFT_WEIGHTS)
    with pytest.raises(CheckpointError, match=r"(?s)missing keys \(1\).*lora_B\.weight"):
        bt.load_lora_adapter(_distilbert(), tmp_path / "a")


def test_peft_dora_folder_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    base = _distilbert()
    dora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=2, target_modules=["q_lin"], use_dora=True))
    dora.save_pretrained(tmp_path)
    fresh = copy.deepcopy(base)
    with pytest.raises(
        ValueError, match=r"adapter_config.json: peft adapter uses what lora_core cannot represent.*DoRA"
    ):
        bt.load_lora_adapter(fresh, tmp_path)
    assert not any("lora_" in n for n, _ in fresh.named_parameters())


def test_peft_exclude_modules_round_trip(tmp_path):
    torch.manual_seed(0)
    base = _distilbert().eval()
    pcfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_lin", "v_lin"], init_lora_weights=False,
                           exclude_modules=["layer.0.attention.q_lin"])  # fmt: skip
    theirs = peft.get_peft_model(copy.deepcopy(base), pcfg).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    ours = copy.deepcopy(base)
    adapted = bt.load_lora_adapter(ours, tmp_path / "theirs")
    assert "distilbert.transformer.layer.0.attention.q_lin" not in adapted and len(adapted) == 3
    assert_close("peft exclude_modules -> ours logits", _logits(ours), _logits(theirs), 1e-5)
    bt.save_lora_adapter(ours, tmp_path / "back", format="peft")
    again = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "back").eval()
    assert torch.equal(_logits(again), _logits(theirs))
