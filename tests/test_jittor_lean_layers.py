"""Jittor's GELU, LayerNorm and frozen products with lean backward passes
(``backends/jittor/_lean_layers.py``): the forward numbers are jittor's own expressions' bit
for bit, the gradients match torch's, and they stay finite where jittor's chained ``tanh``
gradient is NaN (GELU inputs beyond about +-9.4)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close

import lora_core as lc


@pytest.fixture(scope="module")
def jt_mods():
    lc.get_backend("jittor")
    import jittor as jt
    from jittor import nn

    from backends.jittor import _lean_layers

    return jt, nn, _lean_layers


def _inputs(shape, scale=4.0, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    x.reshape(-1)[:8] = [-30.0, -20.0, -12.0, -9.5, 9.5, 12.0, 20.0, 30.0]  # where jittor's tanh grad is NaN
    return x, rng.standard_normal(shape).astype(np.float32)


def _jt_grad(jt, f, x, g, extra=()):
    xv = jt.array(x)
    y = f(xv)
    grads = jt.grad((y * jt.array(g)).sum(), [xv, *extra])
    return y.numpy(), [d.numpy() for d in grads]


@pytest.mark.parametrize("kind", ["gelu_tanh", "gelu"])
def test_gelu_forward_is_jittors_and_gradient_is_torchs(jt_mods, kind):
    import torch

    jt, nn, lean = jt_mods
    x, g = _inputs((4, 9, 96))
    if kind == "gelu_tanh":
        c = float(np.sqrt(2.0 / np.pi))
        own = lambda v: 0.5 * v * (1.0 + jt.tanh(c * (v + 0.044715 * v * v * v)))  # noqa: E731
        ref = lambda v: torch.nn.functional.gelu(v, approximate="tanh")  # noqa: E731
    else:
        own, ref = nn.gelu, torch.nn.functional.gelu
    y, (dx,) = _jt_grad(jt, getattr(lean, kind), x, g)
    assert np.array_equal(y, own(jt.array(x)).numpy()), "forward differs from jittor's own expression"
    xt = torch.tensor(x, requires_grad=True)
    (ref(xt) * torch.tensor(g)).sum().backward()
    assert np.isfinite(dx).all(), f"{kind}: non-finite gradient at {x[~np.isfinite(dx)][:5]}"
    assert_close(f"jittor lean {kind} grad vs torch", dx, xt.grad.numpy(), 1e-5, 1.0)


@pytest.mark.parametrize("shape", [(3, 7, 64), (21, 64)])
def test_layer_norm_forward_and_gradients_are_torchs(jt_mods, shape):
    import torch

    jt, nn, lean = jt_mods
    x, g = _inputs(shape, scale=2.0, seed=1)
    rng = np.random.default_rng(2)
    w, b = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    ours, own, ref = lean.LayerNorm(64, eps=1e-5), nn.LayerNorm(64, eps=1e-5), torch.nn.LayerNorm(64, eps=1e-5)
    for m in (ours, own):
        m.weight.assign(jt.array(w))
        m.bias.assign(jt.array(b))
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(w))
        ref.bias.copy_(torch.tensor(b))
    y, (dx, dw, db) = _jt_grad(jt, ours, x, g, (ours.weight, ours.bias))
    xt = torch.tensor(x, requires_grad=True)
    yt = ref(xt)
    assert_close("jittor lean LayerNorm forward vs torch", y, yt.detach().numpy(), 1e-6, 1.0)
    assert_close("jittor.nn.LayerNorm forward vs torch", own(jt.array(x)).numpy(), yt.detach().numpy(), 1e-6, 1.0)
    (yt * torch.tensor(g)).sum().backward()
    assert_close("jittor lean LayerNorm dx vs torch", dx, xt.grad.numpy(), 1e-5, 1.0)
    assert_close("jittor lean LayerNorm dweight vs torch", dw, ref.weight.grad.numpy(), 1e-5, 1.0)
    assert_close("jittor lean LayerNorm dbias vs torch", db, ref.bias.grad.numpy(), 1e-5, 1.0)


def test_frozen_product_keeps_only_the_weight_and_matches_torch(jt_mods):
    import torch

    jt, nn, lean = jt_mods
    x, _ = _inputs((5, 6, 32), scale=1.0, seed=3)
    g = np.random.default_rng(5).standard_normal((5, 6, 48)).astype(np.float32)
    w = np.random.default_rng(4).standard_normal((48, 32)).astype(np.float32)
    wv = jt.array(w).stop_grad()
    y, (dx,) = _jt_grad(jt, lambda v: lean.frozen_matmul_t(v, wv), x, g)
    assert np.array_equal(y, nn.matmul_transpose(jt.array(x), wv).numpy())
    xt = torch.tensor(x, requires_grad=True)
    (xt @ torch.tensor(w).T * torch.tensor(g)).sum().backward()
    assert_close("jittor frozen product dx vs torch", dx, xt.grad.numpy(), 1e-5, 1.0)
    trained = jt.array(w)  # a weight that trains takes jittor's own product (both gradients)
    _, (dx2, dw2) = _jt_grad(jt, lambda v: lean.frozen_matmul_t(v, trained), x, g, (trained,))
    assert_close("jittor product dw vs torch", dw2, (torch.tensor(g).reshape(-1, 48).T @ torch.tensor(x).reshape(-1, 32)).numpy(),
                 1e-5, 1.0)


def test_lora_gradients_stay_finite_with_large_mlp_preactivations():
    """A GPT-2 whose MLP pre-activations reach |x| ~ 30 (c_fc weights scaled up): jittor's LoRA
    gradients are finite and match torch's (with jittor's chained GELU gradient they were NaN)."""
    bt, bj = lc.get_backend("torch"), lc.get_backend("jittor")
    cfg = lc.gpt2_config("tiny")
    base = lc.init_gpt2_weights(cfg, seed=5)
    for k in base:
        if k.endswith("mlp.c_fc.weight"):
            base[k] = base[k] * 60.0
    lora = lc.LoRAConfig(r=4, alpha=32)
    lw = lc.init_lora_weights(cfg, lora, b_std=0.05)
    rng = np.random.default_rng(0)
    from lora_core.data.batching import collate

    batch = collate([(list(rng.integers(1, 999, 12)), list(rng.integers(1, 999, 20)) + [0]) for _ in range(3)])
    grads = []
    for be in (bt, bj):
        model = be.build_model(cfg, lora, base, lw)
        opt = be.AdamW(be.trainable_parameters(model))
        opt.backward(be.lm_loss(model, batch, 0.1))
        grads.append(opt.grads_numpy())
    for n, gt in grads[0].items():
        gj = grads[1][n]
        assert np.isfinite(gj).all(), f"{n}: non-finite jittor gradient"
        assert_close(f"jittor vs torch LoRA grad, large pre-activations: {n}", gj, gt, 1e-4)


def test_layer_norm_of_rows_with_a_large_mean(jt_mods):
    """Rows whose mean is large against their spread (a residual stream with an offset): the
    variance from the centred values (in double), not jittor's ``mean(x^2) - mean(x)^2``, which
    cancels (2.5e-2 from torch at an offset of 300, a clamped zero variance at 1000 +- 0.01):
    within 1e-6 of the exact values, and of torch's to its own float32 mean's rounding."""
    import torch

    jt, nn, lean = jt_mods
    rng = np.random.default_rng(7)
    x = (300 + rng.standard_normal((6, 64))).astype(np.float32)
    g = rng.standard_normal((6, 64)).astype(np.float32)
    ours, ref = lean.LayerNorm(64, eps=1e-5), torch.nn.LayerNorm(64, eps=1e-5)
    y, (dx,) = _jt_grad(jt, ours, x, g)
    xt = torch.tensor(x, requires_grad=True)
    yt = ref(xt)
    (yt * torch.tensor(g)).sum().backward()
    xd = x.astype(np.float64)  # the exact values (weight 1, bias 0)
    exact = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-5)
    assert_close("LayerNorm at offset 300 vs float64", y, exact, 1e-6, 1.0)
    # torch's float32 mean of values near 300 is itself ~1e-5 off
    assert_close("LayerNorm at offset 300 vs torch", y, yt.detach().numpy(), 3e-5, 1.0)
    assert_close("LayerNorm grad at offset 300 vs torch", dx, xt.grad.numpy(), 3e-5, 1.0)
    with jt.no_grad():
        assert_close("LayerNorm (no grad) at offset 300 vs float64", ours(jt.array(x)).numpy(), exact, 1e-6, 1.0)
    own = nn.LayerNorm(64, eps=1e-5)(jt.array(x)).numpy()
    assert np.abs(own - exact).max() > 1e-3  # jittor's own expression: what this replaces
