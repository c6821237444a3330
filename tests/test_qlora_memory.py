"""Quantizing while loading keeps the full-precision model out of memory (issue 23): a float32
GPT-2 or DistilBERT checkpoint of ~39 MB loaded with ``quantize="nf4"`` in a fresh process,
whose private (anonymous) resident memory, ``RssAnon`` of /proc/self/status (the memory-mapped
checkpoint's pages are file-backed and not counted), is sampled every 0.2 ms during the load.

Bound: the growth of the peak over the process's memory before the load <= the 4-bit model
(packed NF4 weights + the float32 tensors left unquantized) + a quarter of the float32 weights
(the tensor being quantized, its temporaries, the allocator's slack): 16.0 MB (GPT-2), 16.3 MB
(DistilBERT). Measured (2-core CPU, two runs): 8.4-11.9 MB in both backends; before GPT-2's Conv1D
weights were left as transposed views of the map (all of them were copied to float32 before
the first was quantized) 40.9 / 42.8 MB (torch / jittor), above the float32 weights' 39.1 MB.

The same weights as bfloat16 safetensors and as ``pytorch_model.bin`` (``torch.save``, zip and
legacy) are read tensor by tensor too (``LazyTensor``: bf16 widened, a .bin storage memory-mapped
or read, when it is quantized): 10.2-13.7 MB in both backends; before (the whole file read and
widened/copied first) bf16 42.1-44.7 MB, .bin 76.6-79.6 MB (zip and legacy). And the NF4 states
and other tensors of those files equal the float32 safetensors checkpoint's of the same values
(bf16: its values widened), in ``lora_core`` and in both backends' models."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lora_core.formats.hf_checkpoint import write_hf_checkpoint
from lora_core.models import distilbert as db
from lora_core.models import gpt2
from lora_core.quant.qlora import is_quantized_weight
from lora_core.train.full_ft import hf_config, hf_tensors

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")

# 12 blocks of width 256 (9.4 M quantized weights, ~39 MB float32), small vocabulary
BIG = {"gpt2": gpt2.GPT2Config(vocab_size=1024, n_positions=128, n_embd=256, n_layer=12, n_head=4),
       "distilbert": db.DistilBertConfig(vocab_size=1024, max_position_embeddings=128, dim=256, n_layers=12, n_heads=4,
                                         hidden_dim=1024)}
SMALL = {"gpt2": gpt2.GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2),
         "distilbert": db.DistilBertConfig(**db.PRESETS["tiny"].to_dict())}

CHILD = r"""
import gc, json, sys, threading, time

def private():  # resident anonymous memory, bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

from lora_core import get_backend

bk = get_backend(sys.argv[1])
load = bk.distilbert_from_pretrained if sys.argv[2] == "distilbert" else bk.from_pretrained
m = load(sys.argv[3], quantize="nf4")  # warm-up: imports, lookup tables, first allocations
del m
gc.collect()
peak, stop = [0], []

def sample():
    while not stop:
        peak[0] = max(peak[0], private())
        time.sleep(0.0002)

