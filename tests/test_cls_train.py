"""SST-2-style training through the task-agnostic trainer (``ClassificationTask``) and the
``examples.cls.train`` command: both backends train the same (loss curve, predictions) and
learn; kill + ``--resume`` gives the uninterrupted adapter bit for bit; 2 processes (torchrun /
mpirun) match 1; the checkpoint's adapter evaluates to the same predictions; bad input is
refused with file, line or example named."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_close

import lora_core as lc
from lora_core.data.cls_data import DataError
from lora_core.data.nlg import write_jsonl_atomic
from lora_core.formats.checkpoint import read_tensors
from lora_core.train.recipes import CLS_RECIPES, apply_overrides
from lora_core.train.tasks import ClassificationTask
from lora_core.train.trainer import read_log, train

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64


def _sentences(n: int, seed: int) -> list[dict]:
    """Learnable by a frozen random base: label 1 sentences are made of tokens 8-9, label 0
    sentences of 10-11 (plus [CLS] = 1 and [SEP] = 2)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        label = int(rng.integers(0, 2))
        lo = 8 if label else 10
        body = rng.integers(lo, lo + 2, int(rng.integers(2, 10))).tolist()
        out.append({"ids": [1, *body, 2], "label": label})
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny HF DistilBERT masked-LM folder (no classification head, as distilbert-base-uncased)
    and prepared train/dev/test files; dropout everywhere off in ``base0``."""
    import torch
    import transformers

    d = tmp_path_factory.mktemp("cls-train")
    for name, p in (("base", 0.1), ("base0", 0.0)):
        cfg = transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32,
            dropout=p, attention_dropout=p, seq_classif_dropout=p,
        )
        torch.manual_seed(0)
        transformers.DistilBertForMaskedLM(cfg).save_pretrained(d / name)
    write_jsonl_atomic(d / "sst2" / "train.jsonl", _sentences(192, 0))
    write_jsonl_atomic(d / "sst2" / "dev.jsonl", _sentences(64, 1))
    write_jsonl_atomic(d / "sst2" / "test.jsonl", [{"index": i, "ids": r["ids"]} for i, r in enumerate(_sentences(8, 2))])
    return d


RECIPE = apply_overrides(
    CLS_RECIPES["sst2-demo"],
    ["train.batch_size=16", "train.lr=3e-2", "train.epochs=6", "train.save_every=24", "train.log_every=1",
     "train.eval_every=36"],
)


def _fit(name, data, out, recipe=RECIPE):
    bk = lc.get_backend(name)
    model = bk.distilbert_from_pretrained(data / "base", num_labels=2, head_seed=recipe.train.seed)
    bk.inject_lora(model, recipe.lora)
    train_ex = [(r["ids"], r["label"]) for r in _sentences(192, 0)]
    dev_ex = [(r["ids"], r["label"]) for r in _sentences(64, 1)]
    summary = train(bk, model, train_ex, dev_ex, recipe.train, out, progress=False, task=ClassificationTask())
    return summary, model


def test_both_backends_train_the_same_and_learn(data, tmp_path):
    """72 updates (6 epochs of 12), shared dropout masks: the jittor loss curve tracks torch's,
    the adapters agree, both reach the same dev accuracy (> 0.9 on a learnable rule)."""
    (st, _), (sj, _) = _fit("torch", data, tmp_path / "t"), _fit("jittor", data, tmp_path / "j")
    lt = np.array([r["loss"] for r in read_log(tmp_path / "t" / "log.jsonl") if r["kind"] == "train"])
    lj = np.array([r["loss"] for r in read_log(tmp_path / "j" / "log.jsonl") if r["kind"] == "train"])
    assert len(lt) == len(lj) == 72
    assert_close("classification 72 updates: loss jittor vs torch", lj, lt, 1e-4)
    at, aj = read_tensors(tmp_path / "t" / "ckpt-72" / "adapter.safetensors"), read_tensors(
        tmp_path / "j" / "ckpt-72" / "adapter.safetensors"
    )
    assert set(at) == set(aj) and any("lora_A" in k for k in at) and any(k.startswith("classifier.") for k in at)
    for k in at:
        assert_close(f"adapter {k}", aj[k], at[k], 1e-3, floor=1e-6)
    assert st["valid_accuracy"] == sj["valid_accuracy"] > 0.9
    assert lt[-12:].mean() < 0.5 * lt[:12].mean()
    evals = [r for r in read_log(tmp_path / "t" / "log.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [36, 72] and evals[-1]["valid_examples"] == 64


def _cli(backend, data, out, *extra, launcher=()):
    cmd = [*launcher, "-m", "examples.cls.train", "--backend", backend, "--recipe", "sst2-demo",
           "--prepared", str(data / "sst2"), "--out-dir", str(out), "--no-progress", *extra]
    if not launcher:
        cmd = [sys.executable, *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sh = ["sh", "-c", '"$@"; exit $?', "sh", *cmd]  # a child killed by a signal must not upset jittor here
    return subprocess.run(sh, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


SETTINGS = ["--set", "train.batch_size=16", "train.lr=1e-2", "train.save_every=4", "train.log_every=1"]


def test_cli_kill_resume_exact_and_adapter_evaluates(data, tmp_path):
    """The command trains, is SIGKILLed after update 6, resumes to 12 and ends with the
    uninterrupted adapter bit for bit; its checkpoint evaluates (examples.cls.evaluate) to the
    predictions the run wrote."""
    args = ["--base", str(data / "base"), "--max-steps", "12", *SETTINGS]
    full = _cli("torch", data, tmp_path / "full", *args)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "dev_accuracy=" in full.stdout
    killed = _cli("torch", data, tmp_path / "cut", *args, "--stop-after", "6")
    assert killed.returncode != 0
    assert (tmp_path / "cut" / "ckpt-4").is_dir() and not (tmp_path / "cut" / "ckpt-12").exists()
    resumed = _cli("torch", data, tmp_path / "cut", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (read_tensors(tmp_path / r / "ckpt-12" / "adapter.safetensors") for r in ("full", "cut"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    from examples.cls.evaluate import evaluate

    for backend in ("torch", "jittor"):
        m = evaluate(backend, data / "base", tmp_path / "full" / "ckpt-12", data / "sst2", tmp_path / f"ev-{backend}")
        assert m["dev_accuracy"] == json.loads((tmp_path / "full" / "metrics.json").read_text())["dev_accuracy"]
        for split in ("dev", "test"):
            ours = (tmp_path / f"ev-{backend}" / f"{split}_predictions.tsv").read_text()
            assert ours == (tmp_path / "full" / f"{split}_predictions.tsv").read_text()


def _launcher(backend: str) -> list[str]:
    if backend == "torch":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: the jittor tests need Open MPI (apt-get install openmpi-bin libopenmpi-dev)"
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *root, "--oversubscribe", "-x", "OMP_NUM_THREADS", "-np", "2", sys.executable]


def test_two_processes_match_one(backend, data, tmp_path):
    """Data parallel classification (torchrun / mpirun, 2 processes, gradient accumulation,
    uneven shards: micro-batches of 5 = 3 + 2): losses and adapter of one process within 1e-5."""
    args = ["--base", str(data / "base0"), "--max-steps", "8", "--set", "train.batch_size=10", "train.lr=1e-2",
            "train.log_every=1", "train.save_every=4", "train.dropout_masks=framework", "lora.dropout=0",
            "train.last_batch=drop"]
    one = _cli(backend.NAME, data, tmp_path / "one", *args)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _cli(backend.NAME, data, tmp_path / "two", *args, launcher=_launcher(backend.NAME))
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-4000:]
    loss = [[r["loss"] for r in read_log(tmp_path / d / "log.jsonl") if r["kind"] == "train"] for d in ("one", "two")]
    assert len(loss[0]) == 8
    assert_close(f"{backend.NAME} 2 processes vs 1: loss", np.array(loss[1]), np.array(loss[0]), 1e-5)
    a, b = (read_tensors(tmp_path / d / "ckpt-8" / "adapter.safetensors") for d in ("one", "two"))
    for k in a:
        assert_close(f"{backend.NAME} 2 processes vs 1: {k}", b[k], a[k], 1e-5, floor=1e-7)


def test_bad_input_is_named(data, tmp_path):
    bk = lc.get_backend("torch")
    model = bk.distilbert_from_pretrained(data / "base", num_labels=2)
    with pytest.raises(ValueError, match="no injected LoRA"):
        train(bk, model, [([1, 2], 0)], None, RECIPE.train, tmp_path / "a", progress=False, task=ClassificationTask())
    bk.inject_lora(model, RECIPE.lora)
    with pytest.raises(ValueError, match="training example 2: label 2 is not one of 0..1"):
        train(bk, model, [([1, 2], 0), ([1, 3], 2)], None, RECIPE.train, tmp_path / "b", progress=False,
              task=ClassificationTask())
    with pytest.raises(ValueError, match="outside the model's vocabulary of 64"):
        train(bk, model, [([1, 99], 0)], None, RECIPE.train, tmp_path / "c", progress=False, task=ClassificationTask())
    with pytest.raises(ValueError, match="pad_to"):
        cfg = dataclasses.replace(RECIPE.train, pad_to=16)
        train(bk, model, [([1, 2], 0)], None, cfg, tmp_path / "d", progress=False, task=ClassificationTask())
    bad = tmp_path / "prep"
    bad.mkdir()
    shutil.copy(data / "sst2" / "dev.jsonl", bad / "dev.jsonl")
    (bad / "train.jsonl").write_text('{"ids": [1, 5, 2], "label": 1}\n{"ids": [1, 5, 2], "label": 3}\n')
    r = _cli("torch", data, tmp_path / "e", "--base", str(data / "base"), "--max-steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _cli("torch", data, tmp_path / "f", "--base", str(data / "base"), "--max-steps", "2", "--prepared", str(bad))
    assert r.returncode == 1 and f"{bad / 'train.jsonl'}:2: label 3 is not 0 or 1" in r.stderr
    from examples.cls.prepare import read_prepared

    (bad / "x.jsonl").write_text('{"ids": [1, 5, 2], "label": 1}\n{"ids": [1, 5, 2]}\n')
    with pytest.raises(DataError, match="x.jsonl:2: 'label' present on some lines"):
        read_prepared(bad / "x.jsonl")
    (bad / "y.jsonl").write_text('{"ids": [1, 5, 2], "label": 1}\nnot json\n')
    with pytest.raises(DataError, match="y.jsonl:2: not JSON"):
        read_prepared(bad / "y.jsonl")
    (bad / "z.jsonl").write_bytes(b'{"ids": [1, 5, 2], "label": 1}\n{"ids": [1, 5, 2], "label": 0, "x": "\xff"}\n')
    with pytest.raises(DataError, match="z.jsonl:2: not UTF-8 text"):
        read_prepared(bad / "z.jsonl")


def test_bf16_classification_tracks_fp32(data, tmp_path):
    """torch autocast reaches the classification step too: a bf16 run differs from fp32 (so it
    runs in bf16) but tracks its loss curve; jittor refuses 16-bit with its reason."""
    curves = {}
    for p in ("fp32", "bf16"):
        recipe = apply_overrides(RECIPE, ["train.epochs=2", f"train.precision={p}", "train.eval_every=0"])
        _fit("torch", data, tmp_path / p, recipe)
        curves[p] = np.array([r["loss"] for r in read_log(tmp_path / p / "log.jsonl") if r["kind"] == "train"])
    rel = np.abs(curves["bf16"] - curves["fp32"]) / np.abs(curves["fp32"])
    assert 0 < rel.max() < 5e-2, rel.max()
    print(f"classification bf16 vs fp32, 24 updates: max relative loss difference {rel.max():.2e}")
    with pytest.raises(ValueError, match="not supported by the jittor backend"):
        _fit("jittor", data, tmp_path / "j16", apply_overrides(RECIPE, ["train.precision=bf16"]))


def test_cli_device_and_precision(data, tmp_path):
    """``--device`` places the run and changes no result (a resume may change it);
    ``--precision`` reaches the run's configuration and may not change on resume; bad values
    are one error naming the option and the choices."""
    args = ["--base", str(data / "base"), "--max-steps", "4", "--set", "train.batch_size=16", "train.lr=1e-2",
            "train.save_every=2", "train.log_every=1"]
    r = _cli("torch", data, tmp_path / "run", *args, "--device", "cpu", "--precision", "bf16", "--stop-after", "3")
    assert r.returncode != 0 and (tmp_path / "run" / "ckpt-2").is_dir() and not (tmp_path / "run" / "ckpt-4").exists()
    r = _cli("torch", data, tmp_path / "run", *args, "--device", "auto", "--precision", "bf16", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["train"]["precision"] == "bf16", saved
    recs = [x for x in read_log(tmp_path / "run" / "log.jsonl") if x["kind"] == "train"]
    assert [x["step"] for x in recs] == [1, 2, 3, 4] and all("peak_gpu_mb" in x for x in recs)
    r = _cli("torch", data, tmp_path / "run", *args, "--resume")
    assert r.returncode != 0 and "train.precision: saved 'bf16', now 'fp32'" in r.stderr
    r = _cli("torch", data, tmp_path / "x", *args, "--device", "cuda:x")
    assert r.returncode != 0 and "device='cuda:x' is not a device; choose one of auto, cpu, cuda, cuda:N" in r.stderr
    r = _cli("torch", data, tmp_path / "y", *args, "--precision", "fp8")
    assert r.returncode == 2 and "invalid choice: 'fp8'" in r.stderr
    r = _cli("jittor", data, tmp_path / "z", *args, "--precision", "fp16")
    assert r.returncode != 0 and "not supported by the jittor backend" in r.stderr
    assert not (tmp_path / "z" / "latest").exists()


@pytest.mark.gpu
def test_cuda_classification_tracks_the_cpu(data, tmp_path):
    """On a GPU (torch): DistilBERT LoRA classification, 24 updates with the numpy dropout masks
    shared, tracks the CPU run: fp32 loss curve within 1e-3 relative and the same dev accuracy,
    bf16 autocast within 5e-2; the peak GPU memory is logged."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    bk = lc.get_backend("torch")
    runs = {}
    for device, precision in (("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16")):
        recipe = apply_overrides(RECIPE, ["train.epochs=2", "train.eval_every=0", f"train.precision={precision}"])
        model = bk.distilbert_from_pretrained(data / "base", num_labels=2, head_seed=recipe.train.seed)
        bk.inject_lora(model, recipe.lora)
        bk.to_device(model, device)
        out = tmp_path / f"{device}-{precision}"
        summary = train(bk, model, [(r["ids"], r["label"]) for r in _sentences(192, 0)],
                        [(r["ids"], r["label"]) for r in _sentences(64, 1)], recipe.train, out, progress=False,
                        task=ClassificationTask())
        recs = [r for r in read_log(out / "log.jsonl") if r["kind"] == "train"]
        runs[device, precision] = summary, np.array([r["loss"] for r in recs]), recs[-1]["peak_gpu_mb"]
    (s_cpu, l_cpu, _), (s_gpu, l_gpu, peak), (_, l_bf16, _) = runs.values()
    assert len(l_gpu) == len(l_cpu) == 24 and peak > 0
    assert_close("classification on CUDA vs CPU: 24-update loss curve", l_gpu, l_cpu, 1e-3)
    assert s_gpu["valid_accuracy"] == s_cpu["valid_accuracy"]
    rel = np.abs(l_bf16 - l_gpu) / np.abs(l_gpu)
    assert 0 < rel.max() < 5e-2, rel.max()
