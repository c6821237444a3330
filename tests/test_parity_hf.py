"""Parity with independent references: HF ``transformers`` GPT-2 and ``peft`` LoRA.

A tiny random ``GPT2LMHeadModel`` is saved with ``save_pretrained`` (and as a
``pytorch_model.bin``), loaded through our checkpoint loader into each backend, and
compared: logits full-sequence, token-by-token with the KV cache, and on a padded batch
(bound: max|diff| <= 1e-5 x max(1, max|logit|)). LoRA on the whole ``c_attn`` is compared
with peft's LoRA on the same HF model with the same A/B values (logits and grads, 1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close, peft_c_attn, to_numpy, write_torch_bin

import lora_core as lc

transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-5


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    cfg = lc.gpt2_config("tiny", n_layer=3)
    hf_cfg = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
                                     n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(1234)
    model = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorm affine, so every parameter matters
        for n, p in model.named_parameters():
            if n.endswith("bias") or ".ln_" in n or "ln_f" in n:
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder)
    bin_path = folder / "legacy" / "pytorch_model.bin"
    bin_path.parent.mkdir()
    # the OpenAI/HF-2019 layout: legacy torch.save stream, no ``transformer.`` prefix
    torch.save({k.removeprefix("transformer."): v for k, v in model.state_dict().items()}, bin_path,
               _use_new_zipfile_serialization=False)
    (bin_path.parent / "config.json").write_text((folder / "config.json").read_text())
    # the sharded layouts (an index and its shards), safetensors and .bin, as save_pretrained writes them
    model.save_pretrained(folder / "sharded_safetensors", max_shard_size="200KB")
    (folder / "sharded_bin").mkdir()
    (folder / "sharded_bin" / "config.json").write_text((folder / "config.json").read_text())
    write_torch_bin({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, folder / "sharded_bin", 3)
    return cfg, model, folder, bin_path


def _ids(cfg, B, T, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)).astype(np.int64)


def _ours(backend, path, lora=None):
    cfg, w = lc.load_gpt2_checkpoint(path)
    m = backend.build_model(cfg, lora, w, trainable=False)
    m.eval()
    return m


def _bound(ref):
    return max(1.0, float(np.abs(to_numpy(ref)).max()))


@pytest.mark.parametrize("source", ["safetensors", "legacy_bin", "sharded_safetensors", "sharded_bin"])
def test_full_sequence_logits_match_transformers(backend, hf_model, source):
    cfg, hf, folder, bin_path = hf_model
    path = {"safetensors": folder, "legacy_bin": bin_path}.get(source, folder / source)
    if source.startswith("sharded"):
        index = "model.safetensors.index.json" if source.endswith("safetensors") else "pytorch_model.bin.index.json"
        assert (path / index).is_file() and len(list(path.glob("*-of-*"))) > 2
    ours = _ours(backend, path)
    ids = _ids(cfg, 3, 17)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits
    assert_close(f"{backend.NAME} vs HF logits (full, {source})", ours(ids)[0], ref, LOGIT_TOL, _bound(ref))


def test_kv_cache_token_by_token_matches_transformers(backend, hf_model):
    cfg, hf, folder, _ = hf_model
    ours = _ours(backend, folder)
    ids = _ids(cfg, 2, 12, seed=1)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits
    logits, past = ours(ids[:, :5])
    steps = [to_numpy(logits)]
    for t in range(5, ids.shape[1]):
        logits, past = ours(ids[:, t:t + 1], past=past)
        steps.append(to_numpy(logits))
    assert_close(f"{backend.NAME} vs HF logits (KV cache)", np.concatenate(steps, axis=1), ref, LOGIT_TOL, _bound(ref))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_transformers(backend, hf_model, side):
    cfg, hf, folder, _ = hf_model
    ours = _ours(backend, folder)
    lengths, T = [11, 6, 3], 11
    ids = _ids(cfg, 3, T, seed=2)
    mask = np.zeros((3, T), dtype=np.int64)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, T - n:] = 1
        else:
            mask[b, :n] = 1
    ids = np.where(mask == 1, ids, 0)
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(pos)).logits
    out = to_numpy(ours(ids, attention_mask=mask)[0])
    real = mask.astype(bool)  # pad positions' logits are not defined by either model
    assert_close(f"{backend.NAME} vs HF logits (padded {side})", out[real], to_numpy(ref)[real], LOGIT_TOL, _bound(ref))
    # each padded row equals its unpadded run alone
    for b in range(len(lengths)):
        alone = ids[b:b + 1][mask[b:b + 1] == 1][None]
        with torch.no_grad():
            ref_alone = hf(torch.from_numpy(alone)).logits
        assert_close(f"{backend.NAME} vs HF logits (padded {side}, row alone)", out[b][real[b]], to_numpy(ref_alone)[0],
                     LOGIT_TOL, _bound(ref_alone))


def test_padded_prefill_then_cache_matches_transformers(backend, hf_model):
    """Left-padded prompt, then cached steps with the mask grown by one each step (beam search's path)."""
    cfg, hf, folder, _ = hf_model
    ours = _ours(backend, folder)
    T = 7
    ids = _ids(cfg, 2, T + 4, seed=3)
    mask = np.ones((2, T), dtype=np.int64)
    mask[1, :3] = 0
    logits, past = ours(ids[:, :T], attention_mask=mask)
    full_mask = mask
    for t in range(T, T + 4):
        full_mask = np.concatenate([full_mask, np.ones((2, 1), dtype=np.int64)], 1)
        logits, past = ours(ids[:, t:t + 1], past=past, attention_mask=full_mask)
    pos = np.maximum(np.cumsum(full_mask, -1) - 1, 0)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(full_mask),
                 position_ids=torch.from_numpy(pos)).logits[:, -1:]
    assert_close(f"{backend.NAME} vs HF logits (padded prefill + cache)", logits, ref, LOGIT_TOL, _bound(ref))


