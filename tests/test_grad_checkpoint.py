"""Activation checkpointing (issue 22, item 2): for GPT-2, Llama and DistilBERT in both
backends, the checkpointed training step (each block recomputed in the backward pass:
``torch.utils.checkpoint`` in torch, a ``jt.Function`` per block in jittor) gives the plain
step's loss and LoRA gradients, with dropout masks from the framework's RNG or from the
shared numpy stream (parity mode); and in jittor it keeps less memory.

Measured (torch 2.13, jittor 1.3.11 CPU, every dropout mode): torch bit-equal for every
family (asserted: 0); jittor bit-equal for GPT-2 and DistilBERT, Llama's loss bit-equal and
its LoRA gradients within 6.0e-7 x max|gradient| of the tensor (asserted: ``JITTOR_RTOL``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import MEASURED, assert_close

import lora_core as lc
from lora_core.data import cls_data
from lora_core.data.batching import collate
from lora_core.lora.dropout import NumpyDropout
from lora_core.lora.layers import set_dropout_source
from lora_core.models import distilbert as db
from lora_core.models.llama import init_llama_weights, llama_config
from lora_core.train.optim import AdamWConfig
from lora_core.train.recipes import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
P = 0.2  # every dropout of the model when a case has dropout
# jittor: GPT-2 and DistilBERT measured bit-equal, Llama 6.0e-7 (jittor fuses the recomputed
# layer's operations differently from the plain step's graph: rounding, not a different formula)
JITTOR_RTOL = 2e-6


def _gpt2(bk, dropout: float):
    cfg = lc.gpt2_config("tiny", embd_pdrop=dropout, attn_pdrop=dropout, resid_pdrop=dropout)
    return bk.build_model(cfg, TrainConfig(lora_dropout=dropout).lora_config(), lc.init_gpt2_weights(cfg, 0))


def _llama(bk, dropout: float):
    cfg = llama_config("tiny-llama")
    model = bk.LlamaForCausalLM(cfg)
    model.load_weights(init_llama_weights(cfg, 0))
    bk.inject_lora(
        model,
        lc.LoRATargetConfig(
            r=4,
            alpha=8.0,
            dropout=dropout,
            seed=1,
            target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
        ),
    )
    return model


def _distilbert(bk, dropout: float):
    cfg = dataclasses.replace(
        db.PRESETS["tiny"], dropout=dropout, attention_dropout=dropout, seq_classif_dropout=dropout
    )
    model = bk.DistilBertForSequenceClassification(cfg)
    model.load_weights(db.init_weights(cfg, seed=0))
    bk.inject_lora(
        model,
        lc.LoRATargetConfig(
            r=4, alpha=8.0, dropout=dropout, seed=1, target_modules=("q_lin", "v_lin"), modules_to_save=("classifier",)
        ),
    )
    return model


def _lm_batch(vocab: int):
    rng = np.random.default_rng(0)
    ctx = [rng.integers(1, vocab, rng.integers(5, 12)).tolist() for _ in range(6)]
    return collate([(c, [(t * 7 + 3) % vocab for t in c[:5]]) for c in ctx], max_len=64)


def _cls_batch():
    rng = np.random.default_rng(0)
    ids = [[1, *rng.integers(3, 120, n - 2).tolist(), 2] for n in (5, 11, 8, 3)]
    return cls_data.collate(ids, [0, 1, 1, 0])


def _first_block(model):
    return (
        model.h[0]
        if hasattr(model, "h")
        else model.model.layers[0]
        if hasattr(model, "model")
        else model.distilbert.transformer.layer[0]
    )


def _count_calls(bk, block) -> list:
    """Calls of ``block`` recorded in the returned list (an instance attribute shadowing its
    class's forward/execute)."""
    calls, name = [], "forward" if bk.NAME == "torch" else "execute"
    method = getattr(block, name)
    setattr(block, name, lambda *a: calls.append(1) or method(*a))
    return calls


FAMILIES = {  # name: (build, batch, loss)
    "gpt2": (_gpt2, lambda: _lm_batch(1000), lambda bk, m, b: bk.lm_loss(m, b, 0.1)),
    "llama": (_llama, lambda: _lm_batch(128), lambda bk, m, b: bk.lm_loss(m, b, 0.1)),
    "distilbert": (_distilbert, _cls_batch, lambda bk, m, b: bk.cls_loss(m, b)),
}


def _model(bk, family: str, masks: str):
    """A tiny model of ``family`` whose every trainable tensor is random (B != 0, so that
    every LoRA tensor has a gradient); ``masks``: ``none`` (no dropout), ``framework``
    (the framework's RNG) or ``numpy`` (parity mode)."""
    model = FAMILIES[family][0](bk, 0.0 if masks == "none" else P)
    rng = np.random.default_rng(1)
    model.load_partial(
        {
            n: 0.1 * rng.standard_normal(tuple(p.shape)).astype(np.float32)
            for n, p in bk.trainable_parameters(model).items()
        }
    )
    source = NumpyDropout(5) if masks == "numpy" else None
    set_dropout_source(model, source)
    return model, source


def _step(bk, family, model, source, batch, seed=123):
    """Loss and gradients of one training step, the dropout masks drawn from ``seed``."""
    opt = bk.AdamW(bk.trainable_parameters(model), AdamWConfig())
    bk.manual_seed(seed)
    if source is not None:
        source.reseed(seed)
    model.train()
    loss = FAMILIES[family][2](bk, model, batch)
    opt.backward(loss)
    grads = opt.grads_numpy()
    opt.zero_grad()  # (torch's gradients live on the parameters)
    return float(loss.item()), grads


@pytest.mark.parametrize("masks", ["none", "framework", "numpy"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpointed_step_equals_plain_step(backend, family, masks):
    model, source = _model(backend, family, masks)
    batch = FAMILIES[family][1]()
    calls = _count_calls(backend, _first_block(model))
    plain = _step(backend, family, model, source, batch)
    assert len(calls) == 1
    backend.set_grad_checkpoint(model, True)
    ckpt = _step(backend, family, model, source, batch)
    assert len(calls) == 3  # forward + recomputation in the backward pass
    backend.set_grad_checkpoint(model, False)
    names = sorted(plain[1])
    assert names == sorted(ckpt[1]) and sum("lora_A" in n for n in names) >= 2
    assert all(np.abs(plain[1][n]).max() > 0 for n in names)
    rtol = 0.0 if backend.NAME == "torch" else JITTOR_RTOL
    assert_close(f"{backend.NAME} {family} grad checkpoint vs plain: loss ({masks} masks)", ckpt[0], plain[0], rtol)
    for n in names:  # the ratio recorded is the worst tensor's max|diff| / max|plain gradient|
        assert_close(
            f"{backend.NAME} {family} grad checkpoint vs plain: LoRA grads ({masks} masks)",
            ckpt[1][n],
            plain[1][n],
            rtol,
        )
    if masks != "none":  # the masks act, and differ between seeds (a test that can fail)
        assert _step(backend, family, model, source, batch, seed=7)[0] != plain[0]
        assert _step(backend, family, _model(backend, family, "none")[0], None, batch)[0] != plain[0]


def test_checkpointing_only_in_training_with_grad(backend):
    """Evaluation and no-grad passes are not checkpointed and give the plain outputs."""
    model, _ = _model(backend, "gpt2", "none")
    batch = _lm_batch(1000)
    backend.set_grad_checkpoint(model, True)
    model.eval()
    a = backend.eval_nll(model, batch)
    backend.set_grad_checkpoint(model, False)
    assert backend.eval_nll(model, batch) == a


_MEMORY = """
import sys
import numpy as np
import lora_core as lc
from lora_core.data.batching import collate
from lora_core.train.optim import AdamWConfig
from lora_core.train.recipes import TrainConfig

bk = lc.get_backend("jittor")
import jittor as jt

cfg = lc.GPT2Config(vocab_size=500, n_positions=128, n_embd=128, n_layer=6, n_head=4)
model = bk.build_model(cfg, TrainConfig(lora_dropout=0.1).lora_config(), lc.init_gpt2_weights(cfg, 0))
rng = np.random.default_rng(0)
batch = collate([(rng.integers(1, 500, 100).tolist(), rng.integers(1, 500, 20).tolist()) for _ in range(4)])
opt = bk.AdamW(bk.trainable_parameters(model), AdamWConfig())
model.train()
for ckpt in (True, False):  # the profiler keeps the maximum: the smaller one first
    bk.set_grad_checkpoint(model, ckpt)
    opt.backward(bk.lm_loss(model, batch, 0.1))  # compiled outside the profiled step
    opt.zero_grad()
    jt.gc()
    with jt.flag_scope(profile_memory_enable=1):
        opt.backward(bk.lm_loss(model, batch, 0.1))
        opt.zero_grad()
        print(int(jt.get_max_memory_info().split("[!@#div1!@#]")[0]))
"""


def test_jittor_checkpointing_saves_memory():
    """jittor's memory profiler (peak bytes of live variables in a training step): the
    checkpointed step peaks lower (measured: 0.40x on this shape, 6 layers of width 128, 4 x 120
    tokens; GPT-2 with 8 layers of width 256, 8 x 250 tokens: 0.39x, 564 -> 217 MB, at 1.22x
    the time)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _MEMORY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt, plain = (int(x) for x in r.stdout.split()[-2:])
    MEASURED["jittor grad checkpoint: peak live memory / plain step's"] = ckpt / plain
    assert ckpt < 0.6 * plain, (ckpt, plain)


@pytest.mark.parametrize("four_bit", [False, True])
def test_input_grad_is_the_frozen_products_backward(backend, four_bit):
    """``input_grad(g)`` of a frozen ``LoRALinear`` / ``LoRALinear4bit`` (the torch backend's
    ``FrozenMLP`` takes the down projection's input gradient with it) equals the gradient the
    framework's own backward gives the input of the frozen base product, in both backends."""
    import importlib

    from lora_core.quant.nf4 import quantize_nf4

    name = backend.NAME
    rng = np.random.default_rng(2)
    w, x, g = (rng.standard_normal(s).astype(np.float32) for s in ((6, 64), (3, 64), (3, 6)))
    if four_bit:
        layer = importlib.import_module(f"backends.{name}.quant").LoRALinear4bit(quantize_nf4(w))
    else:
        layer = importlib.import_module(f"backends.{name}.lora").LoRALinear(64, 6, bias=False)
    if name == "torch":
        import torch

        if not four_bit:
            layer.weight.data.copy_(torch.from_numpy(w))
            layer.weight.requires_grad_(False)
        xt = torch.from_numpy(x).requires_grad_()
        (layer(xt) * torch.from_numpy(g)).sum().backward()
        ref, got = xt.grad.numpy(), layer.input_grad(torch.from_numpy(g)).numpy()
    else:
        import jittor as jt

        if not four_bit:
            layer.weight.assign(jt.array(w))
            layer.weight.stop_grad()
        xj = jt.array(x)
        ref = jt.grad((layer(xj) * jt.array(g)).sum(), xj).numpy()
        got = layer.input_grad(jt.array(g)).numpy()
    assert_close(f"input_grad vs the framework's backward ({name}, 4-bit {four_bit})", got, ref, 1e-6, floor=1.0)


def _torch_tiny_llama(masks: str, targets: tuple[str, ...]):
    """The torch backend's tiny Llama with random LoRA on ``targets`` and its dropout source."""
    bk = lc.get_backend("torch")
    cfg = llama_config("tiny-llama")
    model = bk.LlamaForCausalLM(cfg)
    model.load_weights(init_llama_weights(cfg, 0))
    bk.inject_lora(model, lc.LoRATargetConfig(r=4, alpha=8.0, dropout=0.0 if masks == "none" else P, seed=1,
                                              target_modules=targets))  # fmt: skip
    rng = np.random.default_rng(1)
    model.load_partial({n: 0.1 * rng.standard_normal(tuple(p.shape)).astype(np.float32)
                        for n, p in bk.trainable_parameters(model).items()})  # fmt: skip
    source = NumpyDropout(5) if masks == "numpy" else None
    set_dropout_source(model, source)
    return bk, cfg, model, source


@pytest.mark.parametrize("masks", ["none", "framework", "numpy"])
def test_torch_llama_frozen_mlp_backward_in_pieces(masks, monkeypatch):
    """With LoRA on q, k, v, o (the studies' targets) the MLP is frozen: the torch backend's
    checkpointing keeps only its input and takes its backward pass in pieces of tokens
    (``FrozenMLP``, ``lora_core.train.recompute``), the recomputation skipping the MLP itself.
    Pieces of 64 tokens here (the batch has more), in the forward pass too: the plain step's
    loss and gradients to the bound measured (GEMMs over fewer rows may round differently; in
    one piece bit for bit)."""
    from lora_core.train import recompute

    bk, cfg, model, source = _torch_tiny_llama(masks, ("q_proj", "k_proj", "v_proj", "o_proj"))
    monkeypatch.setattr(recompute, "MLP_CHUNK_BYTES", 64 * cfg.intermediate_size * 4)
    monkeypatch.setattr(recompute, "MLP_FORWARD_CHUNK_BYTES", 64 * cfg.intermediate_size * 4)
    assert all(block.mlp_frozen() for block in model.model.layers)
    batch = _lm_batch(cfg.vocab_size)
    assert len(batch["token_index"]) > 64  # more than one piece
    layer = model.model.layers[0]
    mlp_calls, pieces = _count_calls(bk, layer.mlp), []
    gate = layer.mlp.gate_proj.forward
    layer.mlp.gate_proj.forward = lambda x: pieces.append(x.shape[0]) or gate(x)
    plain = _step(bk, "llama", model, source, batch)
    assert len(mlp_calls) == 1 and pieces == [len(batch["token_index"])]
    bk.set_grad_checkpoint(model, True)
    ckpt = _step(bk, "llama", model, source, batch)
    n = len(batch["token_index"])
    # the forward pass in pieces, no MLP in the recomputation, the backward in the same pieces
    split = [64] * (n // 64) + ([n % 64] if n % 64 else [])
    assert len(mlp_calls) == 1 + len(split) and pieces[1:] == split + split
    assert ckpt[0] == pytest.approx(plain[0], rel=1e-6) and sorted(ckpt[1]) == sorted(plain[1])
    diff = max(float(np.abs(ckpt[1][k] - plain[1][k]).max() / (np.abs(plain[1][k]).max() + 1e-30)) for k in plain[1])
    MEASURED[f"torch llama GC, frozen MLP's backward in pieces vs plain: max relative grad diff ({masks} masks)"] = diff
    assert diff <= 1e-6


@pytest.mark.parametrize("masks", ["none", "framework", "numpy"])
def test_torch_llama_recomputes_up_to_a_frozen_down_proj(masks):
    """With LoRA on gate_proj (and q, k, v, o) ``down_proj`` is frozen and keeps nothing for the
    backward pass: the torch backend's checkpointing recomputes each layer only up to it
    (``LlamaDecoderLayer.before_down``; 26% fewer recomputed GEMMs at Llama-3.2-1B's widths), with
    the plain step's loss and gradients bit for bit. A ``down_proj`` with LoRA, or trained (full
    FT), is recomputed with the rest of the layer."""
    bk, cfg, model, source = _torch_tiny_llama(masks, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"))
    layer = model.model.layers[0]
    assert all(block.down_keeps_nothing() and not block.mlp_frozen() for block in model.model.layers)
    before, down = _count_calls(bk, layer), []
    part = layer.before_down
    layer.before_down = lambda *a: down.append(1) or part(*a)
    batch = _lm_batch(cfg.vocab_size)
    plain = _step(bk, "llama", model, source, batch)
    assert (len(before), len(down)) == (1, 0)
    bk.set_grad_checkpoint(model, True)
    ckpt = _step(bk, "llama", model, source, batch)
    assert (len(before), len(down)) == (1, 2)  # the part before down_proj: forward + recomputation
    assert ckpt[0] == plain[0] and sorted(ckpt[1]) == sorted(plain[1])
    diff = max(float(np.abs(ckpt[1][n] - plain[1][n]).max()) for n in plain[1])
    MEASURED[f"torch llama grad checkpoint up to down_proj vs plain: max |grad diff| ({masks} masks)"] = diff
    assert diff == 0.0
    full = bk.LlamaForCausalLM(cfg)  # full FT: down_proj's weight trains
    assert not full.model.layers[0].down_keeps_nothing()
    assert not _llama(bk, 0.0).model.layers[0].down_keeps_nothing()  # LoRA on down_proj
