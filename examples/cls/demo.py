"""The SST-2 demo: DistilBERT + LoRA in PyTorch and Jittor on GLUE SST-2, on a CPU, in minutes.

    bash scripts/lora.sh demo-cls            # = python -m examples.cls.demo --data-dir ../shared/data

1. Data: GLUE SST-2 and BERT's uncased vocabulary from ``--data-dir`` (``sst2/``,
   ``distilbert-vocab/``: ``../shared/data`` here, ``examples/cls/download.sh`` elsewhere),
   WordPiece-encoded (``examples.cls.prepare``).
2. A small DistilBERT base, made here (no pretrained weights can be downloaded): masked-LM
   pre-training on the SST-2 training sentences (``examples.cls.pretrain``, torch, seeded),
   saved as a HF folder, the format of ``distilbert-base-uncased``.
3. In each backend, from that base: LoRA (r=4, alpha 8 on ``q_lin``/``v_lin``, the classifier
   trained fully) with the ``sst2-demo`` recipe (one epoch) on the training sentences (all, or
   the first ``--train-examples``), through the shared trainer, both backends drawing the same dropout masks.
4. Dev accuracy in both, predictions compared (dev and the unlabelled test set), loss curves
   compared and plotted, speed per update: ``OUT/report.md``, ``OUT/report.json``,
   ``OUT/loss_curves.png``.

Threads are pinned (``--threads``, default 1) so that the figures do not depend on the machine's
core count (see ``examples.nlg.demo.pin_threads``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from lora_core.data.nlg import write_jsonl_atomic, write_text_atomic
from lora_core.formats.checkpoint import read_tensors
from lora_core.train.recipes import CLS_RECIPES
from lora_core.train.trainer import read_log

from ..nlg.demo import pin_threads
from ..run_options import doc_summary


def prepare_demo_data(data_dir: Path, out: Path, n_train: int | None) -> Path:
    """Encode SST-2 into ``OUT/sst2`` and write ``OUT/sst2-demo`` (the first ``n_train``
    training sentences, all when None, all of dev and test); returns the latter."""
    from .prepare import prepare, read_prepared

    need = [data_dir / "sst2" / f"{s}.tsv" for s in ("train", "dev", "test")] + [data_dir / "distilbert-vocab" / "vocab.txt"]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"SST-2 data missing: {missing} (bash examples/cls/download.sh --data-dir DIR)")
    summary = prepare(data_dir / "sst2", data_dir / "distilbert-vocab" / "vocab.txt", out / "sst2")
    for split, s in summary.items():
        print(f"[demo] {split}: {s['n']} sentences, longest {s['max_tokens']} tokens, {s['cut']} cut")
    demo = out / "sst2-demo"
    ids, labels = read_prepared(out / "sst2" / "train.jsonl")
    write_jsonl_atomic(demo / "train.jsonl", [{"ids": i, "label": lab} for i, lab in zip(ids[:n_train], labels)])
    for split in ("dev", "test"):
        text = (out / "sst2" / f"{split}.jsonl").read_text(encoding="utf-8")
        write_text_atomic(demo / f"{split}.jsonl", text)
    return demo


def run_backend(name: str, recipe, prepared: Path, base: Path, out: Path) -> dict:
    """LoRA training + dev/test predictions in one backend; timings split first use from steady state."""
    from .train import run

    t0 = time.time()
    summary = run(name, recipe, prepared, base, out / name, progress=True)
    wall = time.time() - t0
    step_ms = [r["ms_per_batch"] for r in read_log(out / name / "log.jsonl") if r["kind"] == "train"]
    return {"summary": summary, "train_s": wall, "first_log_ms": step_ms[0],
            "step_ms": float(np.median(step_ms[1:] or step_ms))}


def _predictions(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()[1:]


def report(out: Path, runs: dict, pretrain: dict) -> dict:
    """Accuracy per backend, identical predictions, loss and adapter differences (first backend
    is the reference), speed."""
    names = list(runs)
    rep = {"backends": names, "pretrain": pretrain,
           "dev_accuracy": {n: runs[n]["summary"]["metrics"]["dev_accuracy"] for n in names},
           "train_s": {n: round(runs[n]["train_s"], 2) for n in names},
           "train_step_ms": {n: round(runs[n]["step_ms"], 2) for n in names}}  # fmt: skip
    if len(names) == 2:
        a, b = names
        for split in ("dev", "test"):
            pa, pb = _predictions(out / a / f"{split}_predictions.tsv"), _predictions(out / b / f"{split}_predictions.tsv")
            rep[f"identical_{split}_predictions"] = f"{sum(x == y for x, y in zip(pa, pb))}/{len(pa)}"
        la, lb = ({r["step"]: r["loss"] for r in read_log(out / n / "log.jsonl") if r["kind"] == "train"} for n in names)
        steps = sorted(set(la) & set(lb))
        rep["steps_compared"] = len(steps)
        rep["max_rel_loss_diff"] = max(abs(la[s] - lb[s]) / abs(la[s]) for s in steps)
        ta, tb = (read_tensors(Path(runs[n]["summary"]["checkpoint"]) / "adapter.safetensors") for n in names)
        rep["max_adapter_diff"] = max(float(np.abs(ta[k] - tb[k]).max() / max(np.abs(ta[k]).max(), 1e-12)) for k in ta)
        rep["speed_ratio_train"] = runs[a]["step_ms"] / runs[b]["step_ms"]
    write_text_atomic(out / "report.json", json.dumps(rep, indent=2) + "\n")
    write_text_atomic(out / "report.md", _markdown(rep))
    return rep


def _markdown(rep: dict) -> str:
    names = rep["backends"]
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names),
             "| dev accuracy (872) | " + " | ".join(f"{rep['dev_accuracy'][n]:.4f}" for n in names) + " |",
             "| train ms/update, steady state (median) | " + " | ".join(f"{rep['train_step_ms'][n]:.1f}" for n in names) + " |",
             "| train seconds, wall (first use, evaluation, checkpoints included) | "
             + " | ".join(f"{rep['train_s'][n]:.1f}" for n in names) + " |"]  # fmt: skip
    p = rep["pretrain"]
    lines += ["", f"- base: masked-LM pre-training, {p['steps']} steps, {p['seconds']:.0f} s (torch)"]
    if len(names) == 2:
        lines += [f"- identical predictions: dev {rep['identical_dev_predictions']}, "
                  f"test {rep['identical_test_predictions']}",
                  f"- training loss, {rep['steps_compared']} logged steps: max relative difference "
                  f"{rep['max_rel_loss_diff']:.2e}; adapter max|diff|/scale {rep['max_adapter_diff']:.2e}",
                  f"- {names[1]} speed per update: {rep['speed_ratio_train']:.2f}x {names[0]} (steady state; jittor "
                  "compiles its kernels on first use, in the wall time only)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.cls.demo", description=doc_summary(__doc__))
    p.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parents[3] / "shared" / "data",
                   help="folder with sst2/ and distilbert-vocab/ (default ../shared/data)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/cls-demo"))
    p.add_argument("--backends", default="torch,jittor")
    p.add_argument("--pretrain-steps", type=int, default=None, help="masked-LM steps (default: pretrain's)")
    p.add_argument("--train-examples", type=int, default=None,
                   help="LoRA on the first N SST-2 training sentences (default: all 67,349)")
    p.add_argument("--threads", type=int, default=1, help="threads for torch and jittor (the figures depend on it)")
    a = p.parse_args(argv)
    if a.threads < 1 or (a.train_examples is not None and a.train_examples < 64):
        p.error("--threads must be >= 1 and --train-examples >= 64")
    pin_threads(a.threads)
    from .pretrain import DEFAULTS, pretrain_mlm, read_train_ids

    t_start = time.time()
    try:
        prepared = prepare_demo_data(a.data_dir, a.out, a.train_examples)
        steps = a.pretrain_steps or DEFAULTS["steps"]
        t0 = time.time()
        warmup = DEFAULTS["warmup"] * steps // DEFAULTS["steps"]  # the same share of the run
        base = pretrain_mlm(read_train_ids(a.out / "sst2" / "train.jsonl"), a.out / "base", steps=steps,
                            warmup=warmup, seed=0, overwrite=True)  # fmt: skip
        pretrain = {"steps": steps, "seconds": time.time() - t0}
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    recipe = CLS_RECIPES["sst2-demo"]
    runs = {}
    for name in a.backends.split(","):
        shutil.rmtree(a.out / name, ignore_errors=True)  # the demo's own run folder from an earlier call
        runs[name] = run_backend(name, recipe, prepared, Path(base), a.out)
    rep = report(a.out, runs, pretrain)
    from ..nlg.plot import plot

    plot([a.out / n / "log.jsonl" for n in runs], list(runs), a.out / "loss_curves.png",
         title="DistilBERT + LoRA on SST-2: torch vs jittor")  # fmt: skip
    print((a.out / "report.md").read_text())
    print(f"demo finished in {time.time() - t_start:.0f} s; outputs in {a.out}/")
    return 0 if rep else 1


if __name__ == "__main__":
    sys.exit(main())
