"""Published bitsandbytes 4-bit checkpoints in the layouts transformers writes beyond the default
(review findings on the QLoRA loader), each against transformers + bitsandbytes on CPU with tiny
random models saved in the test:

- ``llm_int8_skip_modules``: a checkpoint whose listed projections stay in full precision, loaded
  and saved again by ``save_quantized``, keeps them so: the saved ``quantization_config`` lists
  them, ours reloads the same model, and transformers loads the folder (it crashed on it before);
- ``bnb_4bit_quant_storage`` other than uint8 (bfloat16: the FSDP / ZeRO-3 QLoRA layout; float16,
  float32): the packed codes are the tensor's bytes (refused as damaged before);
- a checkpoint saved without double quantization loads with ``quantize="nf4"`` and with the
  command line's ``--quantize nf4`` (refused before: double quantization read as asked for); a
  storage option that contradicts the checkpoint is refused naming the option."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from helpers import BNB_VOCAB, assert_close, bnb_nf4_config, load_hf_4bit, tiny_hf_lm, to_numpy

transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")
bnb_f = pytest.importorskip("bitsandbytes.functional")

V = BNB_VOCAB
KINDS = {"llama": lambda: tiny_hf_lm("llama"), "gpt2": lambda: tiny_hf_lm("gpt2")}
# transformers' module names (suffix patterns, as users write them) left in full precision
SKIP = {"llama": ["lm_head", "down_proj"], "gpt2": ["lm_head", "mlp.c_proj", "h.0.attn.c_attn"]}


_bnb = bnb_nf4_config
_hf = load_hf_4bit


def _ids():
    return torch.from_numpy(np.random.default_rng(0).integers(0, V, (2, 11)).astype(np.int64))


def _ours_logits(model) -> np.ndarray:
    with torch.no_grad():
        out = model(_ids())
    return (out[0] if isinstance(out, tuple) else out).numpy()


def _hf_logits(hf) -> np.ndarray:
    with torch.no_grad():
        return hf(_ids()).logits.numpy()


def _n4(model) -> int:
    return sum(type(m).__name__ == "LoRALinear4bit" for m in model.modules())


def _hf_n4(hf) -> int:
    return sum(isinstance(m, bnb.nn.Linear4bit) for m in hf.modules())


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """kind -> a full-precision transformers checkpoint folder."""
    root = tmp_path_factory.mktemp("fp")
    out = {}
    for i, (kind, make) in enumerate(KINDS.items()):
        torch.manual_seed(i)
        make().save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def _quantized(full_dir, dst, **kw):
    """transformers' bitsandbytes 4-bit checkpoint of ``full_dir`` saved to ``dst``."""
    transformers.AutoModelForCausalLM.from_pretrained(full_dir, quantization_config=_bnb(**kw), device_map="cpu",
                                                      dtype=torch.float32).save_pretrained(dst)
    return dst


