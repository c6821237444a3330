"""The torch backend's AdamW (``backends/torch/optim.py``) updates its parameters in groups with
PyTorch's multi-tensor operations (``torch._foreach_*``: a few kernel launches for all LoRA
adapters on a GPU instead of 7 per tensor): the same bits as one operation per tensor (the
update before, written out here), over several steps, with weight decay on some tensors only
and with groups of any size (one tensor a group, all in one); and against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close

from backends.torch import optim as toptim
from lora_core.train.optim import AdamWConfig, adamw_reference, decays, step_size


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.lora_A": (8, 48), "a.lora_B": (40, 8), "norm.weight": (48,), "b.bias": (40,), "embed_tokens.weight": (30, 16)}
    return {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in shapes.items()}


def _grads(params, step: int):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in params.items()}


def _per_tensor(params, grads_by_step, cfg: AdamWConfig, lr: float):
    """The update one tensor at a time (the torch backend's AdamW before the groups)."""
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    b1, b2 = cfg.betas
    with torch.no_grad():
        for t, grads in enumerate(grads_by_step, 1):
            size = step_size(lr, t, cfg)
            for n, p in params.items():
                g = grads[n]
                m[n].mul_(b1).add_(g, alpha=1 - b1)
                v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
                p.addcdiv_(m[n], v[n].sqrt().add_(cfg.eps), value=-size)
                if cfg.weight_decay > 0 and decays(n, tuple(p.shape), cfg.decay):
                    p.add_(p, alpha=-lr * cfg.weight_decay)
    return params, m, v


@pytest.mark.parametrize("group_bytes", [1, 4096, 2**30])
def test_grouped_update_equals_the_per_tensor_one_bit_for_bit(group_bytes, monkeypatch):
    monkeypatch.setattr(toptim, "GROUP_BYTES", group_bytes)
    cfg, lr, steps = AdamWConfig(weight_decay=0.1, decay="matrices"), 3e-3, 4
    ours = _params()
    opt = toptim.AdamW(ours, cfg)
    grads_by_step = [_grads(ours, s) for s in range(steps)]
    for grads in grads_by_step:
        for n, p in ours.items():
            p.grad = grads[n].clone()
        opt.step(lr)
    groups = opt._groups()
    assert [n for g in groups for n in g] == list(ours)
    assert len(groups) == {1: len(ours), 4096: 2, 2**30: 1}[group_bytes], groups
    ref, m, v = _per_tensor(_params(), grads_by_step, cfg, lr)
    for n in ours:
        assert torch.equal(ours[n].detach(), ref[n].detach()), n
        assert torch.equal(opt.m[n], m[n]) and torch.equal(opt.v[n], v[n]), n
        assert ours[n].grad is None


def test_grouped_update_matches_the_numpy_reference():
    cfg, lr = AdamWConfig(weight_decay=0.01), 2e-3
    params = _params(1)
    before = {n: p.detach().numpy().copy() for n, p in params.items()}
    grads = _grads(params, 0)
    opt = toptim.AdamW(params, cfg)
    for n, p in params.items():
        p.grad = grads[n].clone()
    opt.step(lr)
    for n, p in params.items():
        want, _, _ = adamw_reference(before[n], grads[n].numpy(), np.zeros_like(before[n]), np.zeros_like(before[n]), 1, lr, cfg)
        assert_close(f"grouped AdamW step vs numpy reference ({n})", p.detach().numpy(), want, 1e-6)
