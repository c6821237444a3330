"""Test helpers: compare two results with explicit tolerances, showing both sides on failure
(tinygrad's ``helper_test_op`` idea)."""

from __future__ import annotations

import numpy as np

# Measured maxima of each comparison, printed at the end of the run (tests/conftest.py).
MEASURED: dict[str, float] = {}


def to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    elif hasattr(x, "numpy"):
        x = x.numpy()
    return np.asarray(x, dtype=np.float64)


def rel_diff(ours, ref) -> float:
    """max|ours - ref| / max(max|ref|, 1e-30)."""
    a, b = to_numpy(ours), to_numpy(ref)
    assert a.shape == b.shape, f"shapes differ: ours {a.shape}, reference {b.shape}"
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if a.size else 0.0


def assert_close(name: str, ours, ref, rtol: float, floor: float = 0.0) -> float:
    """Assert ``max|ours-ref| <= rtol * max(floor, max|ref|)``; record and return the measured ratio
    ``max|ours-ref| / max(floor, max|ref|)``; on failure show both sides."""
    a, b = to_numpy(ours), to_numpy(ref)
    assert a.shape == b.shape, f"{name}: shapes differ: ours {a.shape}, reference {b.shape}"
    assert np.isfinite(a).all() and np.isfinite(b).all(), f"{name}: non-finite values"
    scale = max(floor, float(np.abs(b).max()) if b.size else 0.0, 1e-30)
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    ratio = diff / scale
    MEASURED[name] = max(MEASURED.get(name, 0.0), ratio)
    if ratio > rtol:
        i = np.unravel_index(np.abs(a - b).argmax(), a.shape)
        raise AssertionError(
            f"{name}: max|diff| = {diff:.3e} > {rtol:.1e} x {scale:.3e} (ratio {ratio:.3e})\n"
            f"  at {tuple(int(j) for j in i)}: ours {a[i]!r}, reference {b[i]!r}\n"
            f"  ours[:6]      = {a.ravel()[:6]}\n  reference[:6] = {b.ravel()[:6]}")
    return ratio


def peft_c_attn(hf_model, n_layer: int, lora_weights: dict, r: int, alpha: float):
    """``hf_model`` wrapped by peft with LoRA on the whole ``c_attn`` (fan-in/fan-out, no dropout),
    its A and B set to our ``h.{i}.attn.c_attn.lora_{A,B}`` values: the independent reference
    for our LoRA with ``enable_lora=None, target_modules=("c_attn",)``."""
    import peft
    import torch

    pm = peft.get_peft_model(hf_model, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["c_attn"],
                                                       lora_dropout=0.0, fan_in_fan_out=True, bias="none"))
    with torch.no_grad():
        for i in range(n_layer):
            layer = pm.base_model.model.transformer.h[i].attn.c_attn
            layer.lora_A["default"].weight.copy_(torch.from_numpy(lora_weights[f"h.{i}.attn.c_attn.lora_A"]))
            layer.lora_B["default"].weight.copy_(torch.from_numpy(lora_weights[f"h.{i}.attn.c_attn.lora_B"]))
    return pm


def toy_train_args(toy: dict, out_dir, steps: int, settings: list[str], *extra: str) -> list[str]:
    """``examples.nlg.train``'s arguments for a run on ``lora_core.data.toy``'s data (``toy``: its
    paths and vocabulary size) with a tiny random GPT-2; the caller adds ``--backend``."""
    return [
        "--recipe", "toy", "--train", str(toy["train"]), "--valid", str(toy["valid"]), "--random-init", "tiny",
        "--vocab-size", str(toy["vocab_size"]), *extra, "--max-steps", str(steps), "--no-progress",
        "--out-dir", str(out_dir), "--set", *settings,
    ]  # fmt: skip