@pytest.mark.parametrize("kind", list(KINDS))
def test_save_quantized_keeps_llm_int8_skip_modules(full, kind, tmp_path):
    bk = __import__("lora_core").get_backend("torch")
    src = _quantized(full[kind], tmp_path / "src", llm_int8_skip_modules=SKIP[kind])
    hf_src = _hf(src)
    model = bk.from_pretrained(src)
    assert _n4(model) == _hf_n4(hf_src) == {"llama": 12, "gpt2": 5}[kind]
    first = _ours_logits(model)
    assert_close(f"skip_modules checkpoint: ours vs transformers ({kind})", first, _hf_logits(hf_src), 1e-5)

    bk.save_quantized(model, tmp_path / "resaved")
    skip = json.loads((tmp_path / "resaved" / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    assert skip and "lm_head" in skip, skip
    again = bk.from_pretrained(tmp_path / "resaved")
    assert _n4(again) == _n4(model)  # 14 (llama) / 8 (gpt2) before: the float layers quantized on reload
    assert np.array_equal(_ours_logits(again), first)
    hf = _hf(tmp_path / "resaved")  # before: transformers failed (float weights put into Linear4bit)
    assert _hf_n4(hf) == _hf_n4(hf_src)
    assert_close(f"re-saved skip_modules checkpoint: transformers vs ours ({kind})", _hf_logits(hf), first, 1e-5)


def test_distilbert_head_still_listed_alone():
    """DistilBERT's float head alone is listed (transformers would quantize it); the LM families'
    lm_head alone is not (transformers' defaults keep it)."""
    from lora_core.quant.checkpoint4bit import float_skip_modules
    from lora_core.quant.qlora import DISTILBERT_SKIP

    st = {"distilbert.transformer.layer.0.ffn.lin1.weight": None}
    assert float_skip_modules({}, st, DISTILBERT_SKIP, heads_alone=True) == ["pre_classifier", "classifier"]
    assert float_skip_modules({"model.norm.weight": 0}, {"model.layers.0.mlp.up_proj.weight": None}) is None
    both = {"model.layers.0.mlp.down_proj.weight": 0, "model.layers.1.mlp.down_proj.weight": 0}
    st = {"model.layers.0.mlp.up_proj.weight": None, "model.layers.1.mlp.up_proj.weight": None}
    assert float_skip_modules(both, st) == ["lm_head", "down_proj"]
    one = {"model.layers.1.mlp.down_proj.weight": 0}
    st2 = dict(st, **{"model.layers.0.mlp.down_proj.weight": None})
    assert float_skip_modules(one, st2) == ["lm_head", "1.mlp.down_proj"]


@pytest.mark.parametrize("storage", ["bfloat16", "float16", "float32"])
def test_quant_storage_other_than_uint8_loads(backend, full, storage, tmp_path):
    d = _quantized(full["llama"], tmp_path / storage, bnb_4bit_quant_storage=getattr(torch, storage))
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["bnb_4bit_quant_storage"] == storage
    hf = _hf(d)
    assert hf.model.layers[0].mlp.down_proj.weight.dtype == getattr(torch, storage)
    model = backend.from_pretrained(d)  # before: "damaged 4-bit quant state (float32[...], expected uint8[...])"
    for n, m in hf.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            ref = bnb_f.dequantize_4bit(m.weight.data, m.weight.quant_state).float().numpy()
            mine = to_numpy(dict(model.named_modules())[n].weight).astype(np.float32)
            assert np.array_equal(mine.view(np.uint32), ref.view(np.uint32)), n
    if backend.NAME == "torch":
        ours = _ours_logits(model)
    else:
        import jittor as jt

        ours = model(jt.array(_ids().numpy()))[0].numpy()
    assert_close(f"bnb_4bit_quant_storage={storage}: ours vs transformers ({backend.NAME})", ours, _hf_logits(hf), 1e-5)


def test_quant_storage_damaged_is_named(full, tmp_path):
    """Codes of the wrong size under a bfloat16 storage: refused naming the tensor, the file and the storage."""
    import safetensors.torch as st

    from lora_core.formats.tensor_files import CheckpointError

    d = _quantized(full["llama"], tmp_path / "bf16", bnb_4bit_quant_storage=torch.bfloat16)
    t = st.load_file(str(d / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    t[name] = t[name][:-1].clone()
    st.save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name}: damaged 4-bit quant state .* bnb_4bit_quant_storage bfloat16"):
        __import__("lora_core").get_backend("torch").from_pretrained(d)


def test_unknown_quant_storage_refused(full, tmp_path):
    d = _quantized(full["llama"], tmp_path / "q")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["bnb_4bit_quant_storage"] = "complex64"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bnb_4bit_quant_storage 'complex64' is not supported"):
        __import__("lora_core").get_backend("torch").from_pretrained(d)


def _args(*argv):
    from examples.run_options import add_quantize_options

    p = argparse.ArgumentParser()
    add_quantize_options(p)
    return p.parse_args(list(argv))


def test_checkpoint_without_double_quant_loads_with_quantize_nf4(full, tmp_path):
    from examples.run_options import loaded_quant, quantize_kwargs

    bk = __import__("lora_core").get_backend("torch")
    d = _quantized(full["llama"], tmp_path / "dq0", bnb_4bit_use_double_quant=False)
    ref = _hf_logits(_hf(d))
    for kw in ({"quantize": "nf4"}, {"quantize": "nf4", "compute_dtype": "float32"},
               quantize_kwargs(_args("--quantize", "nf4"))):
        model = bk.from_pretrained(d, **kw)  # before: "double_quant=True do not match it"
        assert_close(f"no-double-quant checkpoint, {kw}: ours vs transformers", _ours_logits(model), ref, 1e-5)
    bf = bk.from_pretrained(d, **quantize_kwargs(_args("--quantize", "nf4", "--compute-dtype", "bfloat16")))
    assert {m.compute_dtype_name for m in bf.modules() if type(m).__name__ == "LoRALinear4bit"} == {"bfloat16"}
    # the run's base note: the checkpoint's own double quantization (a resume compares it)
    assert loaded_quant(d, quantize_kwargs(_args("--quantize", "nf4")))["double_quant"] is False
    assert loaded_quant(d, {}) == loaded_quant(d, quantize_kwargs(_args("--quantize", "nf4")))
    assert loaded_quant(full["llama"], quantize_kwargs(_args("--quantize", "nf4")))["double_quant"] is True
    assert loaded_quant(None, quantize_kwargs(_args("--quantize", "nf4", "--no-double-quant")))["double_quant"] is False


def test_a_contradicting_option_is_refused_by_name(full, tmp_path):
    from examples.run_options import quantize_kwargs

    bk = __import__("lora_core").get_backend("torch")
    d = _quantized(full["llama"], tmp_path / "dq1")
    with pytest.raises(ValueError, match=r"double_quant True\) is loaded as it is; double_quant=False "
                                         r"\(--no-double-quant\) does not match it"):
        bk.from_pretrained(d, **quantize_kwargs(_args("--quantize", "nf4", "--no-double-quant")))
    with pytest.raises(ValueError, match="blocksize=128 does not match it"):
        bk.from_pretrained(d, quantize="nf4", blocksize=128)
    # a value given is told from one left out (the backends default to None): double_quant=True
    # given on a checkpoint saved without it is refused, left out it loads (the test above)
    d0 = _quantized(full["llama"], tmp_path / "dq0", bnb_4bit_use_double_quant=False)
    with pytest.raises(ValueError, match=r"double_quant=True does not match it"):
        bk.from_pretrained(d0, quantize="nf4", double_quant=True)
    # quantized while loading, the options unset are the defaults
    q = bk.from_pretrained(full["llama"], **quantize_kwargs(_args("--quantize", "nf4")))
    ref = bk.from_pretrained(d)
    assert np.array_equal(_ours_logits(q), _ours_logits(ref))
