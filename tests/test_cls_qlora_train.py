"""``examples.cls.train --quantize nf4``: the SST-2 recipe's LoRA (q_lin, v_lin, the head trained
fully) on a 4-bit DistilBERT base quantized while loading, in both backends: 4 updates of the
parity-mode demo recipe give the same loss curve within 1e-5 (and not the float32 base's);
the base note records the 4-bit settings; ``examples.cls.evaluate --quantize nf4`` on the
checkpoint gives the trainer's dev predictions; ``--quantize`` with ``--method full``, and a
resume with other 4-bit settings, are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_close, cls_train_argv, write_toy_sst2

from examples.cls import evaluate as cls_eval
from examples.cls import train as cls_cli
from lora_core.formats.hf_checkpoint import write_hf_checkpoint
from lora_core.models.distilbert import HEAD_KEYS, DistilBertConfig, init_weights
from lora_core.train.full_ft import hf_config
from lora_core.train.run_dir import read_log

_RUNS: dict = {}


@pytest.fixture(scope="module")
def cls_data(tmp_path_factory):
    """A tiny random DistilBERT encoder folder in transformers' form (widths multiples of 64; no
    head: the recipe's seed draws one) and prepared train/dev splits."""
    d = tmp_path_factory.mktemp("cls-qlora")
    cfg = DistilBertConfig(vocab_size=64, max_position_embeddings=32, dim=64, n_layers=2, n_heads=2, hidden_dim=128)
    w = {k: v for k, v in init_weights(cfg, seed=0).items() if k not in HEAD_KEYS}
    write_hf_checkpoint(d / "base", hf_config(cfg), w)
    write_toy_sst2(d, (("train", 32), ("dev", 8)))
    return d


_argv = cls_train_argv


def _run(cls_data, backend: str, *extra) -> np.ndarray:
    key = (backend, extra)
    if key not in _RUNS:
        out = cls_data / f"run-{backend}-{len(_RUNS)}"
        assert cls_cli.main(_argv(cls_data, backend, out, *extra)) == 0
        losses = np.array([r["loss"] for r in read_log(out / "log.jsonl") if r["kind"] == "train"])
        _RUNS[key] = out, losses
    return _RUNS[key]


def test_cls_qlora_curve_matches_torch(backend, cls_data):
    out, q = _run(cls_data, backend.NAME, "--quantize", "nf4")
    assert len(q) == 4
    base = json.loads((out / "train_config.json").read_text())["base"]
    assert base.endswith("quantize=nf4 double_quant=True compute_dtype=float32"), base
    assert_close(f"cls-train QLoRA loss curve, {backend.NAME} vs torch", q,
                 _run(cls_data, "torch", "--quantize", "nf4")[1], 1e-5)
    if backend.NAME == "torch":  # the 4-bit base is not the float32 one
        assert not np.allclose(q, _run(cls_data, "torch")[1], rtol=1e-6, atol=0)
    # examples.cls.evaluate --quantize nf4 on the checkpoint: the trainer's dev predictions
    ev = out.parent / f"eval-{backend.NAME}"
    assert cls_eval.main(["--backend", backend.NAME, "--base", str(cls_data / "base"), "--adapter",
                          str(out / "ckpt-4"), "--prepared", str(cls_data / "sst2"), "--out", str(ev),
                          "--quantize", "nf4"]) == 0
    assert (ev / "dev_predictions.tsv").read_text() == (out / "dev_predictions.tsv").read_text()


def test_cls_quantize_refusals(cls_data, tmp_path, capsys):
    capsys.readouterr()
    assert cls_cli.main(_argv(cls_data, "torch", tmp_path / "o", "--quantize", "nf4", "--method", "full")) == 1
    err = capsys.readouterr().err
    assert err == ("error: --quantize nf4 with method full: a 4-bit base is frozen, QLoRA trains a LoRA adapter on it "
                   "(use --method lora, or leave out --quantize)\n"), err
    assert not (tmp_path / "o").exists()
    # a resume with other 4-bit settings: the run's base note differs
    out, _ = _run(cls_data, "torch", "--quantize", "nf4")
    assert cls_cli.main(_argv(cls_data, "torch", out, "--quantize", "nf4", "--no-double-quant", "--resume")) == 1
    err = capsys.readouterr().err
    assert "cannot resume" in err and "double_quant=True" in err and "double_quant=False" in err, err