def write_toy_sst2(folder, sizes=(("train", 32), ("dev", 8))) -> None:
    """Prepared SST-2-like splits under ``folder/sst2`` (``examples.cls.prepare``'s form): each
    label draws its token ids from its own range, so a classifier can learn it."""
    from lora_core.data.nlg import write_jsonl_atomic

    rng = np.random.default_rng(0)
    for split, n in sizes:
        rows = []
        for _ in range(n):
            label = int(rng.integers(0, 2))
            rows.append({"ids": [1, *rng.integers(8 + 2 * label, 10 + 2 * label, 5).tolist(), 2], "label": label})
        write_jsonl_atomic(folder / "sst2" / f"{split}.jsonl", rows)


def cls_train_argv(data, backend: str, out, *extra: str) -> list[str]:
    """``examples.cls.train`` arguments for a 4-update run of the demo recipe on ``data``
    (``base/`` and ``sst2/``)."""
    return ["--backend", backend, "--recipe", "sst2-demo", "--prepared", str(data / "sst2"), "--base",
            str(data / "base"), "--out-dir", str(out), "--no-progress", "--max-steps", "4", *extra,
            "--set", "train.batch_size=8", "train.lr=1e-2", "train.log_every=1", "train.save_every=4"]  # fmt: skip


def write_torch_bin(state_dict: dict, folder, shards: int = 0) -> None:
    """The ``torch.save`` layouts older transformers wrote (transformers 5 saves only
    safetensors): ``pytorch_model.bin``, or ``shards`` files with ``pytorch_model.bin.index.json``."""
    import json
    from pathlib import Path

    import torch

    folder = Path(folder)
    if not shards:
        torch.save(state_dict, folder / "pytorch_model.bin")
        return
    names, weight_map = list(state_dict), {}
    for i in range(shards):
        fname = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: state_dict[k] for k in names[i::shards]}, folder / fname)
        weight_map.update({k: fname for k in names[i::shards]})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ------------------------------------------------------------------ tiny 4-bit models (bitsandbytes)

BNB_VOCAB = 96
# widths multiples of the block size (64): bitsandbytes 0.50.2's CPU dequantization kernel scales a
# block that spans two rows by another block's absmax (tests/test_nf4.py, _rows_whole), and
# transformers' forward uses it; the spec and our layers dequantize such blocks as stored.
BNB_SMALL = dict(vocab_size=BNB_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def tiny_hf_lm(kind: str, **extra):
    """A tiny random transformers causal LM of ``kind`` (llama, mistral, qwen2, gpt2) at the
    4-bit tests' widths (``BNB_SMALL``); ``extra``: more config fields (Llama's attention_bias)."""
    import transformers

    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=BNB_VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0, embd_pdrop=0,
            attn_pdrop=0, **extra))  # fmt: skip
    if kind == "mistral":
        extra.setdefault("sliding_window", 64)
    cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[kind]
    return getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**BNB_SMALL, **extra))


def bnb_nf4_config(quant_type: str = "nf4", **kw):
    """transformers' 4-bit quantization config on the float32 compute path (double quantization
    unless ``bnb_4bit_use_double_quant=False``)."""
    import torch
    import transformers

    kw.setdefault("bnb_4bit_use_double_quant", True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                           bnb_4bit_compute_dtype=torch.float32, **kw)  # fmt: skip


def load_hf_4bit(folder, **kw):
    """transformers' 4-bit model of ``folder`` (``kw``: ``from_pretrained``'s, e.g. a
    ``quantization_config``) on the exact float32 path: without ``exact_4bit_inference``,
    bitsandbytes 0.50.2's Linear4bit in eval mode on a CPU with AVX512-BF16 repacks its weight for
    a bfloat16 gemv kernel (``_convert_weight_packed_for_cpu``; 1.3e-3 x scale off float32 here)."""
    import torch
    import transformers

    from examples.lm.bench_systems import exact_4bit_inference

    kw.setdefault("dtype", torch.float32)
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", **kw)
    exact_4bit_inference(m)
    return m.eval()
