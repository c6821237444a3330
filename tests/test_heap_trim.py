"""ours-torch returns glibc's freed heap at each Llama decoder layer of a training step
(``lora_core.train.heap``, ``backends.torch.llama.TrimHeap``): once where the forward pass
enters a layer and once where the backward pass leaves it (where a gradient flows there: not
below the first layer of LoRA, whose embedding is frozen), never in inference; the same
gradients as without; ``LORA_MALLOC_TRIM=0`` turns it off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import lora_core as lc
from lora_core.data.batching import collate
from lora_core.models.llama import init_llama_weights, llama_config
from lora_core.train import heap

ROOT = Path(__file__).resolve().parents[1]


def _model(gc: bool):
    import backends.torch as bk

    cfg = llama_config("tiny-llama")
    m = bk.LlamaForCausalLM(cfg)
    m.load_weights(init_llama_weights(cfg, 0))
    bk.inject_lora(m, lc.LoRATargetConfig(r=4, alpha=8.0, dropout=0.0, seed=1, target_modules=("q_proj", "v_proj")))
    bk.set_grad_checkpoint(m, gc)
    return bk, m, cfg


@pytest.mark.skipif(not heap.available(), reason="no glibc malloc_trim")
@pytest.mark.parametrize("gc", [False, True])
def test_trims_twice_per_layer_in_training_only(gc, monkeypatch):
    bk, m, cfg = _model(gc)
    rng = np.random.default_rng(0)
    batch = collate([(list(rng.integers(1, cfg.vocab_size, 5)), list(rng.integers(1, cfg.vocab_size, 4))) for _ in range(2)])
    m.zero_grad(set_to_none=True)
    bk.lm_loss(m, batch, 0.0).backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    m.zero_grad(set_to_none=True)
    loss = bk.lm_loss(m, batch, 0.0)
    assert len(calls) == cfg.num_hidden_layers  # forward: one per layer
    loss.backward()
    # and one per layer in the backward pass, but the first: its input, the frozen embedding's output, takes no gradient
    assert len(calls) == 2 * cfg.num_hidden_layers - 1
    assert all(torch.equal(p.grad, ref[n]) for n, p in m.named_parameters() if p.grad is not None)
    with torch.no_grad():
        bk.lm_loss(m, batch, 0.0)
    m.eval()
    bk.lm_loss(m, batch, 0.0)
    assert len(calls) == 2 * cfg.num_hidden_layers - 1  # no trimming without gradients or in eval mode


def test_switched_off_by_the_environment():
    script = "from lora_core.train import heap; print(heap.available(), heap.trim())"
    env = {**os.environ, "LORA_MALLOC_TRIM": "0"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.split() == ["False", "False"]
