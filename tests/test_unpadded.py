"""Unpadded training (position-wise layers on the real tokens only, attention on the padded
layout) against an independent reference: HF GPT-2 + peft LoRA run on the padded batch.
Loss with label smoothing and the LoRA gradients, both backends (1e-5), on a batch whose
rows have different lengths, so that padding is present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close, peft_c_attn, to_numpy

import lora_core as lc
from lora_core.data.batching import collate
from lora_core.train.optim import AdamWConfig

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = lc.gpt2_config("tiny", n_layer=2)
    hf_cfg = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
                                     n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(7)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder)
    lora = lc.LoRAConfig(r=4, alpha=16, enable_lora=None, target_modules=("c_attn",))
    lw = lc.init_lora_weights(cfg, lora, b_std=0.05)
    pm = peft_c_attn(hf, cfg.n_layer, lw, 4, 16)
    rng = np.random.default_rng(3)
    examples = [(list(rng.integers(1, cfg.vocab_size, c)) + [0], list(rng.integers(1, cfg.vocab_size, t)) + [0])
                for c, t in ((4, 6), (9, 2), (2, 3))]
    batch = collate(examples)
    assert batch["n_tokens"] < batch["input_ids"].size  # padding present
    logits = pm(torch.from_numpy(batch["input_ids"])).logits.reshape(-1, cfg.vocab_size)[batch["loss_index"]]
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(1, torch.from_numpy(batch["targets"])[:, None])[:, 0]
    loss = (0.9 * nll + 0.1 * -logp.mean(-1)).mean()
    loss.backward()
    grads = {}
    for i in range(cfg.n_layer):
        layer = pm.base_model.model.transformer.h[i].attn.c_attn
        grads[f"h.{i}.attn.c_attn.lora_A"] = to_numpy(layer.lora_A["default"].weight.grad)
        grads[f"h.{i}.attn.c_attn.lora_B"] = to_numpy(layer.lora_B["default"].weight.grad)
    _, base = lc.load_gpt2_checkpoint(folder)
    return cfg, lora, base, lw, batch, loss.item(), grads


def test_unpadded_loss_and_grads_match_peft_on_padded_batch(backend, reference):
    cfg, lora, base, lw, batch, ref_loss, ref_grads = reference
    m = backend.build_model(cfg, lora, base, lw)
    opt = backend.AdamW(backend.trainable_parameters(m), AdamWConfig())
    loss = backend.lm_loss(m, batch, 0.1)
    assert_close(f"unpadded loss vs peft padded ({backend.NAME})", float(loss.item()), ref_loss, 1e-5)
    opt.backward(loss, 1.0)
    grads = opt.grads_numpy()
    for n, g in ref_grads.items():
        assert_close(f"unpadded LoRA grads vs peft padded ({backend.NAME})", grads[n], g, 1e-5)


def test_hidden_unpadded_equals_hidden_at_real_tokens(backend, reference):
    cfg, lora, base, lw, batch, _, _ = reference
    m = backend.build_model(cfg, lora, base, lw)
    full = to_numpy(m.hidden(batch["input_ids"])[0]).reshape(-1, cfg.n_embd)[batch["token_index"]]
    packed = to_numpy(m.hidden_unpadded(batch["input_ids"], batch["token_index"], batch["pad_index"]))
    assert_close(f"hidden_unpadded vs hidden ({backend.NAME})", packed, full, 1e-5, floor=1.0)