def test_lora_whole_c_attn_matches_peft(hf_model):
    """Ours (torch) with one LoRA pair on the whole c_attn vs peft's LoRA, same A/B values."""
    pytest.importorskip("peft")
    from backends import torch as bt

    cfg, hf, folder, _ = hf_model
    lora = lc.LoRAConfig(r=4, alpha=16, enable_lora=None, target_modules=("c_attn",))
    lw = lc.init_lora_weights(cfg, lora, b_std=0.05)
    hf_copy = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    pm = peft_c_attn(hf_copy, cfg.n_layer, lw, 4, 16)
    _, base = lc.load_gpt2_checkpoint(folder)
    ours = bt.build_model(cfg, lora, base, lw)
    ids = torch.from_numpy(_ids(cfg, 2, 9, seed=4))
    labels = torch.from_numpy(_ids(cfg, 2, 9, seed=5))
    ref_logits = pm(ids).logits
    our_logits = ours(ids)[0]
    assert_close("torch vs peft logits (LoRA on c_attn)", our_logits, ref_logits, LOGIT_TOL, _bound(ref_logits))
    loss_fn = torch.nn.functional.cross_entropy
    loss_fn(ref_logits.flatten(0, 1), labels.flatten()).backward()
    loss_fn(our_logits.flatten(0, 1), labels.flatten()).backward()
    params = dict(ours.named_parameters())
    for i in range(cfg.n_layer):
        layer = pm.base_model.model.transformer.h[i].attn.c_attn
        for ab, ref_p in (("A", layer.lora_A["default"].weight), ("B", layer.lora_B["default"].weight)):
            assert_close(f"torch vs peft grad lora_{ab}", params[f"h.{i}.attn.c_attn.lora_{ab}"].grad, ref_p.grad, 1e-5)


@pytest.mark.parametrize("field, value", [("activation_function", "relu"), ("scale_attn_weights", False),
                                          ("scale_attn_by_inverse_layer_idx", True), ("n_inner", 96),
                                          ("tie_word_embeddings", False)])  # fmt: skip
def test_gpt2_config_we_do_not_compute_is_refused(field, value, tmp_path):
    """A GPT-2 config.json asking for what transformers computes and ours does not (other logits
    without a word before) is refused naming the field; the tanh GELU under its other name loads
    with transformers' logits."""
    kw = dict(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw, **{field: value})).save_pretrained(tmp_path / "x")
    with pytest.raises(ValueError, match=rf"config\.json: {field}"):
        lc.get_backend("torch").from_pretrained(tmp_path / "x")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw, activation_function="gelu_pytorch_tanh")).eval()
    hf.save_pretrained(tmp_path / "tanh")
    ids = _ids(lc.gpt2_config("tiny", vocab_size=50), 2, 9)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits
    ours = lc.get_backend("torch").from_pretrained(tmp_path / "tanh").eval()
    assert_close("gelu_pytorch_tanh logits", ours(torch.from_numpy(ids))[0], ref, LOGIT_TOL, _bound(ref))