base = private()
t = threading.Thread(target=sample)
t.start()
m = load(sys.argv[4], quantize="nf4")
stop.append(1)
t.join()
print(json.dumps({"growth": max(peak[0], private()) - base}))
"""


def _weights(family: str, cfg) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: (rng.standard_normal(s) * 0.02).astype(np.float32)
            for n, s in (gpt2.base_shapes(cfg) if family == "gpt2" else db.base_shapes(cfg)).items()}


def _write(folder: Path, family: str, cfg, fmt: str = "fp32") -> dict[str, np.ndarray]:
    """A checkpoint folder of random weights: float32 ``model.safetensors`` (``fp32``), the same
    as bfloat16 (``bf16``), or a ``pytorch_model.bin`` written by ``torch.save`` (``bin``: the
    zip archive, ``bin-legacy``: the legacy stream)."""
    w = _weights(family, cfg)
    write_hf_checkpoint(folder, hf_config(cfg), hf_tensors(cfg, w))
    if fmt != "fp32":
        torch = pytest.importorskip("torch")
        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in hf_tensors(cfg, w).items()}
        (folder / "model.safetensors").unlink()
        if fmt == "bf16":
            from safetensors.torch import save_file

            save_file({k: v.bfloat16() for k, v in state.items()}, str(folder / "model.safetensors"))
        else:
            torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=fmt == "bin")
    return w


def _bound(w: dict[str, np.ndarray]) -> tuple[int, int]:
    """(the bound, the float32 bytes): 4-bit model + a quarter of the float32 weights."""
    fp32 = sum(v.nbytes for v in w.values())
    q = sum(v.size for n, v in w.items() if is_quantized_weight(n))
    four_bit = q // 2 + q // 64 + 4 * (q // (64 * 256) + 1) + sum(v.nbytes for n, v in w.items()
                                                                    if not is_quantized_weight(n))
    return four_bit + fp32 // 4, fp32


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "bin", "bin-legacy"])
def test_quantizing_while_loading_never_holds_the_float32_model(backend, fmt, tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    runs = {}
    for family in BIG:  # one process per family, side by side
        w = _write(tmp_path / f"{family}-big", family, BIG[family], fmt)
        _write(tmp_path / f"{family}-small", family, SMALL[family], fmt)
        runs[family] = _bound(w), subprocess.Popen(
            [sys.executable, "-c", CHILD, backend.NAME, family, str(tmp_path / f"{family}-small"),
             str(tmp_path / f"{family}-big")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            cwd=root)
        del w
    over = []
    for family, ((bound, fp32), proc) in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        growth = json.loads(out.strip().splitlines()[-1])["growth"]
        line = (f"{backend.NAME} {family} {fmt}: private memory grew {growth / 1e6:.1f} MB loading {fp32 / 1e6:.1f} "
                f"MB of float32 weights (bound {bound / 1e6:.1f} MB)")
        print(line)
        if growth > bound:
            over.append(line)
    assert not over, f"the float32 weights were held at once: {over}"


# --------------------------------------------------------------------------- the formats read tensor by tensor

FAMILIES = ("gpt2", "llama", "distilbert")
FORMATS = {"gpt2": ("bf16", "bin", "bin-legacy"), "llama": ("bf16", "bin", "bin-legacy", "bin-sharded"),
           "distilbert": ("bf16", "bin", "bin-legacy")}


def _hf_model(family: str):
    """A tiny random transformers model of ``family`` (biases drawn too: they stay float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64,
                                                                     n_layer=2, n_head=4))
    elif family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    else:
        model = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
            vocab_size=96, max_position_embeddings=32, dim=64, n_layers=2, n_heads=4, hidden_dim=96, num_labels=3))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.1)
    return model.eval()


