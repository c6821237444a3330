"""The torch LM loss with a frozen head (``backends.torch.train._HeadNLL``): the same loss and
gradients as the plain path (log-softmax kept for the backward pass), for GPT-2's tied head and
Llama's (tied and untied), fp32 and bf16, with and without label smoothing; no (N, V) tensor is
kept for the backward pass; a trainable head (full FT, LoRA on the embedding) and logits below
``HEAD_FUSED_MIN_BYTES`` take the plain path.

Measured (torch 2.13 CPU): fp32 loss and LoRA gradients within 4e-7 of the plain path's
(rounding of the log-sum-exp, not a different formula); bf16, under autocast as ``train_step``
runs it (before 79c3050 these tests called the loss outside autocast), the same loss,
LoRA gradients within 1.03e-2 of the largest (bf16's rounding, two paths' orders).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils._python_dispatch
from helpers import assert_close

import lora_core as lc
from backends.torch import train as ttrain
from lora_core.data.batching import collate
from lora_core.models.llama import init_llama_weights, llama_config
from lora_core.train import heap


@pytest.fixture(autouse=True)
def every_head_fused(monkeypatch):
    """The tiny models' logits are far below ``HEAD_FUSED_MIN_BYTES``: every head takes the path here."""
    monkeypatch.setattr(heap, "HEAD_FUSED_MIN_BYTES", 0)


