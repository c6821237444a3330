"""DistilBERT in both backends: ``transformers``' ``DistilBertForSequenceClassification``
checkpoints load strictly; logits match transformers (padding masks included); a peft
adapter (q_lin, v_lin + classifier) trained on the HF model loads with peft's logits;
jittor agrees with torch on logits and gradients (GPT-2 parity-table bounds)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import assert_close, to_numpy, write_torch_bin

import lora_core as lc
from lora_core.models.distilbert import MLM_HEAD_KEYS, load_distilbert_checkpoint

peft = pytest.importorskip("peft")
tf = pytest.importorskip("transformers")

HF_CFG = dict(vocab_size=120, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32, num_labels=3)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    torch.manual_seed(3)
    hf = tf.DistilBertForSequenceClassification(tf.DistilBertConfig(**HF_CFG)).eval()
    with torch.no_grad():  # larger than init: every parameter matters in the logits
        for _, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    root = tmp_path_factory.mktemp("distilbert")
    hf.save_pretrained(root / "base")
    theirs = peft.get_peft_model(
        copy.deepcopy(hf),
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_lin", "v_lin"],
            modules_to_save=["classifier"],
            init_lora_weights=False,
        ),
    ).eval()
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.2)
    theirs.save_pretrained(root / "peft")
    return hf, theirs, root


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 120, (3, 10)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 6:], mask[2, 3:] = 0, 0  # right padding, as dynamic padding makes it
    ids[mask == 0] = 0
    return ids, mask


def _arr(backend, a):
    if backend.NAME == "torch":
        return torch.from_numpy(a)
    import jittor as jt

    return jt.array(a)


def _hf(model):
    ids, mask = _batch()
    return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits


def _ours(backend, model, with_mask=True):
    ids, mask = _batch()
    return model(_arr(backend, ids), _arr(backend, mask) if with_mask else None)


def test_logits_match_transformers(backend, hf_dirs):
    hf, _, root = hf_dirs
    ours = backend.distilbert_from_pretrained(root / "base")
    ours.eval()
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
    assert_close(
        f"{backend.NAME} DistilBERT vs transformers logits (padded)", _ours(backend, ours), _hf(hf), 1e-5, floor=1.0
    )
    ids, _ = _batch()
    no_mask = hf(input_ids=torch.from_numpy(ids)).logits
    assert_close(
        f"{backend.NAME} DistilBERT vs transformers logits (no mask)",
        _ours(backend, ours, False),
        no_mask,
        1e-5,
        floor=1.0,
    )
    assert np.abs(to_numpy(no_mask) - to_numpy(_hf(hf))).max() > 1e-3  # the mask matters


def test_sharded_checkpoint_loads(hf_dirs, tmp_path):
    """A checkpoint saved in shards with an index (safetensors and .bin) loads as the single file does."""
    hf, _, root = hf_dirs
    bk = lc.get_backend("torch")
    ref = to_numpy(_ours(bk, bk.distilbert_from_pretrained(root / "base").eval()))
    hf.save_pretrained(tmp_path / "safetensors", max_shard_size="50KB")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((root / "base" / "config.json").read_text())
    write_torch_bin(hf.state_dict(), tmp_path / "bin", 3)
    for layout in ("safetensors", "bin"):
        assert len(list((tmp_path / layout).glob("*-of-*"))) >= 2
        ours = bk.distilbert_from_pretrained(tmp_path / layout).eval()
        np.testing.assert_array_equal(to_numpy(_ours(bk, ours)), ref)


def test_peft_adapter_loads(backend, hf_dirs):
    _, theirs, root = hf_dirs
    ours = backend.distilbert_from_pretrained(root / "base", adapter=root / "peft")
    ours.eval()
    assert_close(f"{backend.NAME} DistilBERT + peft adapter logits", _ours(backend, ours), _hf(theirs), 1e-5, floor=1.0)
    trains = sorted(backend.trainable_parameters(ours))
    assert "classifier.weight" in trains and "pre_classifier.weight" in trains  # peft's suffix rule
    assert sum("lora_" in n for n in trains) == 8


def _grads(backend, model):
    logits = _ours(backend, model)
    w = _arr(backend, np.random.default_rng(1).normal(size=tuple(logits.shape)).astype(np.float32))
    loss = (logits * w).sum()
    params = backend.trainable_parameters(model)
    if backend.NAME == "torch":
        loss.backward()
        return to_numpy(logits), {n: to_numpy(p.grad) for n, p in params.items()}
    import jittor as jt

    return to_numpy(logits), {n: to_numpy(g) for n, g in zip(params, jt.grad(loss, list(params.values())))}


def test_jittor_matches_torch(hf_dirs):
    _, _, root = hf_dirs
    got = {}
    for name in ("torch", "jittor"):
        bk = lc.get_backend(name)
        m = bk.distilbert_from_pretrained(root / "base", adapter=root / "peft")
        m.eval()  # dropout off: same function in both
        got[name] = _grads(bk, m)
    (lt, gt), (lj, gj) = got["torch"], got["jittor"]
    assert_close("DistilBERT jittor vs torch logits", lj, lt, 1e-5, floor=1.0)
    assert set(gt) == set(gj) and len(gt) == 12
    for n in gt:
        assert_close(
            f"DistilBERT jittor vs torch grad {n.rsplit('.', 2)[-2]}.{n.rsplit('.', 1)[-1]}", gj[n], gt[n], 1e-4
        )


def test_strict_loading(hf_dirs, tmp_path):
    hf, _, root = hf_dirs
    # a pre-trained MLM checkpoint: its MLM head is dropped by name, the classifier is new
    torch.manual_seed(0)
    mlm = tf.DistilBertForMaskedLM(tf.DistilBertConfig(**HF_CFG))
    mlm.save_pretrained(tmp_path / "mlm")
    cfg, tensors, has_head = load_distilbert_checkpoint(tmp_path / "mlm")
    assert not has_head and not set(MLM_HEAD_KEYS) & set(tensors) and cfg.num_labels == 3
    model = lc.get_backend("torch").distilbert_from_pretrained(tmp_path / "mlm")
    assert model.classifier.weight.shape == (3, 32)
    # the same weights as a pytorch_model.bin (torch.save) load identically
    (tmp_path / "bin").mkdir()
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((root / "base" / "config.json").read_text())
    _, from_bin, _ = load_distilbert_checkpoint(tmp_path / "bin")
    _, from_st, _ = load_distilbert_checkpoint(root / "base")
    assert from_bin.keys() == from_st.keys() and all(np.array_equal(from_bin[k], from_st[k]) for k in from_st)
    # a missing encoder key is an error naming the file and the key
    from safetensors.numpy import load_file, save_file

    w = load_file(root / "base" / "model.safetensors")
    del w["distilbert.transformer.layer.1.ffn.lin2.bias"]
    (tmp_path / "cut").mkdir()
    save_file(w, tmp_path / "cut" / "model.safetensors")
    (tmp_path / "cut" / "config.json").write_text((root / "base" / "config.json").read_text())
    with pytest.raises(
        lc.CheckpointError, match=r"(?s)cut/model.safetensors.*missing keys \(1\).*layer.1.ffn.lin2.bias"
    ):
        load_distilbert_checkpoint(tmp_path / "cut")


def test_pack_indices():
    from lora_core.models.distilbert import pack_indices

    token, pad, cls = pack_indices(np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]))
    assert token.tolist() == [0, 1, 2, 4, 5, 6, 7, 8] and cls.tolist() == [0, 3, 7]
    assert pad.tolist() == [0, 1, 2, 8, 3, 4, 5, 6, 7, 8, 8, 8]  # 8: the appended zero row
    assert pack_indices(np.ones((2, 3))) is None
    with pytest.raises(ValueError, match="right padding"):
        pack_indices(np.array([[0, 1, 1]]))


def test_our_adapter_saved_as_peft_loads_into_transformers(backend, hf_dirs, tmp_path):
    hf, _, root = hf_dirs
    ours = backend.distilbert_from_pretrained(root / "base")
    cfg = lc.LoRATargetConfig(r=2, alpha=4, target_modules=("q_lin", "v_lin", "lin1"), bias="lora_only",
                              modules_to_save=("classifier",))  # fmt: skip
    backend.inject_lora(ours, cfg)
    rng = np.random.default_rng(4)
    state = {n: v + rng.normal(0, 0.1, v.shape).astype(np.float32) for n, v in backend.lora_state_dict(ours).items()}
    ours.load_weights(dict(ours.state_numpy(), **state))
    ours.eval()
    backend.save_lora_adapter(ours, tmp_path, format="peft")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    assert_close(
        f"{backend.NAME} DistilBERT our peft save -> peft logits", _ours(backend, ours), _hf(theirs), 1e-5, floor=1.0
    )
    assert np.abs(to_numpy(_hf(theirs)) - to_numpy(_hf(hf))).max() > 1e-2  # the adapter matters