def _save_bin(model, folder: Path, fmt: str) -> None:
    """What ``save_pretrained(safe_serialization=False)`` wrote (transformers 5 writes only
    safetensors): config.json and ``torch.save`` of the state dict (tied weights sharing their
    storage), the zip archive, the legacy stream, or two shards with ``pytorch_model.bin.index.json``."""
    import torch

    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    sd = model.state_dict()
    if fmt != "bin-sharded":
        torch.save(sd, folder / "pytorch_model.bin", _use_new_zipfile_serialization=fmt == "bin")
        return
    names = list(sd)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for fname, part in shards.items():
        torch.save({k: sd[k] for k in part}, folder / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """``{(family, fmt): (checkpoint folder, float32 safetensors folder of the same values)}``: a
    bfloat16 checkpoint's reference holds its values widened to float32."""
    import torch

    root = tmp_path_factory.mktemp("qlora_formats")
    out = {}
    for family in FAMILIES:
        model = _hf_model(family)
        model.save_pretrained(root / family / "fp32")
        for fmt in FORMATS[family]:
            d = root / family / fmt
            if fmt == "bf16":
                bf16 = copy.deepcopy(model).to(torch.bfloat16)
                bf16.save_pretrained(d)
                bf16.to(torch.float32).save_pretrained(root / family / "bf16-as-fp32")
                out[family, fmt] = d, root / family / "bf16-as-fp32"
            else:
                _save_bin(model, d, fmt)
                out[family, fmt] = d, root / family / "fp32"
    return out


def _load_core(family: str, path):
    """``(states, tensors)`` as the backends get them from ``lora_core``, the tensors converted."""
    from lora_core.quant.checkpoint4bit import load_4bit_checkpoint
    from lora_core.quant.distilbert4bit import load_distilbert_4bit

    if family == "distilbert":
        _, states, tensors, _ = load_distilbert_4bit(path)
    else:
        _, _, states, tensors, _ = load_4bit_checkpoint(path)
    return states, {k: np.asarray(v) for k, v in tensors.items()}


def _same_state(a, b) -> bool:
    fields = ("packed", "absmax", "nested_absmax", "offset")
    return (a.shape, a.blocksize, a.dtype) == (b.shape, b.blocksize, b.dtype) and all(
        np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))) for f in fields)


@pytest.mark.parametrize("family,fmt", [(f, m) for f in FAMILIES for m in FORMATS[f]])
def test_bf16_and_bin_checkpoints_quantize_to_the_float32_bits(family, fmt, formats):
    """bf16 safetensors and ``torch.save`` files, read tensor by tensor (``LazyTensor``), give
    the NF4 states and float32 tensors of the float32 safetensors checkpoint of the same values."""
    from lora_core.formats.tensor_files import LazyTensor

    path, ref_path = formats[family, fmt]
    (states, tensors), (ref_states, ref_tensors) = _load_core(family, path), _load_core(family, ref_path)
    assert states.keys() == ref_states.keys() and len(states) >= 8
    bad = [n for n in states if not _same_state(states[n], ref_states[n])]
    assert not bad, f"{family} {fmt}: NF4 states differ from the float32 checkpoint's: {bad}"
    assert tensors.keys() == ref_tensors.keys()
    bad = [n for n in tensors if tensors[n].dtype != np.float32 or not np.array_equal(tensors[n], ref_tensors[n])]
    assert not bad, f"{family} {fmt}: unquantized tensors differ: {bad}"
    from lora_core.formats.hf_checkpoint import read_hf_weights

    lazy = read_hf_weights(path, lazy=True)
    assert all(isinstance(v, LazyTensor) for k, v in lazy.items() if fmt.startswith("bin") or k.endswith("weight"))


@pytest.mark.parametrize("family,fmt", [(f, m) for f in FAMILIES for m in FORMATS[f][:2]])
def test_bf16_and_bin_checkpoints_give_the_float32_model(backend, family, fmt, formats):
    """In each backend: every 4-bit layer dequantizes to the bits of the model loaded from the
    float32 checkpoint, and every other parameter is equal."""
    from helpers import to_numpy

    path, ref_path = formats[family, fmt]
    load = backend.distilbert_from_pretrained if family == "distilbert" else backend.from_pretrained
    model, ref = load(path, quantize="nf4"), load(ref_path, quantize="nf4")
    layers = {n: m for n, m in model.named_modules() if type(m).__name__ == "LoRALinear4bit"}
    ref_layers = {n: m for n, m in ref.named_modules() if type(m).__name__ == "LoRALinear4bit"}
    assert layers.keys() == ref_layers.keys() and len(layers) >= 8
    for n, m in layers.items():
        got, want = (to_numpy(x.weight).astype(np.float32) for x in (m, ref_layers[n]))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{family} {fmt}: {n}"
    got, want = model.state_numpy(), ref.state_numpy()
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], want[k]) for k in want), f"{family} {fmt}: other parameters differ"
