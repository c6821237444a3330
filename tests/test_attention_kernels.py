"""The torch backend's attention kernels (``backends/torch/_attention.py``): on a GPU never
cuDNN's (a plan per new shape: bf16 steps on batches of varying length ran 2.3x slower on an
H200), on the CPU PyTorch's own choice. On the CPU the chosen-kernel path is run by listing the
CPU among the devices it applies to: the same logits as PyTorch's choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close

import lora_core as lc
from backends.torch import _attention
from lora_core.models.llama import init_llama_weights, llama_config


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _models(device: str = "cpu"):
    import backends.torch as bk

    cfg = lc.gpt2_config("tiny", n_layer=2)
    gpt2 = bk.build_model(cfg, None, lc.init_gpt2_weights(cfg, 0))
    lcfg = llama_config("tiny-llama")  # grouped-query attention
    llama = bk.LlamaForCausalLM(lcfg)
    llama.load_weights(init_llama_weights(lcfg, 0))
    for m in (gpt2, llama):
        bk.to_device(m, device)
    return {"gpt2": gpt2, "llama": llama}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_chosen_kernels_give_the_same_logits(name, monkeypatch):
    model = _models()[name].eval()
    ids = np.random.default_rng(0).integers(1, 120, (2, 11))
    with torch.no_grad():
        ref = model(ids)[0].numpy()
        monkeypatch.setattr(_attention, "CHOSEN_ON", ("cpu", "cuda"))
        entered = []
        real = _attention.sdpa_kernel
        monkeypatch.setattr(_attention, "sdpa_kernel", lambda kernels: entered.append(kernels) or real(kernels))
        got = model(ids)[0].numpy()
    assert entered and all(k == _attention.GPU_KERNELS for k in entered)
    assert_close(f"{name} logits, chosen attention kernels vs PyTorch's", got, ref, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="no CUDA GPU")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_cuda_bf16_training_runs_no_cudnn_attention(name):
    """A bf16 (autocast) forward and backward pass on the GPU: no cuDNN attention kernel runs."""
    import backends.torch as bk

    model = _models("cuda")[name].train()
    bk.set_precision(model, "bf16")
    ids = torch.from_numpy(np.random.default_rng(0).integers(1, 120, (4, 64))).cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)[0]
        logits.float().square().mean().backward()
    ops = {e.key for e in prof.key_averages()}
    assert not {o for o in ops if "cudnn_attention" in o}, sorted(ops)
    assert {o for o in ops if "scaled_dot_product" in o}, sorted(ops)  # attention ran (flash, efficient or math)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_outside_flash_dtypes_repeats_keys_and_values(dtype, monkeypatch):
    """Float32 grouped-query attention on a chosen-kernel device: keys and values repeated to the
    query heads, ``enable_gqa`` off (PyTorch's memory-efficient kernel refuses it, and its math
    kernel keeps the (B, H, T, T) probabilities), the same output and gradients as PyTorch's own
    GQA; bf16 (flash attention's dtype) is passed as it is."""
    monkeypatch.setattr(_attention, "CHOSEN_ON", ("cpu", "cuda"))
    calls = []
    real = _attention.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((k.shape[-3], kw.get("enable_gqa")))
        return real(q, k, v, **kw)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=g, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    ref = real(q, k, v, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    monkeypatch.setattr(_attention.F, "scaled_dot_product_attention", spy)
    got = _attention.attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    assert calls == ([(4, False)] if dtype == torch.float32 else [(2, True)])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close("GQA output, chosen kernels vs PyTorch's", got.float().detach().numpy(), ref.float().detach().numpy(), tol)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert_close(f"GQA d{name}, chosen kernels vs PyTorch's", a.float().numpy(), b.float().numpy(), tol)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="no CUDA GPU")
def test_cuda_fp32_grouped_query_training_runs_no_math_attention():
    """A float32 forward and backward pass of a grouped-query Llama on the GPU: the
    memory-efficient kernel runs, not the math one (which keeps the attention probabilities)."""
    model = _models("cuda")["llama"].train()
    ids = torch.from_numpy(np.random.default_rng(0).integers(1, 120, (4, 64))).cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(ids)[0].square().mean().backward()
    ops = {e.key for e in prof.key_averages()}
    assert not {o for o in ops if "attention_math" in o}, sorted(ops)
    assert {o for o in ops if "efficient_attention" in o}, sorted(ops)
