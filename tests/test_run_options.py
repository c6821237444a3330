"""The train commands' shared options (``examples.run_options``): ``--set`` in both spellings,
the options reaching ``TrainConfig``, and ``examples.cls.train --grad-checkpoint`` (the same
loss log as without, in both backends)."""

from __future__ import annotations

import argparse

import pytest
from helpers import cls_train_argv, write_toy_sst2

from examples.cls import train as cls_cli
from examples.run_options import add_run_options, apply_run_options
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
