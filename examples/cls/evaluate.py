"""Accuracy on SST-2 dev and predictions on test of a DistilBERT classifier + adapter, in
either backend. The adapter is ours or peft's (``adapter_config.json``: e.g. one trained with
``transformers`` + ``peft`` on ``distilbert-base-uncased``); the base is a HF DistilBERT folder::

    python -m examples.cls.evaluate --backend jittor --base distilbert-sst2-base/ \\
        --adapter peft_adapter/ --prepared out/sst2 --out out/sst2/eval_jittor
    python -m examples.cls.evaluate ... --adapter runs/sst2/ckpt-N --quantize nf4   # a QLoRA adapter

writes ``OUT/dev_predictions.tsv`` and ``OUT/test_predictions.tsv`` (GLUE's ``index\\tprediction``)
and ``OUT/metrics.json`` (dev accuracy).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import lora_core as lc
from lora_core.data import cls_data
from lora_core.data.nlg import check_data_file, write_text_atomic
from lora_core.formats.checkpoint import write_json_atomic
from lora_core.train.run_dir import check_out_dir
from lora_core.train.tasks import check_token_ids

from ..run_options import add_quantize_options, check_quantize, doc_summary, quantize_kwargs, resolve_base_adapter
from .prepare import read_prepared


def predict(backend, model, ids: list[list[int]], batch_size: int = 64) -> np.ndarray:
    """Labels of every sentence; batches in length order (little padding), results in input order."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = np.zeros(len(ids), dtype=np.int64)
    for s in range(0, len(order), batch_size):
        chunk = order[s : s + batch_size]
        out[chunk] = backend.cls_predict(model, cls_data.collate([ids[i] for i in chunk]))
    return out


def evaluate(backend_name: str, base: Path, adapter: Path | None, prepared: Path, out: Path,
             quant: dict | None = None) -> dict:
    """``write_predictions`` of ``base`` + ``adapter``; ``quant``: ``distilbert_from_pretrained``'s
    4-bit arguments (``quantize="nf4"``, ...: the base a QLoRA adapter was trained on)."""
    bk = lc.get_backend(backend_name)
    if not any((prepared / f"{split}.jsonl").exists() for split in ("dev", "test")):
        raise ValueError(f"--prepared {prepared}: holds neither dev.jsonl nor test.jsonl (an examples.cls.prepare folder)")
    base, adapter = resolve_base_adapter(base, adapter, quant or {})
    model = bk.distilbert_from_pretrained(base, adapter=adapter, **(quant or {}))
    metrics = {"backend": backend_name, "base": str(base), "adapter": str(adapter) if adapter else None}
    return write_predictions(bk, model, prepared, out, metrics)


def read_splits(prepared: Path, model_config) -> dict:
    """The ``dev`` and ``test`` splits found in ``prepared`` (``read_prepared``'s ``(ids, labels,
    indices)`` by path), every one checked against the model (lengths within its positions, ids
    in its vocabulary; ``tasks.check_token_ids``) before anything is predicted or written. A split
    that is there but not a readable file (a folder, an empty file), or a dev split without
    labels (no accuracy to give), is refused naming it."""
    out = {}
    for split in ("dev", "test"):
        path = prepared / f"{split}.jsonl"
        if not path.exists():
            continue
        out[path] = read_prepared(check_data_file(path), with_index=True)
        if split == "dev" and out[path][1] is None:
            raise cls_data.DataError(f"{path}: no labels (the dev split must be labelled)")
        check_token_ids(out[path][0], model_config, f"{path} line")
    return out


def write_predictions(bk, model, prepared: Path, out: Path, metrics: dict, splits: dict | None = None) -> dict:
    """Predict the ``dev`` and ``test`` splits found in ``prepared`` (``splits``: ``read_splits``'
    result when read already) into ``OUT/{split}_predictions.tsv``; ``metrics`` plus the dev
    accuracy go to ``OUT/metrics.json``. A ``{split}_predictions.tsv`` an earlier run left in
    ``out`` for a split this folder does not hold is removed (named on stderr): the folder then
    holds this run's predictions only, matching its ``metrics.json``."""
    metrics = dict(metrics)
    splits = splits or read_splits(prepared, model.config)
    for split in ("dev", "test"):
        old = out / f"{split}_predictions.tsv"
        if prepared / f"{split}.jsonl" not in splits and old.is_file():
            old.unlink()
            print(f"removed {old}: an earlier run's predictions ({prepared} holds no {split}.jsonl)", file=sys.stderr)
    for path, (ids, labels, indices) in splits.items():
        split = path.stem
        pred = predict(bk, model, ids)
        rows = "".join(f"{i}\t{p}\n" for i, p in zip(indices or range(len(pred)), pred))  # test: GLUE's indices
        write_text_atomic(out / f"{split}_predictions.tsv", "index\tprediction\n" + rows)
        if labels is not None:
            metrics[f"{split}_accuracy"] = cls_data.accuracy(pred, labels)
            metrics[f"{split}_n"] = len(labels)
    write_json_atomic(out / "metrics.json", metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.cls.evaluate", description=doc_summary(__doc__))
    ap.add_argument("--backend", choices=lc.BACKENDS, default="torch")
    ap.add_argument("--base", type=Path, required=True, help="HF DistilBERT folder (config.json + weights)")
    ap.add_argument("--adapter", type=Path, help="adapter folder (ours or peft's), or a run folder of examples.cls.train")
    ap.add_argument("--prepared", type=Path, required=True, help="output folder of examples.cls.prepare")
    ap.add_argument("--out", type=Path, required=True)
    add_quantize_options(ap)
    args = ap.parse_args(argv)
    try:
        check_quantize(args)
        check_out_dir(args.out, resume=True, option="--out")  # before any work; resume: no run here, old files may stay
        metrics = evaluate(args.backend, args.base, args.adapter, args.prepared, args.out, quantize_kwargs(args))
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError; a missing file an OSError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print({k: v for k, v in metrics.items() if k.endswith(("accuracy", "_n"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
