"""Token ids outside the vocabulary are refused alike in every backend: ValueError naming what
(input ids, targets, a prompt), the id and the vocabulary size (``lora_core.data.batching.
check_token_ids``). Jittor's embedding lookup and gather read out of bounds silently (garbage or
NaN) where torch raised IndexError, and torch's fused frozen-head loss clamped such a target into
a finite loss."""

from __future__ import annotations

import numpy as np
import pytest

import lora_core as lc
from lora_core.data.batching import check_prompts, check_token_ids, collate
from lora_core.generate.beam import BeamConfig
from lora_core.models import llama as llama_spec
from lora_core.train import heap
from lora_core.train.optim import AdamWConfig

KINDS = ("gpt2", "llama")


def _model(backend, kind: str):
    """A tiny random model with LoRA (its head frozen, as the fused head loss needs) and its vocabulary size."""
    if kind == "gpt2":
        cfg = lc.gpt2_config("tiny", vocab_size=64, n_positions=32)
        model = backend.build_model(cfg, lc.LoRAConfig(r=2, alpha=4), base=lc.init_gpt2_weights(cfg, 0))
    else:
        cfg = llama_spec.llama_config("tiny-llama")
        model = backend.LlamaForCausalLM(cfg)
        model.load_weights(llama_spec.init_llama_weights(cfg, 0))
        backend.inject_lora(model, lc.LoRATargetConfig(r=2, alpha=4, target_modules=["q_proj"]))
    return model, cfg.vocab_size


def _message(what: str, bad: int, vocab: int) -> str:
    return rf"{what}: token id {bad} at position .* is outside the vocabulary of {vocab} tokens \[0, {vocab}\)"


def test_check_token_ids_names_what_the_id_and_the_vocabulary():
    ids = np.array([[1, 2, 3], [4, 70, 80]])
    with pytest.raises(ValueError, match=r"^input ids: token id 70 at position \(1, 1\) is outside the vocabulary "
                                         r"of 64 tokens \[0, 64\) \(2 ids outside it\)$"):
        check_token_ids(ids, 64, "input ids")
    with pytest.raises(ValueError, match=_message("targets", -1, 64)):
        check_token_ids([5, -1], 64, "targets")
    with pytest.raises(ValueError, match=_message("prompt 1", 64, 64)):
        check_prompts([[1, 2], [3, 64]], 64)
    ok = np.array([0, 63])
    assert check_token_ids(ok, 64, "x") is ok  # int64 in range: the array itself, no copy
    assert check_token_ids([], 64, "x").size == 0
    check_prompts([[1], [2, 3]], 64)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_refuses_ids_outside_the_vocabulary(backend, kind):
    model, V = _model(backend, kind)
    model.eval()
    model(np.array([[1, 2, V - 1]]))  # the last token of the vocabulary is fine
    for bad in (V, V + 1000, -1):
        for ids in (np.array([[1, 2, bad]]), [[1, 2, bad]]):  # numpy or lists
            with pytest.raises(ValueError, match=_message("input ids", bad, V)):
                model(ids)
            with pytest.raises(ValueError, match=_message("input ids", bad, V)):
                model.hidden(ids)


@pytest.mark.parametrize("kind", KINDS)
def test_losses_refuse_targets_and_inputs_outside_the_vocabulary(backend, kind):
    model, V = _model(backend, kind)
    good = collate([([1, 2], [3, 4])])
    backend.eval_nll(model, good)
    model.train()
    backend.lm_loss(model, good)
    for bad in (V, -1):
        for fn in (backend.lm_loss, backend.eval_nll):
            model.train()
            with pytest.raises(ValueError, match=_message("targets", bad, V)):
                fn(model, collate([([1, 2], [3, bad])]))
            with pytest.raises(ValueError, match=_message("input ids", bad, V)):
                fn(model, collate([([1, bad], [3, 4])]))
        with pytest.raises(ValueError, match=_message("targets", bad, V)):  # the trainer's step
            backend.train_step(model, backend.AdamW(backend.trainable_parameters(model), AdamWConfig()),
                               [collate([([1, 2], [3, bad])])], 1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_head_loss_refuses_targets_outside_the_vocabulary(backend, kind, monkeypatch):
    """torch's frozen-head loss in pieces (``_HeadNLL``, taken from ``heap.HEAD_FUSED_MIN_BYTES``
    of logits on: forced here) clamped an outside target into a finite loss; jittor has one path."""
    model, V = _model(backend, kind)
    monkeypatch.setattr(heap, "HEAD_FUSED_MIN_BYTES", 0)
    model.train()
    calls = []
    if backend.NAME == "torch":
        from backends.torch import train as tt

        real = tt._HeadNLL.apply
        monkeypatch.setattr(tt._HeadNLL, "apply", lambda *a: calls.append(1) or real(*a))
    targets = list(range(1, 9))
    loss = backend.lm_loss(model, collate([([1, 2], targets)]))
    assert np.isfinite(float(loss.item()))
    assert len(calls) == (1 if backend.NAME == "torch" else 0)  # the fused path taken in torch
    for bad in (V, V + 5, -1):
        with pytest.raises(ValueError, match=_message("targets", bad, V)):
            backend.lm_loss(model, collate([([1, 2], [*targets[:-1], bad])]))


def test_torch_head_nll_itself_refuses_outside_targets():
    """``_HeadNLL`` no longer clamps: a CPU target outside ``[0, V)`` is refused there too."""
    import torch

    from backends.torch.train import _HeadNLL

    lc.get_backend("torch")
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8)
    _HeadNLL.apply(h, w, torch.tensor([0, 1, 2, 15]), 0.0, 2)
    with pytest.raises(ValueError, match=_message("targets", 16, 16)):
        _HeadNLL.apply(h, w, torch.tensor([0, 1, 2, 16]), 0.0, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_beam_search_refuses_prompts_outside_the_vocabulary(backend, kind):
    model, V = _model(backend, kind)
    cfg = BeamConfig(beam=2, max_new_tokens=2, no_repeat_ngram_size=0, stop_ids=())
    assert len(backend.beam_search(model, [[1, 2], [V - 1]], cfg)) == 2
    for bad in (V, -1):
        with pytest.raises(ValueError, match=_message("prompt 1", bad, V)):
            backend.beam_search(model, [[1, 2], np.array([3, bad])], cfg)


def _refusals(be, model, V: int) -> list[str]:
    """The messages of a forward pass, both losses and a beam search given an id outside the vocabulary."""
    calls = (lambda: model(np.array([[1, V + 3]])),
             lambda: be.lm_loss(model, collate([([1, 2], [3, -7])])),
             lambda: be.eval_nll(model, collate([([1, 2 * V], [3, 4])])),
             lambda: be.beam_search(model, [[V]], BeamConfig(beam=1, max_new_tokens=1)))
    got = []
    for call in calls:
        with pytest.raises(ValueError) as e:
            call()
        got.append(str(e.value))
    return got


def test_both_backends_give_the_same_message():
    bt, bj = lc.get_backend("torch"), lc.get_backend("jittor")
    for kind in KINDS:
        assert _refusals(bt, *_model(bt, kind)) == _refusals(bj, *_model(bj, kind)), kind