def _batch(vocab: int, seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return collate([(list(rng.integers(1, vocab, c)) + [0], list(rng.integers(1, vocab, t)) + [0])
                    for c, t in ((5, 7), (9, 3), (2, 4))])  # fmt: skip


def _llama(bk, tie: bool, lm_head_lora: bool = False, **overrides):
    cfg = llama_config("tiny-llama", tie_word_embeddings=tie, **overrides)
    model = bk.LlamaForCausalLM(cfg)
    model.load_weights(init_llama_weights(cfg, 0))
    targets = ("q_proj", "v_proj", "down_proj") + (("lm_head",) if lm_head_lora else ())
    bk.inject_lora(model, lc.LoRATargetConfig(r=4, alpha=8.0, dropout=0.0, seed=1, target_modules=targets))
    for n, p in model.named_parameters():  # B nonzero: gradients reach A too
        if "lora_B" in n:
            p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    return model, cfg.vocab_size


def _gpt2(bk):
    cfg = lc.gpt2_config("tiny", n_layer=2)
    lora = lc.LoRAConfig(r=4, alpha=16, enable_lora=None, target_modules=("c_attn",))
    return bk.build_model(cfg, lora, lc.init_gpt2_weights(cfg, 0), lc.init_lora_weights(cfg, lora, b_std=0.05)), \
        cfg.vocab_size  # fmt: skip


def _loss_and_grads(model, batch, eps: float, plain: bool, monkeypatch):
    with monkeypatch.context() as mp:
        if plain:
            mp.setattr(ttrain, "_head_trains", lambda model, h: True)
        model.zero_grad(set_to_none=True)
        with ttrain.autocast(model):  # as train_step runs it: bf16 models under torch.autocast
            loss = ttrain.lm_loss(model, batch, eps)
        loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = {"gpt2": lambda bk: _gpt2(bk), "llama-tied": lambda bk: _llama(bk, True),
         "llama-untied": lambda bk: _llama(bk, False)}  # fmt: skip


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_frozen_head_loss_equals_plain_path(case, eps, pieces, monkeypatch):
    """``pieces``: the logits taken 5 positions at a time (``heap.HEAD_PIECE_BYTES``), the batch's
    17 in four pieces, as an LLM's are 65 at a time."""
    import backends.torch as bk

    model, vocab = CASES[case](bk)
    batch = _batch(vocab)
    if pieces:
        monkeypatch.setattr(heap, "HEAD_PIECE_BYTES", 5 * vocab * 4)
        assert heap.head_piece_rows(len(batch["targets"]), vocab) == 5 < len(batch["targets"])
    loss, grads = _loss_and_grads(model, batch, eps, False, monkeypatch)
    ref_loss, ref_grads = _loss_and_grads(model, batch, eps, True, monkeypatch)
    assert grads.keys() == ref_grads.keys() and grads
    assert_close(f"frozen-head loss vs plain ({case}, eps {eps})", loss, ref_loss, 1e-6)
    for n, g in ref_grads.items():
        assert_close(f"frozen-head LoRA grads vs plain ({case}, eps {eps})", grads[n].numpy(), g.numpy(), 1e-5,
                     floor=float(g.abs().max()))  # fmt: skip


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_frozen_head_in_two_products(eps, monkeypatch):
    """A vocabulary that is not a multiple of ``heap.HEAD_COLUMN_MULTIPLE`` (tiny GPT-2's 1000;
    GPT-2's 50257) takes each piece's logits as two products, the first 992 columns and the last
    8: targets in either part, the largest logit in either part, give the plain path's loss and
    gradients, the gradient of the hidden states included."""
    import backends.torch as bk

    assert heap.head_column_split(1000) == 992 and heap.head_column_split(50257) == 50256
    assert heap.head_column_split(128256) == 128256 and heap.head_column_split(10) == 10
    with pytest.raises(ValueError, match="positive vocabulary"):
        heap.head_column_split(0)
    model, vocab = _gpt2(bk)
    assert vocab == 1000
    with torch.no_grad():  # one of the last 8 rows of the tied head the largest: its logits lead
        model.wte.weight[997] *= 6.0
    tail = [999, 992, 997, 5, 991, 998, 3, 996]
    batch = collate([([7, 8, 9], tail[:4] + [0]), ([4], tail[4:] + [0]), ([2, 6], [993, 11, 0])])
    assert (batch["targets"] >= 992).sum() >= 6 and (batch["targets"] < 992).sum() >= 3
    monkeypatch.setattr(heap, "HEAD_PIECE_BYTES", 4 * vocab * 4)  # 14 positions in four pieces
    h, targets = ttrain._loss_hidden(model, batch)
    h = h.detach().requires_grad_()
    w = model.head_weight().detach()
    loss = ttrain._HeadNLL.apply(h, w, targets, eps, 4).mean()
    loss.backward()
    h_ref = h.detach().clone().requires_grad_()
    ref = ttrain._token_nll(h_ref @ w.t(), targets, eps).mean()
    ref.backward()
    assert_close(f"two-product head loss vs plain (eps {eps})", loss.item(), ref.item(), 1e-6)
    assert_close(f"two-product head input gradient vs plain (eps {eps})", h.grad.numpy(), h_ref.grad.numpy(), 1e-5,
                 floor=float(h_ref.grad.abs().max()))  # fmt: skip
    loss_m, grads = _loss_and_grads(model, batch, eps, False, monkeypatch)
    ref_m, ref_grads = _loss_and_grads(model, batch, eps, True, monkeypatch)
    assert_close(f"two-product head model loss vs plain (eps {eps})", loss_m, ref_m, 1e-6)
    for n, g in ref_grads.items():
        assert_close(f"two-product head LoRA grads vs plain (eps {eps})", grads[n].numpy(), g.numpy(), 1e-5,
                     floor=float(g.abs().max()))  # fmt: skip


def test_frozen_head_loss_in_bf16(monkeypatch):
    import backends.torch as bk

    model, vocab = _llama(bk, False)
    bk.set_precision(model, "bf16")
    batch = _batch(vocab)
    loss, grads = _loss_and_grads(model, batch, 0.1, False, monkeypatch)
    ref_loss, ref_grads = _loss_and_grads(model, batch, 0.1, True, monkeypatch)
    assert_close("frozen-head loss vs plain (bf16)", loss, ref_loss, 1e-3)
    for n, g in ref_grads.items():
        assert_close("frozen-head LoRA grads vs plain (bf16)", grads[n].numpy(), g.numpy(), 2e-2,
                     floor=float(g.abs().max()))  # fmt: skip


class _HeadCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the copies made of a (V', E) tensor or its transpose with V' at least 90% of V:
    autocast's casts of the head's weight, or of the part of it a product takes
    (``heap.head_column_split``: 992 of tiny GPT-2's 1000 rows)."""

    def __init__(self, shape):
        super().__init__()
        (self.vocab, self.width), self.count = tuple(shape), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        s = tuple(args[0].shape) if func is torch.ops.aten._to_copy.default else ()
        if len(s) == 2 and any(w == self.width and v >= 0.9 * self.vocab for v, w in (s, s[::-1])):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", sorted(CASES))
def test_frozen_head_cast_once_under_autocast(case, monkeypatch):
    """Under autocast the frozen head's weight is cast to bf16 once per loss, not once per piece
    (autocast casts a frozen weight again at every product: at Llama 3's vocabulary 1 GB each
    time), with the loss and gradients of the plain path within bf16's rounding; without the
    cast-once weight (``_frozen_head`` answering the float32 ``head_weight()``) the same loss casts
    it per piece."""
    import backends.torch as bk

    model, vocab = CASES[case](bk)
    bk.set_precision(model, "bf16")
    batch = _batch(vocab)
    monkeypatch.setattr(heap, "HEAD_PIECE_BYTES", 5 * vocab * 4)  # 17 positions: four pieces
    shape = model.head_weight().shape
    counts = {}
    for once in (True, False):
        with monkeypatch.context() as mp:
            if not once:
                mp.setattr(ttrain, "_frozen_head", lambda model, h: model.head_weight().detach())
            with _HeadCasts(shape) as casts:
                loss, grads = _loss_and_grads(model, batch, 0.1, False, monkeypatch)
        counts[once] = casts.count
        ref_loss, ref_grads = _loss_and_grads(model, batch, 0.1, True, monkeypatch)
        assert_close(f"frozen-head loss vs plain (bf16, {case}, cast once {once})", loss, ref_loss, 1e-3)
        for n, g in ref_grads.items():
            assert_close(f"frozen-head LoRA grads vs plain (bf16, {case})", grads[n].numpy(), g.numpy(), 2e-2,
                         floor=float(g.abs().max()))  # fmt: skip
    # per piece: at least one cast each (the input gradient's product casts again)
    assert counts[True] == 1 and counts[False] >= 4, counts


def test_gpu_pieces():
    """On a GPU (``heap.PIECE_DEVICES``) a frozen MLP's recomputation is one piece and the frozen
    head's logits pieces of 64-row tiles, 256 MB of float32 logits: a 65-row GEMM is too thin for
    a GPU's tiles (the H200 run of e8ad55d), the whole batch's loss held 2.5 GB (a8d4e9a's)."""
    from lora_core.train.recompute import mlp_chunk_rows

    assert heap.head_piece_rows(2048, 128256) == 66 and heap.head_piece_rows(2048, 128256, "cuda") == 512
    assert heap.head_piece_rows(2048, 50257, "cuda") == 1280 and heap.head_piece_rows(300, 50257, "cuda") == 300
    assert heap.head_piece_rows(2048, 8 << 20, "cuda") == 64  # at least one tile
    assert heap.head_piece_rows(2048, 128256, "cuda", 1 << 40) == 2048
    assert mlp_chunk_rows(2048, 8192) == 128 and mlp_chunk_rows(2048, 8192, device="cuda") == 2048
    assert mlp_chunk_rows(2048, 8192, 4, True, "cuda") == 2048


def _saved_bytes(model, batch, monkeypatch, plain: bool) -> tuple[int, int]:
    """Bytes of the activations autograd keeps for the backward pass (weights left out), and the largest one."""
    sizes = []
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            sizes.append(t.numel() * t.element_size())
        return t

    with monkeypatch.context() as mp:
        if plain:
            mp.setattr(ttrain, "_head_trains", lambda model, h: True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = ttrain.lm_loss(model, batch, 0.0)
    loss.backward()
    return sum(sizes), max(sizes)


def test_frozen_head_keeps_no_logits_for_backward(monkeypatch):
    import backends.torch as bk

    model, vocab = _llama(bk, False, vocab_size=4096)  # the (N, V) tensors the largest, as in an LLM
    batch = _batch(vocab)
    nv = len(batch["targets"]) * vocab * 4
    total, largest = _saved_bytes(model, batch, monkeypatch, plain=False)
    ref_total, ref_largest = _saved_bytes(model, batch, monkeypatch, plain=True)
    assert ref_largest >= nv  # the plain path keeps the (N, V) log-probabilities
    assert largest < nv and total <= ref_total - nv


def test_trainable_head_takes_the_plain_path(monkeypatch):
    import backends.torch as bk

    model, vocab = _llama(bk, False, lm_head_lora=True)
    batch = _batch(vocab)
    h, _ = ttrain._loss_hidden(model, batch)
    assert ttrain._head_trains(model, h)
    called = []
    monkeypatch.setattr(ttrain._HeadNLL, "apply", lambda *a: called.append(1))
    ttrain.lm_loss(model, batch, 0.0).backward()
    assert not called and model.lm_head.lora_A.grad is not None
    frozen, _ = _llama(bk, False)
    assert not ttrain._head_trains(frozen, ttrain._loss_hidden(frozen, batch)[0])


def test_small_logits_take_the_plain_path(monkeypatch):
    import backends.torch as bk

    model, vocab = _llama(bk, False)
    batch = _batch(vocab)
    monkeypatch.setattr(heap, "HEAD_FUSED_MIN_BYTES", len(batch["targets"]) * vocab * 4 + 1)
    called = []
    monkeypatch.setattr(ttrain._HeadNLL, "apply", lambda *a: called.append(1))
    ttrain.lm_loss(model, batch, 0.0).backward()
    assert not called
    monkeypatch.setattr(heap, "HEAD_FUSED_MIN_BYTES", len(batch["targets"]) * vocab * 4)
    with pytest.raises(AttributeError):  # the patched apply returns None: the fused path was taken
        ttrain.lm_loss(model, batch, 0.0)
    assert called
