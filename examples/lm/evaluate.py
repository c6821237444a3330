"""Perplexity of a causal LM (base + optional adapter) on held-out blocks of
``examples.lm.prepare``, in either backend::

    python -m examples.lm.evaluate --backend torch --base Llama-3.2-3B/ \\
        --adapter runs/wt2-llama/latest --prepared out/wikitext2-llama
    python -m examples.lm.evaluate --base runs/lm-demo/base --prepared out/lm-demo   # no adapter
    python -m examples.lm.evaluate ... --adapter runs/qlora --quantize nf4   # on the 4-bit base it trained on

``--adapter`` takes a checkpoint folder of ``examples.lm.train`` (``OUT/ckpt-N`` or
``OUT/latest``) or a peft adapter folder; an adapter trained with ``--quantize`` is evaluated
on the same 4-bit base with the same ``--quantize`` options. Prints (and with ``--json`` writes) the mean NLL per
predicted token, the perplexity and the token count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lora_core
from lora_core.data.nlg import write_text_atomic
from lora_core.data.text import read_prepared
from lora_core.train.tasks import LMTask

from ..run_options import (
    add_quantize_options,
    check_quantize,
    doc_summary,
    output_file,
    positive,
    quantize_kwargs,
    resolve_base_adapter,
)
from .train import check_fits


def evaluate(backend_name: str | None, base: Path, adapter: Path | None, prepared: Path, split: str = "valid",
             batch_size: int = 4, device: str = "auto", quant: dict | None = None) -> dict:
    """``{"nll", "ppl", "tokens"}`` of ``split`` (``valid`` or ``train``); ``quant``: the
    backends' ``from_pretrained`` arguments of a 4-bit base (``quantize="nf4"``, ...)."""
    backend = lora_core.get_backend(backend_name)
    train_blocks, valid_blocks, meta = read_prepared(prepared)
    base, adapter = resolve_base_adapter(base, adapter, quant or {})
    model = backend.from_pretrained(base, adapter=adapter, **(quant or {}))
    blocks = valid_blocks if split == "valid" else train_blocks
    check_fits(model, meta, blocks, prepared)
    backend.to_device(model, device)
    task = LMTask()
    out = task.evaluate(backend, model, task.examples(blocks), batch_size)
    return {"nll": out["valid_nll"], "ppl": out["valid_ppl"], "tokens": out["valid_tokens"], "split": split,
            "base": str(base), "adapter": None if adapter is None else str(adapter), "backend": backend.NAME}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.lm.evaluate", description=doc_summary(__doc__))
    p.add_argument("--backend", choices=lora_core.BACKENDS, default=None, help="default: $LORA_BACKEND or torch")
    p.add_argument("--base", required=True, type=Path,
                   help="the base checkpoint folder (or the run folder of a --method full run: its latest checkpoint)")
    p.add_argument("--adapter", type=Path, help="a checkpoint of examples.lm.train, its run folder, or a peft adapter")
    p.add_argument("--prepared", required=True, type=Path, help="output folder of examples.lm.prepare")
    p.add_argument("--split", choices=("valid", "train"), default="valid")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", type=Path, help="also write the result here")
    add_quantize_options(p)
    args = p.parse_args(argv)
    try:
        check_quantize(args)
        positive("--batch-size", args.batch_size)
        output_file("--json", args.json)
        res = evaluate(args.backend, args.base, args.adapter, args.prepared, args.split, args.batch_size, args.device,
                       quantize_kwargs(args))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        write_text_atomic(args.json, json.dumps(res, indent=1) + "\n")
    print(f"{res['split']}: nll {res['nll']:.4f} per token, perplexity {res['ppl']:.3f} over {res['tokens']} tokens")
    return 0



if __name__ == "__main__":
    sys.exit(main())
