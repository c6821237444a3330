"""bitsandbytes 4-bit checkpoints both ways (issue 23, items 3-4), against transformers +
bitsandbytes + peft on CPU, with tiny random models saved in the test: a transformers NF4
checkpoint (double quantization) loads into both backends without re-quantizing (the same
dequantized weights, bit for bit, and the same logits); ours saves that form byte for byte and
transformers loads it; a peft adapter trained on the transformers 4-bit model gives peft's
logits on our 4-bit model; jittor vs torch over 20 QLoRA updates; GPT-2 (Conv1D layers
quantized transposed, as transformers does), Mistral and Qwen2; bad checkpoints refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import BNB_VOCAB, assert_close, bnb_nf4_config, load_hf_4bit, tiny_hf_lm, to_numpy

import lora_core as lc
from lora_core.data.batching import collate
from lora_core.formats.tensor_files import CheckpointError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb_f = pytest.importorskip("bitsandbytes.functional")
st = pytest.importorskip("safetensors.torch")

V = BNB_VOCAB
KINDS = {"llama": lambda: tiny_hf_lm("llama", attention_bias=True), "mistral": lambda: tiny_hf_lm("mistral"),
         "qwen2": lambda: tiny_hf_lm("qwen2"), "gpt2": lambda: tiny_hf_lm("gpt2")}
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "llama": ["q_proj", "v_proj", "down_proj"]}


def _bnb_config(quant_type="nf4"):
    return bnb_nf4_config(quant_type)


def _load_4bit(d):
    return load_hf_4bit(d, quantization_config=_bnb_config())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """kind -> (full-precision folder, transformers' 4-bit folder)."""
    root = tmp_path_factory.mktemp("bnb")
    out = {}
    for i, (kind, make) in enumerate(KINDS.items()):
        torch.manual_seed(i)
        hf = make().eval()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.1)
        hf.save_pretrained(root / kind)
        _load_4bit(root / kind).save_pretrained(root / f"{kind}-4bit")
        out[kind] = (root / kind, root / f"{kind}-4bit")
    return out


def _ids(T=11):
    return np.random.default_rng(0).integers(0, V, (2, T)).astype(np.int64)


def _logits(bk, model, ids):
    if bk.NAME == "torch":
        with torch.no_grad():
            return model(torch.from_numpy(ids))[0].numpy()
    import jittor as jt

    return model(jt.array(ids))[0].numpy()


