"""Injected LoRA in both backends: peft adapters written by ``peft`` on ``transformers``'
GPT-2 load into our GPT-2 (``from_pretrained(base, adapter=peft_dir)``) with peft's logits;
adapters we save in peft's format load into ``peft.PeftModel``; jittor agrees with torch
(logits, gradients); any jittor module against the numpy reference; generic injection of
GPT-2's ``LoRAConfig`` reproduces the built-in GPT-2 LoRA (per-slice q, v)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import assert_close, to_numpy

import lora_core as lc
from lora_core.lora import reference as ref
from lora_core.lora.targeting import LoRATargetConfig

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TARGETS = ["c_attn", "c_proj", "c_fc"]


@pytest.fixture(scope="module")
def gpt2_dirs(tmp_path_factory):
    """A tiny random HF GPT-2 saved with save_pretrained, and a peft adapter on it (random A, B)."""
    hf_cfg = transformers.GPT2Config(
        vocab_size=150, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(7)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    root = tmp_path_factory.mktemp("inject")
    hf.save_pretrained(root / "base")
    pcfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=TARGETS,
        fan_in_fan_out=True,
        init_lora_weights=False,
        rank_pattern={"c_fc": 2},
        bias="lora_only",
    )
    theirs = peft.get_peft_model(copy.deepcopy(hf), pcfg).eval()
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if n.endswith(".bias") and p.requires_grad:
                p.add_(0.05)
    theirs.save_pretrained(root / "peft")
    return hf, theirs, root


def _ids(seed=0):
    ids = np.random.default_rng(seed).integers(0, 150, (2, 7)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    return ids, mask


def _our_logits(backend, model):
    ids, mask = _ids()
    return model(backend_array(backend, ids), attention_mask=backend_array(backend, mask))[0]


def backend_array(backend, a):
    if backend.NAME == "torch":
        return torch.from_numpy(a)
    import jittor as jt

    return jt.array(a)


def _hf_logits(model):
    ids, mask = _ids()
    return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits


def test_peft_folder_loads_into_our_gpt2(backend, gpt2_dirs):
    _, theirs, root = gpt2_dirs
    ours = backend.from_pretrained(root / "base", adapter=root / "peft")
    ours.eval()
    assert set(ours.lora_injection.plans) == {
        f"h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    _, mask = _ids()  # compare the real tokens (padded positions are not defined the same way)
    live = to_numpy(_hf_logits(theirs)) * mask[..., None]
    assert_close(
        f"{backend.NAME} peft folder -> our GPT-2 logits",
        to_numpy(_our_logits(backend, ours)) * mask[..., None],
        live,
        1e-5,
        floor=1.0,
    )
    with theirs.disable_adapter():  # the adapter does change the logits
        assert np.abs(to_numpy(_hf_logits(theirs)) * mask[..., None] - live).max() > 1e-2


def test_our_peft_save_loads_into_peft(backend, gpt2_dirs, tmp_path):
    hf, _, root = gpt2_dirs
    ours = backend.from_pretrained(root / "base")  # no LoRA
    backend.inject_lora(ours, LoRATargetConfig(r=4, alpha=16, target_modules=("c_attn", "mlp.c_proj"), use_rslora=True))
    rng = np.random.default_rng(3)
    for n, p in ours.named_parameters():
        if "lora_" in n:
            _assign(backend, p, rng.normal(0, 0.1, tuple(p.shape)).astype(np.float32))
    backend.save_lora_adapter(ours, tmp_path, format="peft")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    ours.eval()
    ids, mask = _ids()
    assert_close(
        f"{backend.NAME} our peft save -> peft logits",
        to_numpy(_our_logits(backend, ours)) * mask[..., None],
        to_numpy(_hf_logits(theirs)) * mask[..., None],
        1e-5,
        floor=1.0,
    )
    backend.save_lora_adapter(ours, tmp_path / "ours")  # our format: canonical names, same config
    back = backend.from_pretrained(root / "base", adapter=tmp_path / "ours")
    back.eval()
    assert back.lora_injection.config == ours.lora_injection.config
    assert np.array_equal(to_numpy(_our_logits(backend, back)), to_numpy(_our_logits(backend, ours)))


def _assign(backend, p, value):
    if backend.NAME == "torch":
        with torch.no_grad():
            p.copy_(torch.from_numpy(value))
    else:
        import jittor as jt

        from backends.jittor.lora import assign_keep_grad

        assign_keep_grad(p, jt.array(value))


def _loss_grads(backend, model):
    logits = _our_logits(backend, model)
    w = backend_array(backend, np.random.default_rng(5).normal(size=tuple(logits.shape)).astype(np.float32))
    loss = (logits * w).sum()
    params = backend.trainable_parameters(model)
    if backend.NAME == "torch":
        loss.backward()
        return to_numpy(logits), {n: to_numpy(p.grad) for n, p in params.items()}
    import jittor as jt

    grads = jt.grad(loss, list(params.values()))
    return to_numpy(logits), {n: to_numpy(g) for n, g in zip(params, grads)}


def test_jittor_matches_torch_logits_and_grads(gpt2_dirs):
    _, _, root = gpt2_dirs
    got = {}
    for name in ("torch", "jittor"):
        bk = lc.get_backend(name)
        m = bk.from_pretrained(root / "base", adapter=root / "peft")
        m.train()
        got[name] = _loss_grads(bk, m)
    (lt, gt), (lj, gj) = got["torch"], got["jittor"]
    assert_close("inject jittor vs torch: logits", lj, lt, 1e-5, floor=1.0)
    assert set(gt) == set(gj) and any(n.endswith("lora_A") for n in gt) and any(n.endswith(".bias") for n in gt)
    for n in gt:
        assert_close(f"inject jittor vs torch: grad {n.rsplit('.', 1)[-1]}", gj[n], gt[n], 1e-4)


def test_gpt2_lora_config_injected_equals_built_in(backend):
    """inject_lora(GPT2LMModel(cfg), LoRAConfig(r=4)) is the built-in q, v LoRA (per-slice c_attn)."""
    cfg = lc.gpt2_config("tiny-32")
    base = lc.init_gpt2_weights(cfg, seed=1)
    lora = lc.LoRAConfig(r=4, alpha=8)
    injected = backend.build_model(cfg, None, base)
    backend.inject_lora(injected, lora)
    values = {n: v for n, v in backend.lora_state_dict(injected).items()}
    rng = np.random.default_rng(0)
    values = {n: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for n, v in values.items()}
    for n, p in injected.named_parameters():
        if n in values:
            _assign(backend, p, values[n])
    assert set(values) == set(lc.lora_shapes(cfg, lora))
    built = backend.build_model(cfg, lora, base, values)
    ids = backend_array(backend, rng.integers(0, cfg.vocab_size, (2, 6)))
    assert_close(
        f"{backend.NAME} injected GPT-2 LoRAConfig vs built-in", injected(ids)[0], built(ids)[0], 1e-6, floor=1.0
    )


def test_any_jittor_module_vs_reference():
    import jittor as jt
    from jittor import nn

    bj = lc.get_backend("jittor")

    class Net(nn.Module):
        def __init__(self):
            self.emb = nn.Embedding(20, 8)
            self.body = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6))

        def execute(self, ids):
            return self.body(self.emb(ids))

    net = Net()
    names = bj.inject_lora(net, LoRATargetConfig(r=2, alpha=4, target_modules=r"emb|body\.[02]", rank_pattern={"2": 3}))
    assert names == ["emb", "body.0", "body.2"]
    rng = np.random.default_rng(0)
    p = {n: v.numpy() for n, v in net.named_parameters()}
    for n, v in net.named_parameters():
        if "lora_" in n:
            p[n] = rng.normal(0, 0.3, tuple(v.shape)).astype(np.float32)
            bj.lora.assign_keep_grad(v, jt.array(p[n]))
    ids = rng.integers(0, 20, (3, 5))
    h = ref.lora_embedding(ids, p["emb.weight"], p["emb.lora_A"], p["emb.lora_B"], 2.0)
    h = np.maximum(
        ref.lora_linear(h, p["body.0.weight"], p["body.0.bias"], p["body.0.lora_A"], p["body.0.lora_B"], 2.0), 0
    )
    y = ref.lora_linear(h, p["body.2.weight"], p["body.2.bias"], p["body.2.lora_A"], p["body.2.lora_B"], 4 / 3)
    assert_close("jittor inject: any module vs numpy reference", net(jt.array(ids)), y, 1e-5)
    assert sorted(bj.trainable_parameters(net)) == sorted(n for n in p if "lora_" in n)
    net.eval()
    net.train()  # jittor's train() restores what eval() stopped: still only LoRA
    assert sorted(bj.trainable_parameters(net)) == sorted(n for n in p if "lora_" in n)


def test_paper_qv_adapter_exports_to_peft_exactly(backend, gpt2_dirs, tmp_path):
    """The built-in GPT-2 LoRA (per-slice q, v of c_attn, the paper's) saved as peft: one
    rank-2r matrix per c_attn; peft and our re-loaded model give the same logits."""
    hf, _, root = gpt2_dirs
    lora = lc.LoRAConfig(r=4, alpha=32, bias="lora_only")
    cfg, base = lc.load_gpt2_checkpoint(root / "base")
    rng = np.random.default_rng(2)
    values = {n: rng.normal(0, 0.1, s).astype(np.float32) for n, s in lc.lora_shapes(cfg, lora).items()}
    ours = backend.build_model(cfg, lora, base, values)
    ours.eval()
    backend.save_lora_adapter(ours, tmp_path, format="peft")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    _, mask = _ids()
    mine = to_numpy(_our_logits(backend, ours)) * mask[..., None]
    assert_close(
        f"{backend.NAME} paper q,v adapter -> peft logits",
        mine,
        to_numpy(_hf_logits(theirs)) * mask[..., None],
        1e-5,
        floor=1.0,
    )
    back = backend.from_pretrained(root / "base", adapter=tmp_path)
    back.eval()
    assert_close(
        f"{backend.NAME} paper q,v adapter -> peft -> ours logits",
        to_numpy(_our_logits(backend, back)) * mask[..., None],
        mine,
        1e-5,
        floor=1.0,
    )


@pytest.mark.parametrize("enable", [None, (True, False, True)])
def test_conv1d_layers_vs_reference(backend, enable):
    """GPT-2 Conv1D layout (weight (in, out)) with LoRA, whole and per-slice: outputs, merge."""
    import importlib

    mod = importlib.import_module(f"backends.{backend.NAME}.inject")
    cls = mod.LoRAConv1D if enable is None else mod.LoRAMergedConv1D
    args = (8, 12, 2, 4.0, 0.0) if enable is None else (8, 12, 2, 4.0, 0.0, enable)
    layer = cls(*args)
    rng = np.random.default_rng(0)
    W, b = rng.normal(size=(8, 12)).astype(np.float32), rng.normal(size=12).astype(np.float32)
    A = rng.normal(size=tuple(layer.lora_A.shape)).astype(np.float32)
    B = rng.normal(size=tuple(layer.lora_B.shape)).astype(np.float32)
    layer.weight, layer.bias = _param(backend, W), _param(backend, b)
    layer.lora_A, layer.lora_B = _param(backend, A), _param(backend, B)
    x = rng.normal(size=(3, 8)).astype(np.float32)
    want = ref.lora_conv1d(x, W, b, A, B, 2.0, enable)
    assert_close(
        f"{backend.NAME} LoRAConv1D{'' if enable is None else ' per-slice'} vs reference",
        layer(backend_array(backend, x)),
        want,
        1e-5,
    )
    layer.merge()
    assert_close(
        f"{backend.NAME} LoRAConv1D merged weight vs reference",
        layer.weight,
        ref.merge_conv1d(W, A, B, 2.0, enable),
        1e-6,
    )
    layer.unmerge()
    assert np.array_equal(to_numpy(layer.weight), W)


def _param(backend, a):
    if backend.NAME == "torch":
        return torch.nn.Parameter(torch.from_numpy(a.copy()))
    import jittor as jt

    return jt.array(a)


def test_regex_targets_round_trip_through_peft(gpt2_dirs, tmp_path):
    """A regex on our names (no ``transformer.``) is written for peft with the prefix, and
    read back with it: the same modules, the same logits."""
    hf, _, root = gpt2_dirs
    bt = lc.get_backend("torch")
    ours = bt.from_pretrained(root / "base")
    names = bt.inject_lora(ours, LoRATargetConfig(r=2, alpha=4, target_modules=r"h\.1\.(attn\.c_attn|mlp\.c_fc)"))
    assert names == ["h.1.attn.c_attn", "h.1.mlp.c_fc"]
    for n, p in ours.named_parameters():
        if n.endswith("lora_B"):
            _assign(bt, p, np.full(tuple(p.shape), 0.05, dtype=np.float32))
    bt.save_lora_adapter(ours, tmp_path, format="peft")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    assert sorted(n for n, m in theirs.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")) == [
        "base_model.model.transformer.h.1.attn.c_attn",
        "base_model.model.transformer.h.1.mlp.c_fc",
    ]
    back = bt.from_pretrained(root / "base", adapter=tmp_path)
    assert list(back.lora_injection.plans) == names
    ours.eval()
    back.eval()
    _, mask = _ids()
    assert_close(
        "regex targets -> peft logits",
        to_numpy(_our_logits(bt, ours)) * mask[..., None],
        to_numpy(_hf_logits(theirs)) * mask[..., None],
        1e-5,
        floor=1.0,
    )
    assert_close("regex targets -> peft -> ours logits", _our_logits(bt, back), _our_logits(bt, ours), 1e-6, floor=1.0)


def test_new_backend_modules_have_the_same_names():
    """inject.py, distilbert.py, classify.py exist in both backends with the same __all__
    (their exported names' signatures are compared by tests/test_api.py)."""
    import importlib

    for m in ("inject", "distilbert", "classify"):
        t, j = (importlib.import_module(f"backends.{be}.{m}") for be in ("torch", "jittor"))
        assert t.__all__ == j.__all__, m
