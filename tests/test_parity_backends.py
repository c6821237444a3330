"""Jittor vs torch from the same numpy weights, and both vs the numpy LoRA reference.

Bounds (issue 2): logits 1e-5 x max(1, max|logit|); gradients of every LoRA parameter
1e-4 relative; parameters after one AdamW step 1e-6 relative; 20 training steps with
dropout 0: loss sequences 1e-4 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, to_numpy

import lora_core as lc
from lora_core.data.batching import collate
from lora_core.lora import reference as ref
from lora_core.train.optim import AdamWConfig, adamw_reference

LORA = lc.LoRAConfig(r=4, alpha=32, target_modules=("c_attn", "attn.c_proj", "mlp.c_fc"), bias="lora_only")


@pytest.fixture(scope="module")
def backends():
    return lc.get_backend("torch"), lc.get_backend("jittor")


@pytest.fixture(scope="module")
def setup():
    cfg = lc.gpt2_config("tiny")
    base = lc.init_gpt2_weights(cfg, seed=3)
    rng = np.random.default_rng(0)
    for k in base:  # non-zero biases / affine so their gradients are exercised
        if k.endswith("bias"):
            base[k] = rng.normal(0, 0.05, base[k].shape).astype(np.float32)
    lw = lc.init_lora_weights(cfg, LORA, b_std=0.05)
    batch = collate([(list(rng.integers(1, 999, 9)), list(rng.integers(1, 999, 6)) + [0]),
                     (list(rng.integers(1, 999, 4)), list(rng.integers(1, 999, 12)) + [0]),
                     (list(rng.integers(1, 999, 14)), list(rng.integers(1, 999, 3)) + [0])])
    return cfg, base, lw, batch


def _pair(backends, setup, lora=LORA):
    cfg, base, lw, _ = setup
    return [b.build_model(cfg, lora, base, lw) for b in backends]


def test_logits_jittor_vs_torch(backends, setup):
    mt, mj = _pair(backends, setup)
    ids = setup[3]["input_ids"]
    a, b = mt(ids)[0], mj(ids)[0]
    assert_close("jittor vs torch logits", b, a, 1e-5, max(1.0, float(np.abs(to_numpy(a)).max())))


def test_lora_grads_jittor_vs_torch(backends, setup):
    (bt, bj), (mt, mj) = backends, _pair(backends, setup)
    batch = setup[3]
    ot, oj = bt.AdamW(bt.trainable_parameters(mt)), bj.AdamW(bj.trainable_parameters(mj))
    lt, lj = bt.lm_loss(mt, batch, 0.1), bj.lm_loss(mj, batch, 0.1)
    assert_close("jittor vs torch label-smoothed loss", lj.item(), lt.item(), 1e-6)
    ot.backward(lt)
    oj.backward(lj)
    gt, gj = ot.grads_numpy(), oj.grads_numpy()
    assert set(gt) == set(gj) and any("lora_A" in n for n in gt) and any(n.endswith(".bias") for n in gt)
    for n in gt:
        assert np.abs(gt[n]).max() > 0, f"{n}: zero gradient, the comparison would prove nothing"
        assert_close("jittor vs torch grad " + n.split(".", 2)[-1], gj[n], gt[n], 1e-4)


def test_one_adamw_step_jittor_vs_torch_and_reference(backends, setup):
    """The update itself: both optimizers fed the same gradients agree to 1e-6 (and match the
    numpy reference). End to end, each with its own gradients, Adam's first step divides by
    |g| and so amplifies the 1e-6-level gradient differences: that case is bounded at 1e-4."""
    (bt, bj), (mt, mj) = backends, _pair(backends, setup)
    cfg = AdamWConfig(weight_decay=0.01, correct_bias=True)
    ot, oj = bt.AdamW(bt.trainable_parameters(mt), cfg), bj.AdamW(bj.trainable_parameters(mj), cfg)
    before = mt.state_numpy()
    ot.backward(bt.lm_loss(mt, setup[3]))
    grads = ot.grads_numpy()
    oj.backward(bj.lm_loss(mj, setup[3]))
    own_grads = oj.grads_numpy()
    _set_grads(oj, grads)  # same gradients into the jittor optimizer
    ot.step(2e-3)
    oj.step(2e-3)
    st, sj = mt.state_numpy(), mj.state_numpy()
    for n in st:
        if n in grads:
            want, _, _ = adamw_reference(before[n], grads[n], 0.0, 0.0, 1, 2e-3, cfg)
            assert_close("torch AdamW step vs numpy reference", st[n], want, 1e-6)
            assert_close("jittor vs torch params after 1 AdamW step (same grads)", sj[n], st[n], 1e-6)
            assert not np.array_equal(st[n], before[n])
            own, _, _ = adamw_reference(before[n], own_grads[n], 0.0, 0.0, 1, 2e-3, cfg)
            assert_close("jittor vs torch params after 1 AdamW step (own grads)", own, st[n], 1e-4)
        else:
            assert np.array_equal(st[n], before[n]) and np.array_equal(sj[n], before[n]), f"frozen {n} changed"


def _set_grads(jittor_opt, grads):
    import jittor as jt
    jittor_opt.grads = {n: jt.array(g) for n, g in grads.items()}


def test_twenty_steps_loss_sequence_jittor_vs_torch(backends, setup):
    (bt, bj), (mt, mj) = backends, _pair(backends, setup)
    cfg = AdamWConfig(weight_decay=0.01)
    ot, oj = bt.AdamW(bt.trainable_parameters(mt), cfg), bj.AdamW(bj.trainable_parameters(mj), cfg)
    losses_t, losses_j = [], []
    for step in range(20):
        lr = lc.lr_at(step, 5e-3, 5, 20)
        losses_t.append(bt.train_step(mt, ot, [setup[3]], lr, label_smooth=0.1, max_grad_norm=1.0)["loss"])
        losses_j.append(bj.train_step(mj, oj, [setup[3]], lr, label_smooth=0.1, max_grad_norm=1.0)["loss"])
    assert losses_t[-1] < losses_t[0] - 0.1, f"training did not reduce the loss: {losses_t}"
    assert_close("jittor vs torch 20-step loss sequence", losses_j, losses_t, 1e-4)


def test_adapter_crosses_backends(backends, setup, tmp_path):
    """An adapter saved by one backend and loaded by the other gives the same logits."""
    (bt, bj), (mt, mj) = backends, _pair(backends, setup)
    cfg, base, _, batch = setup
    ot = bt.AdamW(bt.trainable_parameters(mt))
    bt.train_step(mt, ot, [batch], 1e-2)  # move away from the shared init
    for src, src_b, dst_b in ((mt, bt, bj), (mj, bj, bt)):
        if src is mj:
            oj = bj.AdamW(bj.trainable_parameters(mj))
            bj.train_step(mj, oj, [batch], 2e-2)
        folder = tmp_path / src_b.NAME
        lc.save_adapter(folder, cfg, LORA, src_b.lora_state_dict(src))
        lc.save_model(tmp_path / "base", cfg, base)
        loaded = dst_b.from_pretrained(tmp_path / "base", adapter=folder)
        want = src(batch["input_ids"])[0]
        got = loaded(batch["input_ids"])[0]
        assert_close(f"adapter {src_b.NAME} -> {dst_b.NAME} logits", got, want, 1e-5, max(1.0, np.abs(to_numpy(want)).max()))


def test_merge_equals_unmerged_and_is_idempotent(backend, setup):
    cfg, base, lw, batch = setup
    lora = lc.LoRAConfig(r=4, alpha=32, target_modules=("c_attn", "c_proj", "c_fc", "wte"))
    lw = lc.init_lora_weights(cfg, lora, b_std=0.05)
    m = backend.build_model(cfg, lora, base, lw)
    m.eval()
    ids = batch["input_ids"]
    unmerged = to_numpy(m(ids)[0])
    w0 = m.state_numpy()
    backend.merge_lora(m)
    backend.merge_lora(m)  # idempotent
    merged = to_numpy(m(ids)[0])
    assert not np.array_equal(m.state_numpy()["h.0.attn.c_attn.weight"], w0["h.0.attn.c_attn.weight"])
    assert_close(f"{backend.NAME} merged vs unmerged logits", merged, unmerged, 1e-5, max(1.0, np.abs(unmerged).max()))
    backend.unmerge_lora(m)
    backend.unmerge_lora(m)
    assert_close(f"{backend.NAME} weights after merge+unmerge", m.state_numpy()["h.1.mlp.c_fc.weight"],
                 w0["h.1.mlp.c_fc.weight"], 1e-6)


@pytest.mark.parametrize("bias", ["none", "all", "lora_only"])
def test_only_lora_and_chosen_biases_train(backend, setup, bias):
    cfg, base, _, batch = setup
    lora = lc.LoRAConfig(r=2, alpha=4, bias=bias)
    m = backend.build_model(cfg, lora, base)
    names = set(backend.trainable_parameters(m))
    assert names == set(lc.trainable_names(cfg, lora))
    assert backend.count_trainable(m) == lc.count_parameters(
        {n: s for n, s in {**lc.base_shapes(cfg), **lc.lora_shapes(cfg, lora)}.items() if n in names})
    before = m.state_numpy()
    opt = backend.AdamW(backend.trainable_parameters(m))
    for _ in range(2):  # jittor's eval()/train() must not unfreeze frozen weights
        m.eval()
        m.train()
    assert set(backend.trainable_parameters(m)) == names
    backend.train_step(m, opt, [batch], 1e-2)
    after = m.state_numpy()
    changed = {n for n in after if not np.array_equal(after[n], before[n])}
    assert changed <= names and {n for n in names if "lora_B" in n} <= changed


@pytest.mark.parametrize("kind", ["linear", "merged_qv", "merged_qkv", "embedding"])
def test_lora_layer_vs_numpy_reference(backend, kind):
    """Outputs and gradients (x, A, B) of each LoRA layer against ``lora_core.lora.reference``."""
    rng = np.random.default_rng(7)
    fin, fout, r, alpha = 12, 18, 3, 6.0
    enable = {"linear": None, "merged_qv": (True, False, True), "merged_qkv": (True, True, True)}.get(kind)
    if kind == "embedding":
        layer = backend.LoRAEmbedding(fout, fin, r, alpha)
        W = rng.normal(size=(fout, fin)).astype(np.float32)
        A, B = rng.normal(size=(r, fout)).astype(np.float32), rng.normal(size=(fin, r)).astype(np.float32)
        _set(layer, {"weight": W, "lora_A": A, "lora_B": B})
        ids = rng.integers(0, fout, (2, 5))
        assert_close(f"{backend.NAME} LoRAEmbedding vs numpy", layer(_int(backend, ids)),
                     ref.lora_embedding(ids, W, A, B, alpha / r), 1e-6)
        return
    layer = (backend.LoRALinear(fin, fout, r, alpha) if enable is None
             else backend.LoRAMergedLinear(fin, fout, r, alpha, enable_lora=enable))
    k = 1 if enable is None else sum(enable)
    W, b = rng.normal(size=(fout, fin)).astype(np.float32), rng.normal(size=fout).astype(np.float32)
    A = rng.normal(size=(k * r, fin)).astype(np.float32)
    B = rng.normal(size=(fout // (1 if enable is None else 3) * k, r)).astype(np.float32)
    _set(layer, {"weight": W, "bias": b, "lora_A": A, "lora_B": B})
    x = rng.normal(size=(2, 4, fin)).astype(np.float32)
    dy = rng.normal(size=(2, 4, fout)).astype(np.float32)
    y, grads = _forward_backward(backend, layer, x, dy)
    assert_close(f"{backend.NAME} LoRA {kind} output vs numpy", y, ref.lora_linear(x, W, b, A, B, alpha / r, enable), 1e-6)
    want = ref.lora_linear_grads(x, A, B, alpha / r, dy, enable)
    assert_close(f"{backend.NAME} LoRA {kind} grad A vs numpy", grads["lora_A"], want["lora_A"], 1e-5)
    assert_close(f"{backend.NAME} LoRA {kind} grad B vs numpy", grads["lora_B"], want["lora_B"], 1e-5)
    assert_close(f"{backend.NAME} LoRA {kind} grad x vs numpy", grads["x"], want["x_lora"] + dy @ W, 1e-5)
    assert_close(f"{backend.NAME} LoRA {kind} merged weight vs numpy", _merged_weight(backend, layer),
                 ref.merge(W, A, B, alpha / r, enable), 1e-6)


def _set(layer, values):
    params = dict(layer.named_parameters())
    assert set(params) == set(values), (sorted(params), sorted(values))
    if hasattr(params["weight"], "assign"):
        import jittor as jt
        for n, v in values.items():
            params[n].assign(jt.array(v))
    else:
        import torch
        with torch.no_grad():
            for n, v in values.items():
                params[n].copy_(torch.from_numpy(v))


def _int(backend, ids):
    if backend.NAME == "jittor":
        import jittor as jt
        return jt.array(ids)
    import torch
    return torch.from_numpy(ids)


def _forward_backward(backend, layer, x, dy):
    params = dict(layer.named_parameters())
    if backend.NAME == "jittor":
        import jittor as jt
        xv = jt.array(x)
        y = layer(xv)
        gx, ga, gb = jt.grad((y * jt.array(dy)).sum(), [xv, params["lora_A"], params["lora_B"]])
        return y.numpy(), {"x": gx.numpy(), "lora_A": ga.numpy(), "lora_B": gb.numpy()}
    import torch
    xv = torch.from_numpy(x).requires_grad_(True)
    y = layer(xv)
    (y * torch.from_numpy(dy)).sum().backward()
    return y.detach().numpy(), {"x": xv.grad.numpy(), "lora_A": params["lora_A"].grad.numpy(),
                                "lora_B": params["lora_B"].grad.numpy()}


def _merged_weight(backend, layer):
    layer.merge()
    w = to_numpy(dict(layer.named_parameters())["weight"])
    layer.unmerge()
    return w


def test_dropout_parity_mode_shared_numpy_masks(backends, setup):
    """LoRA dropout 0.1 with masks from one numpy stream: loss sequences still agree (1e-4),
    and differ from the dropout-free run (the masks do act)."""
    from lora_core.lora.dropout import NumpyDropout

    (bt, bj) = backends
    cfg, base, lw, batch = setup
    lora = lc.LoRAConfig(r=4, alpha=32, dropout=0.1, target_modules=LORA.target_modules, bias=LORA.bias)
    runs = {}
    for b in (bt, bj):
        m = b.build_model(cfg, lora, base, lw)
        src = NumpyDropout(seed=5)
        b.set_dropout_source(m, src)
        opt = b.AdamW(b.trainable_parameters(m))
        losses = []
        for step in range(10):
            src.reseed(step)
            losses.append(b.train_step(m, opt, [batch], 5e-3)["loss"])
        runs[b.NAME] = losses
    assert_close("jittor vs torch 10-step loss, dropout parity mode", runs["jittor"], runs["torch"], 1e-4)
    m = bt.build_model(cfg, lc.LoRAConfig(r=4, alpha=32, target_modules=LORA.target_modules, bias=LORA.bias), base, lw)
    opt = bt.AdamW(bt.trainable_parameters(m))
    no_drop = [bt.train_step(m, opt, [batch], 5e-3)["loss"] for _ in range(10)]
    assert abs(no_drop[-1] - runs["torch"][-1]) > 1e-4