def _hf_dequantized(hf) -> dict[str, np.ndarray]:
    """Every 4-bit weight of a transformers model, dequantized by bitsandbytes."""
    import bitsandbytes as bnb

    return {n: bnb_f.dequantize_4bit(m.weight.data, m.weight.quant_state).float().numpy()
            for n, m in hf.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _f32(x) -> np.ndarray:
    return to_numpy(x).astype(np.float32)  # exact: to_numpy widens float32 to float64


def _ours_layer(model, hf_name: str):
    name = hf_name[len("transformer."):] if hf_name.startswith("transformer.") else hf_name
    return dict(model.named_modules())[name]


@pytest.mark.parametrize("kind", list(KINDS))
def test_transformers_4bit_checkpoint_loads(backend, ckpts, kind):
    """Weights equal bitsandbytes' dequantization bit for bit; logits those of transformers."""
    _, d4 = ckpts[kind]
    hf = _load_4bit(d4)
    model = backend.from_pretrained(d4)
    deq = _hf_dequantized(hf)
    assert len(deq) == 2 * (7 if kind != "gpt2" else 4)
    for n, w in deq.items():
        layer = _ours_layer(model, n)
        assert type(layer).__name__ == "LoRALinear4bit", n
        assert np.array_equal(_f32(layer.weight).view(np.uint32), w.view(np.uint32)), n
    ids = _ids()
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    assert_close(f"bnb 4-bit checkpoint: logits vs transformers+bitsandbytes ({kind})", _logits(backend, model, ids),
                 ref, 1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_ours_saves_what_transformers_saves(backend, ckpts, kind, tmp_path):
    """Loaded and saved again: the same tensors (bytes) and quantization_config; transformers
    loads ours to the same dequantized weights; quantize='nf4' writes bitsandbytes' bytes."""
    d, d4 = ckpts[kind]
    backend.save_quantized(backend.from_pretrained(d4), tmp_path / "ours")
    ref, ours = st.load_file(str(d4 / "model.safetensors")), st.load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert set(ours) == set(ref) - ({"lm_head.weight"} if kind == "gpt2" else set())
    assert [k for k in ours if not torch.equal(ours[k], ref[k])] == []
    qc = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((d4 / "config.json").read_text())["quantization_config"]
    hf_ours, hf_ref = _load_4bit(tmp_path / "ours"), _load_4bit(d4)
    a, b = _hf_dequantized(hf_ours), _hf_dequantized(hf_ref)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(hf_ours(torch.from_numpy(ids)).logits, hf_ref(torch.from_numpy(ids)).logits)
    # quantized while loading from the full-precision checkpoint: bitsandbytes' packed codes
    q = backend.from_pretrained(d, quantize="nf4")
    backend.save_quantized(q, tmp_path / "q")
    mine = st.load_file(str(tmp_path / "q" / "model.safetensors"))
    assert [k for k in mine if not torch.equal(mine[k], ref[k])] == []  # codes, 8-bit scales, offsets


@pytest.mark.gpu
def test_cuda_4bit_model_saves_the_same_checkpoint(ckpts, tmp_path):
    """torch on a GPU: a 4-bit model moved to CUDA gives transformers + bitsandbytes' logits
    there, and saves the bytes it was loaded from."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    bt = lc.get_backend("torch")
    _, d4 = ckpts["llama"]
    model = bt.from_pretrained(d4)
    bt.to_device(model, "cuda")
    bt.save_quantized(model, tmp_path / "ours")
    ref, ours = st.load_file(str(d4 / "model.safetensors")), st.load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert set(ours) == set(ref) and [k for k in ours if not torch.equal(ours[k], ref[k])] == []
    hf = transformers.AutoModelForCausalLM.from_pretrained(d4, quantization_config=_bnb_config(), device_map="cuda").eval()
    ids = torch.from_numpy(_ids()).cuda()
    with torch.no_grad():
        assert_close("CUDA bnb 4-bit checkpoint: logits vs transformers+bitsandbytes", model(ids)[0].float().cpu(),
                     hf(ids).logits.float().cpu(), 1e-5)


def _peft_adapter(kind, d4, out):
    hf = _load_4bit(d4)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind], lora_dropout=0.0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(out)
    pm.eval()
    with torch.no_grad():
        return pm(torch.from_numpy(_ids())).logits.numpy()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_peft_qlora_adapter_gives_peft_logits(backend, ckpts, kind, tmp_path):
    _, d4 = ckpts[kind]
    ref = _peft_adapter(kind, d4, tmp_path / "adapter")
    model = backend.from_pretrained(d4, adapter=tmp_path / "adapter")
    assert_close(f"QLoRA logits vs transformers+bitsandbytes+peft ({kind})", _logits(backend, model, _ids()), ref, 1e-5)


def _batch(seed):
    ids = np.random.default_rng(seed).integers(0, V, (2, 12))
    return collate([(list(r[:1]), list(r[1:])) for r in ids])


def _curve(bk, d4, steps=20):
    from lora_core.train.optim import AdamWConfig

    model = bk.from_pretrained(d4)
    bk.inject_lora(model, lc.LoRATargetConfig(r=4, alpha=16.0, target_modules=("q_proj", "v_proj", "down_proj"), seed=2))
    opt = bk.AdamW(bk.trainable_parameters(model), AdamWConfig(weight_decay=0.01))
    losses = [bk.train_step(model, opt, [_batch(s % 4)], 2e-3, max_grad_norm=1.0)["loss"] for s in range(steps)]
    return np.array(losses), {n: to_numpy(p) for n, p in bk.trainable_parameters(model).items()}


def test_jittor_matches_torch_over_20_qlora_updates(ckpts):
    d4 = ckpts["llama"][1]
    (lt, wt), (lj, wj) = _curve(lc.get_backend("torch"), d4), _curve(lc.get_backend("jittor"), d4)
    assert lt[-1] < lt[0]
    assert_close("QLoRA jittor vs torch: 20-update loss curve", lj, lt, 1e-5)
    for n in wt:
        assert_close("QLoRA jittor vs torch: LoRA weights after 20 updates", wj[n], wt[n], 1e-5)


def _bnb_skipping(skip):
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                           bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skip)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_full_precision_weights_under_a_quantization_config_are_quantized(backend, ckpts, kind, tmp_path):
    """A config.json with a quantization_config over full-precision weights: quantized while
    loading, bit for bit as transformers quantizes the full-precision checkpoint given the same
    BitsAndBytesConfig (what llm_int8_skip_modules names left out, by transformers' rule); ours
    loaded them as a full-precision model before, with quantize='nf4' too. (transformers 5.24
    loading such a folder by its config alone puts the float weights into its 4-bit modules
    unquantized.)"""
    from examples.lm.bench_systems import exact_4bit_inference

    skip = ["lm_head", {"llama": "q_proj", "gpt2": "h.0.attn.c_attn"}[kind]]  # a suffix pattern
    qc = _bnb_skipping(skip).to_dict()
    d = _rewrite(ckpts[kind][0], tmp_path / "qc", None, lambda c: c.update(quantization_config=qc))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts[kind][0], device_map="cpu",
                                                           quantization_config=_bnb_skipping(skip))
    exact_4bit_inference(hf)
    hf.eval()
    deq = _hf_dequantized(hf)
    assert len(deq) == {"llama": 14 - 2, "gpt2": 8 - 1}[kind]
    for model in (backend.from_pretrained(d), backend.from_pretrained(d, quantize="nf4")):
        for n, w in deq.items():
            layer = _ours_layer(model, n)
            assert type(layer).__name__ == "LoRALinear4bit", n
            assert np.array_equal(_f32(layer.weight).view(np.uint32), w.view(np.uint32)), n
        left = [n for n, m in model.named_modules() if n.endswith(("q_proj", "h.0.attn.c_attn"))
                and type(m).__name__ != "LoRALinear4bit"]  # fmt: skip
        assert len(left) == {"llama": 2, "gpt2": 1}[kind], left
        ids = _ids()
        with torch.no_grad():
            ref = hf(torch.from_numpy(ids)).logits.numpy()
        assert_close(f"quantized while loading under the config's quantization_config ({kind})",
                     _logits(backend, model, ids), ref, 1e-5)


def test_a_full_precision_projection_among_4bit_ones_is_quantized_too(backend, ckpts, tmp_path):
    """A bitsandbytes checkpoint with one projection stored in full precision (and not skipped):
    quantized while loading with the checkpoint's settings (it loaded half 4-bit before)."""
    full = st.load_file(str(ckpts["llama"][0] / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"

    def edit(t):
        for k in [k for k in t if k.startswith(name)]:
            del t[k]
        t[name] = full[name]

    d = _rewrite(ckpts["llama"][1], tmp_path / "partial", edit)
    model = backend.from_pretrained(d)
    whole = backend.from_pretrained(ckpts["llama"][1])
    layer, ref = _ours_layer(model, name[: -len(".weight")]), _ours_layer(whole, name[: -len(".weight")])
    assert type(layer).__name__ == "LoRALinear4bit"
    assert np.array_equal(_f32(layer.weight).view(np.uint32), _f32(ref.weight).view(np.uint32))


def test_loading_a_full_precision_checkpoint_as_4bit_without_quantize_says_so(ckpts):
    from lora_core.quant.checkpoint4bit import load_4bit_checkpoint

    with pytest.raises(ValueError, match="not a 4-bit checkpoint; pass quantize='nf4' to quantize it while loading"):
        load_4bit_checkpoint(ckpts["llama"][0], quantize=None)


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    t = st.load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(t)
    st.save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


QS = "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"


def _set_qs(**kw):
    def edit(t):
        d = json.loads(bytes(t[QS].numpy()).decode())
        d.update(kw)
        t[QS] = torch.tensor(list(json.dumps(d).encode()), dtype=torch.uint8)
    return edit


BAD = {
    "fp4": (None, lambda c: c["quantization_config"].update(bnb_4bit_quant_type="fp4"),
            ValueError, "bnb_4bit_quant_type 'fp4' is not supported; supported: bitsandbytes 4-bit NF4"),
    "qc-list": (None, lambda c: c.update(quantization_config=["nf4"]), ValueError,
                "quantization_config must be an object .transformers' BitsAndBytesConfig as JSON., got list"),
    "gptq": (None, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
             ValueError, "quant_method 'gptq' is not supported"),
    "awq": (None, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}),
            ValueError, "quant_method 'awq' is not supported"),
    "blocksize": (_set_qs(blocksize=100), None, ValueError, "blocksize 100 is not a 4-bit block size bitsandbytes allows"),
    "absmax-cut": (lambda t: t.update({"model.layers.0.mlp.up_proj.weight.absmax":
                                       t["model.layers.0.mlp.up_proj.weight.absmax"][:-1].clone()}), None,
                   CheckpointError, "model.layers.0.mlp.up_proj.weight.absmax: damaged 4-bit quant state"),
    "state-json": (lambda t: t.update({QS: t[QS][:-3].clone()}), None, CheckpointError,
                   f"{QS}: damaged 4-bit quant state"),
    "no-quant-map": (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight.quant_map"), None, CheckpointError,
                     "model.layers.1.self_attn.k_proj.weight: damaged 4-bit quant state .missing"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_refused_by_name(ckpts, tmp_path, case):
    edit_t, edit_c, err, msg = BAD[case]
    d = _rewrite(ckpts["llama"][1], tmp_path / case, edit_t, edit_c)
    for name in ("torch", "jittor"):
        with pytest.raises(err, match=msg) as e:
            lc.get_backend(name).from_pretrained(d)
        if err is CheckpointError:
            assert str(d / "model.safetensors") in str(e.value)
        print(f"{case}: {e.value}")
