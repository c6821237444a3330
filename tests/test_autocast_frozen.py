"""torch under autocast: a frozen projection keeps its float32 weight, not autocast's bf16 copy
of it, for the backward pass (``backends.torch.lora._AutocastFrozenLinear``), with the same bits
as autocast's own ``F.linear``: outputs, input gradients, LoRA gradients and losses equal bit
for bit (bf16 on the CPU; the same code runs under CUDA autocast)."""

from __future__ import annotations

import pytest
import torch
from test_head_loss import _batch, _gpt2, _llama  # the same tiny models and batches

from backends.torch import lora as tlora
from lora_core.train.optim import AdamWConfig


def _plain(monkeypatch):
    """autocast's own F.linear for every frozen product (the path before)."""
    monkeypatch.setattr(tlora, "_frozen_autocast_linear", lambda x, w, b: None)


def _layer(r: int, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    m = tlora.LoRALinear(48, 40, r=r, alpha=2 * r if r else 1.0, bias=bias)
    with torch.no_grad():
        m.weight.normal_(0, 0.1)
        if bias:
            m.bias.normal_(0, 0.1)
        if r:
            m.lora_A.normal_(0, 0.1)
            m.lora_B.normal_(0, 0.1)
    m.weight.requires_grad_(False)
    if bias:
        m.bias.requires_grad_(False)
    return m


def _run(m, x, monkeypatch, plain: bool):
    with monkeypatch.context() as mp:
        if plain:
            _plain(mp)
        leaf = x.detach().clone().requires_grad_()
        xx = leaf * 1.0  # a layer's input is not a leaf (autocast caches the casts of leaves)
        saved = []

        def pack(t):
            saved.append((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(xx)
        y.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return y.detach(), leaf.grad, grads, saved


@pytest.mark.parametrize("shape", [(7, 48), (2, 5, 48)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("r", [0, 4])
def test_same_bits_as_autocast_and_no_bf16_weight_kept(r, bias, shape, monkeypatch):
    m = _layer(r, bias)
    x = torch.randn(shape)
    y, gx, grads, saved = _run(m, x, monkeypatch, plain=False)
    y0, gx0, grads0, saved0 = _run(m, x, monkeypatch, plain=True)
    assert y.dtype == y0.dtype == torch.bfloat16 and torch.equal(y, y0)
    assert gx.dtype == torch.float32 and torch.equal(gx, gx0)
    assert grads.keys() == grads0.keys() and all(torch.equal(grads[n], grads0[n]) for n in grads)
    copies = [s for s in saved0 if s in (((40, 48), torch.bfloat16), ((48, 40), torch.bfloat16))]
    assert copies and not [s for s in saved if s in copies]  # autocast's bf16 copy of the frozen weight (transposed)
    assert ((40, 48), torch.float32) in saved  # the parameter itself (no new memory)


def test_trained_weight_or_bias_and_no_grad_take_autocast_path():
    m = _layer(0, True)
    x = torch.randn(3, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert tlora._frozen_autocast_linear(x, m.weight, m.bias) is not None
        m.bias.requires_grad_(True)
        assert tlora._frozen_autocast_linear(x, m.weight, m.bias) is None
        m.bias.requires_grad_(False)
        assert tlora._frozen_autocast_linear(x.detach(), m.weight, m.bias) is None  # no gradient wanted
        with torch.no_grad():
            assert tlora._frozen_autocast_linear(x, m.weight, m.bias) is None
    assert tlora._frozen_autocast_linear(x, m.weight, m.bias) is None  # autocast off


@pytest.mark.parametrize("gc", [False, True])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_steps_bit_equal(family, gc, monkeypatch):
    """Three bf16 training steps (AdamW): losses and LoRA weights equal bit for bit."""
    import backends.torch as bk

    results, used = [], []
    real = tlora._AutocastFrozenLinear.apply
    for plain in (False, True):
        with monkeypatch.context() as mp:
            if plain:
                _plain(mp)
            else:
                mp.setattr(tlora._AutocastFrozenLinear, "apply", lambda *a: used.append(1) or real(*a))
            model, vocab = _llama(bk, tie=True) if family == "llama" else _gpt2(bk)  # LoRA on q, v, down; c_attn
            bk.set_precision(model, "bf16")
            if gc:
                bk.set_grad_checkpoint(model)
            opt = bk.AdamW(bk.trainable_parameters(model), AdamWConfig(weight_decay=0.01))
            losses = [bk.train_step(model, opt, [_batch(vocab, s)], 1e-2)["loss"] for s in range(3)]
            results.append((losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
    (l1, p1), (l0, p0) = results
    assert used  # the frozen products took the function
    assert l1 == l0, (l1, l0)
    assert p1.keys() == p0.keys() and all(torch.equal(p1[n], p0[n]) for n in p1)
