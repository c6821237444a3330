"""QLoRA on DistilBERT (issue 23: the third model family) in both backends, against
transformers + bitsandbytes + peft on CPU, with a tiny random ``DistilBertForSequenceClassification``
saved in the test: quantized while loading, its blocks' 12 linear weights dequantize to
bitsandbytes' bits and the logits are transformers' (head kept float32, as transformers does
with ``llm_int8_skip_modules=["pre_classifier", "classifier"]``); transformers' 4-bit checkpoints
(head skipped or, transformers' default, quantized too) load as they are; ours saves
transformers' bytes and transformers loads it; a peft QLoRA adapter (LoRA on q_lin, v_lin and
a trained classifier) gives peft's logits; jittor vs torch over 8 QLoRA updates; refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import assert_close, to_numpy

import lora_core as lc
from lora_core.data import cls_data
from lora_core.train.optim import AdamWConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb_f = pytest.importorskip("bitsandbytes.functional")
st = pytest.importorskip("safetensors.torch")

V = 96
# widths multiples of the block size (64): see tests/test_bnb4bit.py (bitsandbytes' CPU kernel)
CFG = dict(vocab_size=V, max_position_embeddings=32, dim=64, n_layers=2, n_heads=4, hidden_dim=128, num_labels=3,
           dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)
HEAD = ["pre_classifier", "classifier"]


def _load_4bit(d, skip=HEAD, config=True):
    """transformers' 4-bit model on the exact float32 path (tests/test_bnb4bit.py's ``_load_4bit``);
    ``config=False``: the checkpoint's own ``quantization_config`` decides."""
    from examples.lm.bench_systems import exact_4bit_inference

    kw = {}
    if config:
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skip)
    hf = transformers.DistilBertForSequenceClassification.from_pretrained(d, device_map="cpu", **kw)
    exact_4bit_inference(hf)
    return hf.eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """``(full precision, transformers 4-bit with the head skipped, transformers 4-bit default)``."""
    root = tmp_path_factory.mktemp("qlora_distilbert")
    torch.manual_seed(0)
    hf = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(**CFG)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.1)
    hf.save_pretrained(root / "fp32")
    _load_4bit(root / "fp32").save_pretrained(root / "4bit")
    _load_4bit(root / "fp32", skip=None).save_pretrained(root / "4bit-all")
    return root / "fp32", root / "4bit", root / "4bit-all"


