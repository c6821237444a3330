"""LoRA-tune (or, ``--method full``, fully fine-tune) a DistilBERT classifier on SST-2 with a
named recipe, in either backend.

Reads the output of ``examples.cls.prepare`` (``train.jsonl``, ``dev.jsonl``, optionally
``test.jsonl``) and a HF DistilBERT folder (``config.json`` + ``model.safetensors`` or
``pytorch_model.bin``; a masked-LM checkpoint such as ``distilbert-base-uncased`` gets a
seeded classification head), injects LoRA as the recipe says, and trains with
``lora_core.train.trainer`` (``ClassificationTask``): the run folder of the NLG trainer (log.jsonl,
``ckpt-N/``, ``latest``, ``--resume``), then dev accuracy, ``OUT/dev_predictions.tsv``,
``OUT/test_predictions.tsv`` (GLUE's ``index\\tprediction``) and ``OUT/metrics.json``::

    python -m examples.cls.train --backend torch --recipe sst2-distilbert \\
        --prepared out/sst2 --base pretrained/distilbert-base-uncased --out-dir runs/sst2-torch
    python -m examples.cls.train ... --out-dir runs/sst2-torch --resume        # after a kill
    python -m examples.cls.train ... --set train.lr=5e-4 lora.r=8                # overrides
    python -m examples.cls.train ... --method full    # every weight; ckpt-N/ is a transformers checkpoint
    python -m examples.cls.train ... --device cuda --precision bf16             # on a GPU
    python -m examples.cls.train ... --grad-checkpoint    # recompute each layer in the backward pass
    python -m examples.cls.train ... --quantize nf4      # QLoRA: the recipe's LoRA on a 4-bit NF4 base
    torchrun --nproc_per_node 2 -m examples.cls.train --backend torch ...      # data parallel
    mpirun -np 2 python -m examples.cls.train --backend jittor ...
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import lora_core
from lora_core.data.nlg import check_data_file
from lora_core.train.distributed import run_job
from lora_core.train.full_ft import check_full_ft_input
from lora_core.train.recipes import CLS_RECIPES, apply_overrides
from lora_core.train.run_dir import check_out_dir
from lora_core.train.tasks import ClassificationTask
from lora_core.train.trainer import train

from ..run_options import add_run_options, apply_run_options, base_note, doc_summary, quantize_kwargs
from .evaluate import read_splits, write_predictions
from .prepare import read_prepared


def read_split(prepared: Path, split: str) -> list[tuple[list[int], int]]:
    """``(ids, label)`` examples of a labelled prepared split (a missing, empty or blank file is
    refused naming it)."""
    if prepared.exists() and not prepared.is_dir():
        raise ValueError(f"--prepared {prepared}: a file, not a folder (the output folder of examples.cls.prepare)")
    path = check_data_file(prepared / f"{split}.jsonl", hint="run examples.cls.prepare first")
    ids, labels = read_prepared(path)
    if labels is None:
        raise ValueError(f"{path}: no labels (the {split} split must be labelled)")
    return list(zip(ids, labels))


def build(backend, base: Path, recipe, quantize: dict | None = None):
    """The DistilBERT classifier of ``base`` with the recipe's LoRA injected (``method="lora"``;
    a base without a classification head gets one drawn from the recipe's seed); ``quantize``:
    ``distilbert_from_pretrained``'s 4-bit arguments (a QLoRA base: the encoder's linear layers
    NF4, the head float32; ``lora_core.quant.distilbert4bit``)."""
    model = backend.distilbert_from_pretrained(base, num_labels=2, head_seed=recipe.train.seed, **(quantize or {}))
    if recipe.train.method == "lora":
        backend.inject_lora(model, recipe.lora)
    return model


def run(
    backend_name: str,
    recipe,
    prepared: Path,
    base: Path,
    out_dir: Path,
    resume: bool = False,
    resume_from: Path | None = None,
    progress: bool = True,
    comm=None,
    kill_after: int | None = None,
    device: str = "cpu",
    grad_checkpoint: bool = False,
    quantize: dict | None = None,
) -> dict:
    """Train, then predict dev and test; returns the trainer's summary and the metrics.
    ``device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; ``grad_checkpoint``: recompute each
    encoder layer in the backward pass (neither changes a result: not part of the run's
    configuration, so a resume may change them). ``quantize``: a 4-bit base (``build``), its
    settings recorded in the run's base note (a resume with others is refused). Bad input
    (the run folder, the prepared splits) is refused before the model is loaded."""
    check_out_dir(out_dir, resume=resume or resume_from is not None)
    train_ex, dev_ex = read_split(prepared, "train"), read_split(prepared, "dev")
    backend = lora_core.get_backend(backend_name)
    model = build(backend, base, recipe, quantize)
    splits = read_splits(prepared, model.config)  # the splits predicted after training fit the model: checked first
    backend.to_device(model, device)
    backend.set_grad_checkpoint(model, grad_checkpoint)
    summary = train(
        backend,
        model,
        train_ex,
        dev_ex,
        recipe.train,
        out_dir,
        resume=resume,
        resume_from=resume_from,
        progress=progress,
        base_note=base_note(str(base), base, quantize or {}),
        kill_after=kill_after,
        comm=comm,
        task=ClassificationTask(),
    )
    if comm is None or comm.world.is_main:
        if comm is not None and comm.world.parallel and recipe.train.zero:  # the model is sharded: reload it whole
            ckpt, full = Path(summary["checkpoint"]), recipe.train.method == "full"
            model = backend.distilbert_from_pretrained(ckpt if full else base, adapter=None if full else ckpt,
                                                       **(quantize or {}))
            backend.to_device(model, device)
        meta = {"backend": backend_name, "recipe": recipe.name, "base": str(base), "adapter": summary["checkpoint"]}
        summary["metrics"] = write_predictions(backend, model, prepared, Path(out_dir), meta, splits)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.cls.train", description=doc_summary(__doc__))
    p.add_argument("--backend", choices=lora_core.BACKENDS, default=None, help="default: $LORA_BACKEND or torch")
    p.add_argument("--recipe", default="sst2-distilbert", choices=sorted(CLS_RECIPES))
    p.add_argument("--prepared", required=True, type=Path, help="output folder of examples.cls.prepare")
    p.add_argument("--base", required=True, type=Path, help="HF DistilBERT folder (config.json + weights)")
    p.add_argument("--out-dir", required=True, type=Path)
    add_run_options(p, set_help="recipe overrides: train.FIELD=... (TrainConfig), lora.FIELD=... (LoRATargetConfig)",
                    quantize=True)
    args = p.parse_args(argv)

    def body(job) -> str:
        recipe = apply_overrides(CLS_RECIPES[args.recipe], args.overrides)
        recipe = dataclasses.replace(recipe, train=apply_run_options(recipe.train, args))
        if recipe.train.method == "full":
            check_full_ft_input("--base", args.base, args.overrides)
        backend = lora_core.get_backend(args.backend)
        backend.check_zero(recipe.train.zero)  # a stage the backend cannot run: refused before the model loads
        comm = job.start(backend, args.dist_timeout)
        summary = run(
            backend.NAME,
            recipe,
            args.prepared,
            args.base,
            args.out_dir,
            resume=args.resume,
            resume_from=args.resume_from,
            progress=not args.no_progress,
            comm=comm,
            kill_after=args.stop_after,
            device=args.device,
            grad_checkpoint=args.grad_checkpoint,
            quantize=quantize_kwargs(args),
        )
        metrics = summary.pop("metrics", {})
        summary.update({k: v for k, v in metrics.items() if k.endswith(("_accuracy", "_n"))})
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())

    return run_job(body)


if __name__ == "__main__":
    sys.exit(main())
