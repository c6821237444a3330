"""The train commands' shared options (``examples.run_options``): ``--set`` in both spellings,
the options reaching ``TrainConfig``, and ``examples.cls.train --grad-checkpoint`` (the same
loss log as without, in both backends)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from helpers import cls_train_argv, write_toy_sst2

from examples.cls import train as cls_cli
from examples.run_options import add_run_options, apply_run_options, base_mismatch, doc_summary, output_file, positive
from lora_core.train.recipes import TrainConfig
from lora_core.train.run_dir import read_log


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_run_options(p, set_help="overrides", **kw)
    return p


def test_set_in_one_or_several_groups_and_train_config():
    p = _parser()
    one = p.parse_args(["--set", "lr=1e-3", "eval_every=5", "--max-steps", "7"])
    several = p.parse_args(["--set", "lr=1e-3", "--max-steps", "7", "--set", "eval_every=5"])
    assert one.overrides == several.overrides == ["lr=1e-3", "eval_every=5"]
    assert p.parse_args([]).overrides == []
    cfg = apply_run_options(TrainConfig(), p.parse_args(["--method", "full", "--precision", "bf16", "--zero", "2",
                                                         "--max-steps", "9"]))
    assert (cfg.method, cfg.precision, cfg.zero, cfg.max_steps) == ("full", "bf16", 2, 9)
    assert apply_run_options(TrainConfig(), p.parse_args([])) == TrainConfig()
    with pytest.raises(SystemExit):  # the cls and lm commands: one or the other
        p.parse_args(["--resume", "--resume-from", "x/ckpt-2"])
    both = _parser(exclusive_resume=False).parse_args(["--resume", "--resume-from", "x/ckpt-2"])  # the NLG command
    assert both.resume and str(both.resume_from) == "x/ckpt-2"
    assert not hasattr(p.parse_args([]), "quantize") and not hasattr(_parser(grad_checkpoint=False).parse_args([]),
                                                                     "grad_checkpoint")


@pytest.fixture(scope="module")
def cls_data(tmp_path_factory):
    """A tiny HF DistilBERT masked-LM folder (dropout on) and prepared train/dev splits."""
    import torch
    import transformers

    d = tmp_path_factory.mktemp("cls-gc")
    cfg = transformers.DistilBertConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                                        max_position_embeddings=32, dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    transformers.DistilBertForMaskedLM(cfg).save_pretrained(d / "base")
    write_toy_sst2(d, (("train", 48), ("dev", 8)))
    return d


def test_cls_grad_checkpoint_gives_the_same_loss_log(backend, cls_data, tmp_path, capsys):
    logs = {}
    for gc in ((), ("--grad-checkpoint",)):
        out = tmp_path / f"run{len(gc)}"
        argv = cls_train_argv(cls_data, backend.NAME, out, *gc)
        assert cls_cli.main(argv) == 0, capsys.readouterr().err
        logs[gc] = [(r["step"], r["loss"], r["grad_norm"]) for r in read_log(out / "log.jsonl") if r["kind"] == "train"]
    assert len(logs[()]) == 4 and logs[()] == logs[("--grad-checkpoint",)]


def test_help_descriptions_are_whole_sentences():
    """``--help`` shows the docstring's first paragraph, not its first line cut mid-sentence."""
    doc = """LoRA-train a causal LM (a Llama-family checkpoint, or
    GPT-2) on packed text blocks::

        python -m examples.lm.train ...
    """
    assert doc_summary(doc) == "LoRA-train a causal LM (a Llama-family checkpoint, or GPT-2) on packed text blocks."
    assert doc_summary("One line.\n\nMore.") == "One line."
    for module in ("examples.lm.train", "examples.lm.evaluate", "examples.lm.generate", "examples.nlg.decode"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        described = " ".join(out.stdout.split("\n\n")[1].split())
        assert described.endswith("."), (module, described)


def test_bad_option_values_and_output_folders_are_named(tmp_path):
    for name, value in (("--batch-size", 0), ("--beam", -2)):
        with pytest.raises(ValueError, match=f"{name} must be >= 1, got {value}"):
            positive(name, value)
    positive("--beam", 1)
    with pytest.raises(ValueError, match="--json .*: is a folder; give a file name"):
        output_file("--json", tmp_path)
    output_file("--json", tmp_path / "out.json")


def test_an_adapter_on_another_base_than_it_trained_on_is_warned_of(tmp_path):
    """The base note our train commands write into ``adapter_config.json`` (with the 4-bit
    settings, ``with_quantize_note``) against the options the adapter is loaded with."""
    q = {"quantize": "nf4", "double_quant": True, "compute_dtype": "float32"}
    note = "runs/x/base quantize=nf4 double_quant=True compute_dtype=float32"
    for name, cfg in (("ours", {"lora_core_format": 1, "base": note}), ("peft", {"base_model_name_or_path": note})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(cfg))
        assert base_mismatch(tmp_path / name, q) is None
        w = base_mismatch(tmp_path / name, {})
        assert "trained on a 4-bit base (quantize=nf4 double_quant=True" in w and "loaded on a full-precision base" in w
        assert "double_quant=False" in base_mismatch(tmp_path / name, dict(q, double_quant=False))
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({"lora_core_format": 1, "base": "runs/x/base"}))
    assert base_mismatch(tmp_path / "lora", {}) is None
    assert "trained on a full-precision base; it is loaded on a 4-bit base" in base_mismatch(tmp_path / "lora", q)
    # another tool's adapter records no precision: nothing to compare; no folder, no config: nothing
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "meta-llama/x"}))
    assert base_mismatch(tmp_path / "hub", q) is None and base_mismatch(None, q) is None
    assert base_mismatch(tmp_path / "none", q) is None


def test_a_published_4bit_checkpoint_is_a_4bit_base_with_or_without_the_options(tmp_path):
    """A bitsandbytes 4-bit checkpoint loads 4-bit without ``--quantize``: the base note and the
    comparison take its own settings, so an adapter trained on it warns on its float32 original
    and not on it, given the options or not."""
    from examples.run_options import loaded_quant

    q4 = tmp_path / "q4"
    q4.mkdir()
    (q4 / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": False}}))  # fmt: skip
    want = {"quantize": "nf4", "double_quant": False, "compute_dtype": "float32"}
    assert loaded_quant(q4, {}) == want and loaded_quant(tmp_path / "float", {}) == {}
    assert loaded_quant(None, {}) == {} and loaded_quant(q4, dict(want, compute_dtype="bfloat16"))["compute_dtype"] == "bfloat16"
    note = " ".join([str(q4), *(f"{k}={v}" for k, v in loaded_quant(q4, {}).items())])
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"lora_core_format": 1, "base": note}))
    assert base_mismatch(tmp_path / "adapter", loaded_quant(q4, {})) is None
    assert base_mismatch(tmp_path / "adapter", loaded_quant(q4, want)) is None
    assert "loaded on a full-precision base" in base_mismatch(tmp_path / "adapter", loaded_quant(tmp_path / "float", {}))
