"""The framework-agnostic spec: configs, naming, checkpoints, adapters, selector, isolation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lora_core as lc
from lora_core.formats.checkpoint import CheckpointError, read_tensors

ROOT = Path(__file__).resolve().parents[1]


def test_import_lora_core_loads_no_framework():
    code = ("import sys, lora_core, lora_core.data.nlg, lora_core.data.tokenizer, lora_core.generate.decode, lora_core.data.batching;"
            "bad = [m for m in ('torch', 'jittor') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("kwargs, needle", [
    ({"r": -1}, "r must be"), ({"alpha": 0}, "alpha"), ({"dropout": 1.0}, "dropout"),
    ({"bias": "some"}, "'some'"), ({"target_modules": ("q_proj",)}, "q_proj"),
    ({"enable_lora": (False, False, False)}, "enable_lora"), ({"enable_lora": (True, True)}, "enable_lora"),
])
def test_lora_config_errors_quote_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        lc.LoRAConfig(**kwargs)


def test_gpt2_config_presets_and_errors():
    assert (lc.PRESETS["gpt2-medium"].n_embd, lc.PRESETS["gpt2-medium"].n_layer) == (1024, 24)
    assert lc.PRESETS["gpt2-large"].n_head == 20 and lc.PRESETS["gpt2"].layer_norm_epsilon == 1e-5
    assert lc.PRESETS["gpt2"].embd_pdrop == 0.0 and lc.PRESETS["gpt2"].n_positions == 1024
    with pytest.raises(ValueError, match="not divisible"):
        lc.GPT2Config(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="unknown GPT-2 preset 'gpt3'"):
        lc.gpt2_config("gpt3")
    with pytest.raises(ValueError, match="unknown keys"):
        lc.LoRAConfig.from_dict({"r": 4, "rank": 4})
    assert lc.LoRAConfig.from_dict(lc.LoRAConfig(r=8).to_dict()) == lc.LoRAConfig(r=8)


def test_paper_adapter_size_gpt2_medium():
    """The r=4 q,v adapter of gpt2-medium: 393,216 parameters (the paper's 0.35M)."""
    shapes = lc.lora_shapes(lc.PRESETS["gpt2-medium"], lc.LoRAConfig(r=4, alpha=32))
    assert lc.count_parameters(shapes) == 393_216
    assert shapes["h.0.attn.c_attn.lora_A"] == (8, 1024) and shapes["h.0.attn.c_attn.lora_B"] == (2048, 4)


def test_seeded_init_is_deterministic_and_loralib_shaped():
    cfg, lora = lc.gpt2_config("tiny"), lc.LoRAConfig(r=4)
    a, b = lc.init_lora_weights(cfg, lora), lc.init_lora_weights(cfg, lora)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    A = a["h.0.attn.c_attn.lora_A"]
    assert np.abs(A).max() <= 1 / np.sqrt(cfg.n_embd) and np.abs(A).max() > 0.5 / np.sqrt(cfg.n_embd)
    assert not a["h.0.attn.c_attn.lora_B"].any()


def test_get_backend_selector(monkeypatch):
    with pytest.raises(ValueError, match=r"choose one of \('torch', 'jittor'\)"):
        lc.get_backend("tensorflow")
    monkeypatch.setenv("LORA_BACKEND", "torch")
    assert lc.get_backend().NAME == "torch"


def _hf_style_state(cfg, prefix="transformer."):
    w = lc.init_gpt2_weights(cfg, seed=1)
    out = {}
    for k, v in w.items():
        out[prefix + k] = v.T.copy() if k.endswith(lc.models.gpt2.TRANSPOSED) else v
    for i in range(cfg.n_layer):
        out[f"{prefix}h.{i}.attn.bias"] = np.tril(np.ones((cfg.n_positions, cfg.n_positions), np.float32))[None, None]
    return w, out


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_checkpoint_loader_transposes_conv1d_once(tmp_path, prefix):
    from safetensors.numpy import save_file
    cfg = lc.gpt2_config("gpt2", n_layer=1, vocab_size=64, n_positions=32)
    w, state = _hf_style_state(cfg, prefix)
    state["lm_head.weight"] = w["wte.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    got_cfg, got = lc.load_gpt2_checkpoint(tmp_path)
    assert got_cfg == lc.GPT2Config(vocab_size=64, n_positions=32, n_embd=768, n_layer=1, n_head=12)
    assert set(got) == set(w) and all(np.array_equal(got[k], w[k]) for k in w)


def test_checkpoint_errors_list_every_bad_key(tmp_path):
    from safetensors.numpy import save_file
    cfg = lc.gpt2_config("tiny")
    _, state = _hf_style_state(cfg)
    del state["transformer.h.1.ln_2.bias"]
    state["transformer.h.0.mlp.c_fc.weight"] = state["transformer.h.0.mlp.c_fc.weight"][:, :10]
    state["transformer.h.0.attn.q_proj.weight"] = np.zeros(3, np.float32)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        lc.load_gpt2_checkpoint(tmp_path, cfg)
    msg = str(e.value)
    assert "model.safetensors" in msg and "h.1.ln_2.bias" in msg and "h.0.attn.q_proj.weight" in msg
    assert "h.0.mlp.c_fc.weight: file (10, 64) != model (256, 64)" in msg


def test_untied_lm_head_is_refused(tmp_path):
    from safetensors.numpy import save_file
    cfg = lc.gpt2_config("tiny")
    w, state = _hf_style_state(cfg)
    state["lm_head.weight"] = w["wte.weight"] + 1
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tied"):
        lc.load_gpt2_checkpoint(tmp_path, cfg)


@pytest.mark.parametrize("legacy", [False, True])
def test_torch_bin_reader_needs_no_torch_and_matches(tmp_path, legacy):
    torch = pytest.importorskip("torch")
    sd = {"a": torch.randn(3, 4), "b": torch.randn(4, 3).t(), "h": torch.randn(2).half(), "i": torch.arange(4)}
    sd["view"] = sd["a"][1]
    torch.save(sd, tmp_path / "x.bin", _use_new_zipfile_serialization=not legacy)
    got = read_tensors(tmp_path / "x.bin")
    for k, v in sd.items():
        assert got[k].shape == tuple(v.shape) and np.array_equal(got[k], v.numpy()), k


@pytest.mark.parametrize("kind", ["zip", "zip-deflated", "legacy"])
def test_torch_bin_reader_streams_lazy_tensors(tmp_path, kind):
    """``lazy=True``: each tensor a LazyTensor (zip members memory-mapped; a compressed member,
    which torch never writes, or a legacy storage read) equal to the eager reader's, bf16 widened."""
    import mmap
    import zipfile

    from lora_core.formats.tensor_files import LazyTensor

    torch = pytest.importorskip("torch")
    sd = {"a": torch.randn(3, 4), "b": torch.randn(4, 3).t(), "h": torch.randn(2).half(), "i": torch.arange(4),
          "bf": torch.randn(5, 3).bfloat16(), "bft": torch.randn(3, 5).bfloat16().t(), "s": torch.tensor(2.5),
          "e": torch.zeros(0, 2)}
    sd["view"], sd["tied"] = sd["a"][1], sd["a"]
    path = tmp_path / "x.bin"
    torch.save(sd, path, _use_new_zipfile_serialization=kind != "legacy")
    if kind == "zip-deflated":
        with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp_path / "d.bin", "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info))
        path = tmp_path / "d.bin"
    eager, lazy = read_tensors(path), read_tensors(path, lazy=True)
    for k, v in sd.items():
        want = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
        assert isinstance(lazy[k], LazyTensor) and lazy[k].shape == want.shape and lazy[k].dtype == want.dtype, k
        got = np.asarray(lazy[k])
        assert got.dtype == want.dtype and np.array_equal(got, want) and np.array_equal(eager[k], want), k
        assert np.array_equal(np.asarray(lazy[k].T), want.T), k
    base = np.asarray(lazy["a"])  # torch's zip members are stored uncompressed: a view of a map
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    assert isinstance(base, mmap.mmap) == (kind == "zip"), type(base)


def test_model_and_adapter_roundtrip_and_sizes(tmp_path):
    cfg, lora = lc.gpt2_config("tiny"), lc.LoRAConfig(r=4, bias="lora_only")
    base, lw = lc.init_gpt2_weights(cfg), lc.init_lora_weights(cfg, lora, b_std=0.1)
    lc.save_adapter(tmp_path / "ad", cfg, lora, {**base, **lw})
    got_lora, got_cfg, tensors, _ = lc.load_adapter(tmp_path / "ad")
    assert got_lora == lora and got_cfg == cfg
    assert set(tensors) == set(lc.trainable_names(cfg, lora))
    meta = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert meta["lora"]["enable_lora"] == [True, False, True]
    lc.save_model(tmp_path / "full", cfg, {**base, **lw}, lora)
    c2, l2, t2 = lc.load_model(tmp_path / "full")
    assert (c2, l2) == (cfg, lora) and all(np.array_equal(t2[k], {**base, **lw}[k]) for k in t2)
    assert not list((tmp_path / "ad").glob("*.tmp")), "temp files left behind"


def test_adapter_without_base_is_an_error(tmp_path):
    cfg, lora = lc.gpt2_config("tiny"), lc.LoRAConfig(r=4)
    lc.save_adapter(tmp_path / "ad", cfg, lora, lc.init_lora_weights(cfg, lora))
    with pytest.raises(CheckpointError, match="without its base model"):
        lc.formats.checkpoint.resolve_pretrained(None, adapter=tmp_path / "ad")
    with pytest.raises(CheckpointError, match="needs its base model"):
        lc.formats.checkpoint.full_weights(cfg, lora, None)


def test_adapter_on_wrong_base_is_an_error(tmp_path):
    cfg, lora = lc.gpt2_config("tiny"), lc.LoRAConfig(r=4)
    lc.save_adapter(tmp_path / "ad", cfg, lora, lc.init_lora_weights(cfg, lora))
    other = lc.gpt2_config("tiny", n_layer=3)
    lc.save_model(tmp_path / "base", other, lc.init_gpt2_weights(other))
    with pytest.raises(CheckpointError, match="adapter was trained on"):
        lc.formats.checkpoint.resolve_pretrained(tmp_path / "base", adapter=tmp_path / "ad")


def test_adapter_with_missing_tensor_is_refused(tmp_path):
    from safetensors.numpy import save_file
    cfg, lora = lc.gpt2_config("tiny"), lc.LoRAConfig(r=4)
    lc.save_adapter(tmp_path / "ad", cfg, lora, lc.init_lora_weights(cfg, lora))
    t = read_tensors(tmp_path / "ad" / "adapter.safetensors")
    del t["h.1.attn.c_attn.lora_B"]
    save_file(t, str(tmp_path / "ad" / "adapter.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): \['h.1.attn.c_attn.lora_B'\]"):
        lc.load_adapter(tmp_path / "ad")


def test_hf_config_json_gives_architecture_and_paper_dropouts(tmp_path):
    """OpenAI's configs say dropout 0.1; the paper's code trains GPT-2 with them at 0."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 1024, "n_layer": 24,
        "n_head": 16, "layer_norm_epsilon": 1e-5, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "resid_pdrop": 0.1,
        "activation_function": "gelu_new"}))
    assert lc.GPT2Config.from_hf_json(str(tmp_path / "config.json")) == lc.PRESETS["gpt2-medium"]