def _inputs():
    ids = np.random.default_rng(0).integers(1, V, (2, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    return ids, mask


def _logits(bk, model, ids, mask) -> np.ndarray:
    model.eval()
    if bk.NAME == "torch":
        with torch.no_grad():
            return model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    import jittor as jt

    return model(jt.array(ids), jt.array(mask)).numpy()


def _hf_logits(hf) -> np.ndarray:
    ids, mask = _inputs()
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()


def _hf_dequantized(hf) -> dict[str, np.ndarray]:
    import bitsandbytes as bnb

    return {n: bnb_f.dequantize_4bit(m.weight.data, m.weight.quant_state).float().numpy()
            for n, m in hf.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _check_weights(model, hf, n_4bit: int) -> None:
    """Every 4-bit layer of ``hf`` is one of ours holding bitsandbytes' dequantized bits; no other."""
    deq = _hf_dequantized(hf)
    ours = {n for n, m in model.named_modules() if type(m).__name__ == "LoRALinear4bit"}
    assert len(deq) == n_4bit and ours == set(deq)
    modules = dict(model.named_modules())
    for n, w in deq.items():
        got = to_numpy(modules[n].weight).astype(np.float32)  # exact: float32 widened and back
        assert np.array_equal(got.view(np.uint32), w.view(np.uint32)), n


def test_quantized_while_loading_is_bitsandbytes(backend, ckpt):
    d, _, _ = ckpt
    hf = _load_4bit(d)  # transformers quantizes the same float32 checkpoint
    model = backend.distilbert_from_pretrained(d, quantize="nf4")
    _check_weights(model, hf, 12)
    ids, mask = _inputs()
    assert_close("DistilBERT QLoRA base (quantized while loading): logits vs transformers+bitsandbytes",
                 _logits(backend, model, ids, mask), _hf_logits(hf), 1e-5)


@pytest.mark.parametrize("which", ["head-skipped", "all"])
def test_transformers_4bit_checkpoint_loads(backend, ckpt, which):
    """Read as stored: the head in float32 (skipped) or, transformers' default, in 4 bits too."""
    d4 = ckpt[1] if which == "head-skipped" else ckpt[2]
    hf = _load_4bit(d4, config=False)
    model = backend.distilbert_from_pretrained(d4)
    _check_weights(model, hf, 12 if which == "head-skipped" else 14)
    ids, mask = _inputs()
    assert_close(f"DistilBERT bnb 4-bit checkpoint ({which}): logits vs transformers+bitsandbytes",
                 _logits(backend, model, ids, mask), _hf_logits(hf), 1e-5)


def test_ours_saves_what_transformers_saves(backend, ckpt, tmp_path):
    """Quantized while loading (head float32), and transformers' default checkpoint (head 4-bit)
    loaded and saved again: transformers' tensors (bytes) and quantization_config; transformers
    loads ours to the same logits."""
    d, d4, d4all = ckpt
    for name, model, ref_dir in (("nf4", backend.distilbert_from_pretrained(d, quantize="nf4"), d4),
                                 ("all", backend.distilbert_from_pretrained(d4all), d4all)):
        backend.save_quantized(model, tmp_path / name)
        ref = st.load_file(str(ref_dir / "model.safetensors"))
        ours = st.load_file(str(tmp_path / name / "model.safetensors"))
        assert set(ours) == set(ref) and [k for k in ours if not torch.equal(ours[k], ref[k])] == [], name
        qc = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
        assert qc == json.loads((ref_dir / "config.json").read_text())["quantization_config"]
        assert qc["llm_int8_skip_modules"] == (HEAD if name == "nf4" else None)
        hf_ours = _load_4bit(tmp_path / name, config=False)
        assert np.array_equal(_hf_logits(hf_ours), _hf_logits(_load_4bit(ref_dir, config=False))), name


@pytest.fixture(scope="module")
def peft_adapter(ckpt, tmp_path_factory):
    """A peft QLoRA adapter on transformers' 4-bit model (LoRA B nonzero, the classifier trained
    as ``modules_to_save``) and peft's logits."""
    out = tmp_path_factory.mktemp("peft") / "adapter"
    pm = peft.get_peft_model(_load_4bit(ckpt[1]), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_lin", "v_lin"], modules_to_save=["classifier"], lora_dropout=0.0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(out)
    return out, _hf_logits(pm.eval())


def test_peft_qlora_adapter_gives_peft_logits(backend, ckpt, peft_adapter):
    adapter, ref = peft_adapter
    ids, mask = _inputs()
    for base, kw in ((ckpt[1], {}), (ckpt[0], {"quantize": "nf4"})):
        model = backend.distilbert_from_pretrained(base, adapter=adapter, **kw)
        assert_close("DistilBERT QLoRA logits vs transformers+bitsandbytes+peft", _logits(backend, model, ids, mask),
                     ref, 1e-5)


def _batches(n, B=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lens, labels = rng.integers(3, 10, B), rng.integers(0, 3, B)
        out.append(cls_data.collate([[1, *rng.integers(3 + 2 * c, 5 + 2 * c, k - 1)] for k, c in zip(lens, labels)],
                                    labels.tolist()))
    return out


def _curve(bk, d, steps=8):
    model = bk.distilbert_from_pretrained(d, quantize="nf4")
    bk.inject_lora(model, lc.LoRATargetConfig(r=4, alpha=8.0, target_modules=("q_lin", "v_lin"),
                                              modules_to_save=("classifier",), seed=3))
    opt = bk.AdamW(bk.trainable_parameters(model), AdamWConfig(weight_decay=0.01))
    losses = [bk.cls_train_step(model, opt, [b], lr=5e-3, max_grad_norm=1.0)["loss"] for b in _batches(steps)]
    return np.array(losses), {n: to_numpy(p) for n, p in bk.trainable_parameters(model).items()}


def test_jittor_matches_torch_over_qlora_updates(ckpt):
    (lt, wt), (lj, wj) = _curve(lc.get_backend("torch"), ckpt[0]), _curve(lc.get_backend("jittor"), ckpt[0])
    assert lt[-1] < lt[0]
    assert_close("DistilBERT QLoRA jittor vs torch: 8-update loss curve", lj, lt, 1e-5)
    assert wt.keys() == wj.keys() and len(wt) == 2 * 2 * 2 + 4  # "classifier" also names pre_classifier (peft)
    for n in wt:
        # the head: AdamW's normalised step magnifies round-off where a gradient is small (its
        # weight measured 2.7e-5 here, 8.4e-6 with the same updates on the float32 base)
        lora = "lora_" in n
        assert_close(f"DistilBERT QLoRA jittor vs torch: {'LoRA' if lora else 'head'} weights after 8 updates",
                     wj[n], wt[n], 1e-5 if lora else 1e-4)


def test_refusals(ckpt):
    bk = lc.get_backend("torch")
    d, d4, _ = ckpt
    with pytest.raises(ValueError, match="only 'nf4'"):
        bk.distilbert_from_pretrained(d, quantize="fp4")
    for kw in (dict(quantize="nf4", double_quant=False), dict(double_quant=False), dict(blocksize=128)):
        with pytest.raises(ValueError, match="is loaded as it is"):  # options it contradicts, with quantize or not
            bk.distilbert_from_pretrained(d4, **kw)
    with pytest.raises(ValueError, match=r"distilbert_from_pretrained\(path, quantize='nf4'\)"):
        bk.from_pretrained(d, quantize="nf4")


def test_modules_to_save_on_a_4bit_head_refused(backend, ckpt):
    """transformers' default 4-bit checkpoint quantizes the head too: training it fully
    (``modules_to_save``) would train only its biases, so injection refuses it by name; LoRA on
    q, v alone (no modules_to_save) still goes on."""
    from lora_core.lora.targeting import TargetError

    d4_all = ckpt[2]
    model = backend.distilbert_from_pretrained(d4_all)
    cfg = lc.LoRATargetConfig(r=4, alpha=8, target_modules=("q_lin", "v_lin"), modules_to_save=("classifier",))
    with pytest.raises(TargetError, match=r"4-bit layer\(s\) \['pre_classifier', 'classifier'\]"):
        backend.inject_lora(model, cfg)
    model = backend.distilbert_from_pretrained(d4_all)
    assert len(backend.inject_lora(model, lc.LoRATargetConfig(r=4, alpha=8, target_modules=("q_lin", "v_lin")))) == 4
