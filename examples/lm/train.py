"""LoRA-train (or, ``--method full``, fully fine-tune) a causal LM (a Llama-family checkpoint, or
GPT-2) on packed text blocks, in either backend.

Reads the output of ``examples.lm.prepare`` (``train.jsonl``, ``valid.jsonl``, ``meta.json``),
loads the base (``--init-checkpoint``: a transformers checkpoint folder, any layout; or
``--random-init PRESET`` of ``lora_core.models.llama`` / GPT-2 with ``--save-base``), injects
the recipe's LoRA (peft semantics, ``lora_core.train.recipes.LM_RECIPES``) and trains with
``lora_core.train.trainer``: the run folder of the other train commands (``log.jsonl``,
``ckpt-N/`` adapters in our format, ``latest``, ``--resume``), validation NLL and perplexity::

    python -m examples.lm.train --backend torch --recipe wikitext2-llama \\
        --prepared out/wikitext2-llama --init-checkpoint Llama-3.2-3B/ --out-dir runs/wt2-llama
    python -m examples.lm.train ... --out-dir runs/wt2-llama --resume             # after a kill
    python -m examples.lm.train ... --set train.lr=1e-4 lora.r=16 lora.target_modules=q_proj,v_proj
    python -m examples.lm.train ... --method full   # every weight; ckpt-N/ is a transformers checkpoint
    python -m examples.lm.train ... --quantize nf4  # QLoRA: the recipe's LoRA on a 4-bit NF4 base
    python -m examples.lm.train --recipe lm-demo --prepared out/lm-demo --random-init tiny-llama \\
        --vocab-size 512 --save-base --out-dir runs/lm-demo
    torchrun --nproc_per_node 2 -m examples.lm.train --backend torch ...     # data parallel
    mpirun -np 2 python -m examples.lm.train --backend jittor ...

On the torch backend a Llama-family run re-executes itself under tcmalloc where it is installed
(``lora_core.train.allocator``; ``LORA_ALLOCATOR=glibc`` keeps glibc's malloc): the same numbers,
a lower peak and, with activation checkpointing or a 4-bit base, a faster step.

``--quantize nf4`` (``--no-double-quant``, ``--compute-dtype``; ``examples.run_options``) loads the
base with its projections stored as NF4 (a ``--random-init`` base is written to ``OUT/base`` and
quantized as it loads from there); ``examples.lm.evaluate`` and ``examples.lm.generate`` take the
same options for its adapter. Refused with ``--method full``; a resume must keep them.

Refused before any training: another model's tokenizer (``meta.json``: more tokens than the
model's vocabulary, fewer than 90% of its rows, or an end-of-text id its config does not name),
a prepared folder whose files are not the ones its ``meta.json`` describes, blocks longer than
the model's positions, an adapter recipe whose targets match no module.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lora_core
from lora_core.data.text import check_tokenizer_fits, model_eos_ids, read_prepared
from lora_core.formats.hf_checkpoint import write_hf_checkpoint
from lora_core.models import llama as llama_spec
from lora_core.models.build import checkpoint_family
from lora_core.train import allocator, heap
from lora_core.train.distributed import run_job
from lora_core.train.full_ft import check_full_ft_input
from lora_core.train.recipes import LM_RECIPES, apply_overrides
from lora_core.train.run_dir import check_out_dir
from lora_core.train.tasks import LMTask, max_positions
from lora_core.train.trainer import train

from ..run_options import (
    add_run_options,
    apply_run_options,
    doc_summary,
    quantize_kwargs,
    with_quantize_note,
    write_base,
)

RANDOM_PRESETS = sorted(set(llama_spec.PRESETS) | set(lora_core.PRESETS))


def build(backend, args, comm, eos_id: int | None = None):
    """The base model (4-bit with ``--quantize``) and a note of where it came from; a
    ``--random-init`` Llama-family base names ``eos_id`` (the prepared data's end-of-text token)
    as its ``eos_token_id``, so that its saved ``config.json`` matches the tokenizer."""
    quant = quantize_kwargs(args)
    if args.init_checkpoint:
        note = with_quantize_note(str(args.init_checkpoint), args, args.init_checkpoint)
        return backend.from_pretrained(args.init_checkpoint, **quant), note
    overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
    base_dir = Path(args.out_dir) / "base"
    if args.random_init in llama_spec.PRESETS:
        eos = {} if eos_id is None else {"eos_token_id": eos_id}
        cfg = llama_spec.llama_config(args.random_init, **overrides, **eos)
        weights = llama_spec.init_llama_weights(cfg, args.init_seed)
        if args.save_base or quant:  # a 4-bit base is quantized while it loads from OUT/base
            comm.on_main(write_base, args, base_dir, write_hf_checkpoint, cfg.to_hf_dict(), weights)
        if not quant:
            model = backend.LlamaForCausalLM(cfg)
            model.load_weights(weights)
    else:
        cfg = lora_core.gpt2_config(args.random_init, **overrides)
        weights = lora_core.init_gpt2_weights(cfg, args.init_seed)
        if args.save_base or quant:
            comm.on_main(write_base, args, base_dir, lora_core.save_model, cfg, weights)
        if not quant:
            model = backend.build_model(cfg, None, base=weights)
    if quant:
        model = backend.from_pretrained(base_dir, **quant)
    note = f"random-init preset={args.random_init} seed={args.init_seed} {overrides or ''}".strip()
    return model, with_quantize_note(note, args)


def model_kind(args) -> str:
    """``llama`` or ``gpt2``: the family the run trains (``unknown`` for a checkpoint folder that
    cannot be read: the run then says why, where it loads it)."""
    if args.random_init:
        return "llama" if args.random_init in llama_spec.PRESETS else "gpt2"
    try:
        return checkpoint_family(args.init_checkpoint)
    except (OSError, ValueError):
        return "unknown"


def check_fits(model, meta: dict, blocks: list[dict], prepared: Path, fix: str = "") -> None:
    """The data was made for this model: its tokenizer is the model's (vocabulary, end-of-text
    id: ``check_tokenizer_fits``) and its blocks fit the positions (``fix``: what the vocabulary
    error adds, the option that fixes it)."""
    eos = meta.get("eos_id")
    check_tokenizer_fits(int(meta["vocab_size"]), model.config.vocab_size,
                         f"{prepared / 'meta.json'}: the tokenizer {meta.get('tokenizer')}", fix,
                         eos_id=eos if type(eos) is int else None, model_eos=model_eos_ids(model.config))
    longest = max(len(b["ids"]) for b in blocks) - 1  # the model reads block[:-1]
    if longest > max_positions(model):
        raise ValueError(f"{prepared}: blocks of {longest + 1} tokens exceed the model's {max_positions(model)} "
                         f"positions: prepare with a smaller --block-size")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.lm.train", description=doc_summary(__doc__))
    p.add_argument("--backend", choices=lora_core.BACKENDS, default=None, help="default: $LORA_BACKEND or torch")
    p.add_argument("--recipe", default="wikitext2-llama", choices=sorted(LM_RECIPES))
    p.add_argument("--prepared", required=True, type=Path, help="output folder of examples.lm.prepare")
    init = p.add_mutually_exclusive_group(required=True)
    init.add_argument("--init-checkpoint", type=Path, help="a transformers checkpoint folder (Llama family or GPT-2)")
    init.add_argument("--random-init", choices=RANDOM_PRESETS, help="a random base of this preset")
    p.add_argument("--init-seed", type=int, default=None, help="seed of --random-init weights (default 0)")
    p.add_argument("--vocab-size", type=int, help="vocabulary size of a --random-init model")
    p.add_argument("--save-base", action="store_true", help="write the --random-init base to OUT/base")
    p.add_argument("--out-dir", required=True, type=Path)
    add_run_options(p, set_help="recipe overrides: train.FIELD=... (TrainConfig), lora.FIELD=... (LoRATargetConfig)",
                    quantize=True)
    args = p.parse_args(argv)
    if args.vocab_size and not args.random_init:
        p.error("--vocab-size applies to --random-init only (a checkpoint fixes its vocabulary)")
    if args.save_base and not args.random_init:
        p.error("--save-base applies to --random-init only (the --init-checkpoint folder is the base)")
    if args.init_seed is not None and not args.random_init:
        p.error("--init-seed applies to --random-init only (a checkpoint fixes its weights)")
    args.init_seed = 0 if args.init_seed is None else args.init_seed
    try:  # the malloc variables (lora_core.train.allocator, .heap), read mid-run: refused before any work
        allocator.mode(), heap.mode(), heap.every()
    except ValueError as e:
        p.error(str(e))
    if argv is None:  # a command, not a call from Python: its malloc can still be chosen (before torch loads)
        if (args.backend or os.environ.get("LORA_BACKEND") or "torch") == "torch":
            try:
                allocator.relaunch(model_kind(args))
            except ValueError as e:  # LORA_ALLOCATOR's value
                p.error(str(e))
            if os.environ.get("RANK", "0") == "0":
                print(f"[lm.train] malloc: {allocator.active()} (lora_core.train.allocator)", file=sys.stderr)

    def body(job) -> str:
        check_out_dir(args.out_dir, resume=args.resume or args.resume_from is not None)
        recipe = apply_overrides(LM_RECIPES[args.recipe], args.overrides)
        cfg = apply_run_options(recipe.train, args)
        if cfg.method == "full":
            check_full_ft_input("--init-checkpoint", args.init_checkpoint, args.overrides)
        train_blocks, valid_blocks, meta = read_prepared(args.prepared)
        backend = lora_core.get_backend(args.backend)
        backend.check_zero(cfg.zero)  # a stage the backend cannot run: refused before the model loads
        comm = job.start(backend, args.dist_timeout)
        model, note = build(backend, args, comm, meta.get("eos_id"))
        fix = f" (a --random-init model: give --vocab-size {meta['vocab_size']})" if args.random_init and not args.vocab_size else ""
        check_fits(model, meta, train_blocks + valid_blocks, args.prepared, fix)
        if cfg.method == "lora":
            backend.inject_lora(model, recipe.lora)
        backend.to_device(model, args.device)
        backend.set_grad_checkpoint(model, args.grad_checkpoint)
        summary = train(backend, model, train_blocks, valid_blocks, cfg, args.out_dir, resume=args.resume,
                        resume_from=args.resume_from, progress=not args.no_progress, base_note=note,
                        kill_after=args.stop_after, comm=comm, task=LMTask())
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())
        if args.random_init and not (args.save_base or args.quantize) and cfg.method == "lora":
            # nothing for evaluate/generate to put the adapter on (a full run's checkpoints are whole models)
            text += ("\nnote: the --random-init base was not written: rerun with --save-base (OUT/base) to evaluate "
                     "or generate with this adapter")  # fmt: skip
        return text

    return run_job(body)


if __name__ == "__main__":
    sys.exit(main())
