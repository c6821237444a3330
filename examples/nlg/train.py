"""Train a LoRA adapter (or, ``--method full``, every weight) on encoded NLG data with one of the paper's recipes.

Reads encoded JSONL (``examples.nlg.prepare`` output: ``{"context": ids, "completion": ids}``)
and writes the run folder described in ``lora_core.train.trainer``. Examples::

    python -m examples.nlg.train --backend torch --recipe e2e-medium \\
        --train data/e2e/train.jsonl --valid data/e2e/valid.jsonl \\
        --init-checkpoint pretrained/gpt2-medium --out-dir runs/e2e-medium
    python -m examples.nlg.train --backend jittor --recipe toy --train out/toy/train.jsonl \\
        --valid out/toy/valid.jsonl --random-init tiny --vocab-size 512 --save-base \\
        --out-dir runs/toy --set lr=1e-3 eval_every=50
    python -m examples.nlg.train --backend torch --recipe e2e-medium-ft ...   # full fine-tuning (paper's FT row)
    python -m examples.nlg.train ... --recipe toy --method full     # any recipe, every weight trained
    python -m examples.nlg.train ... --out-dir runs/toy --resume   # continue after a kill
    python -m examples.nlg.train ... --out-dir runs/toy --resume-from runs/toy/ckpt-600
                                   # when --resume reports the latest checkpoint damaged
    python -m examples.nlg.train ... --device cuda --precision bf16 --grad-checkpoint   # on a GPU
    python -m examples.nlg.train ... --device cuda --compile        # torch: a compiled training step
    python -m examples.nlg.train ... --quantize nf4     # QLoRA: q, v LoRA of c_attn on a 4-bit NF4 base
    torchrun --nproc_per_node 2 -m examples.nlg.train --backend torch ...    # data parallel
    mpirun -np 2 python -m examples.nlg.train --backend jittor ...          # (as root: --allow-run-as-root)

``--init-checkpoint`` takes HF/OpenAI GPT-2 files (``model.safetensors`` or
``pytorch_model.bin``, with ``config.json``) or a ``save_model`` folder; ``--random-init``
draws a base from ``lora_core.init_gpt2_weights(preset, --init-seed)`` (identical in both
backends), and ``--save-base`` writes it to ``OUT/base`` for decoding later. With ``--method
full`` each ``ckpt-N/`` is the whole model in transformers' GPT-2 layout (``lora_core.train.full_ft``),
loadable as ``--init-checkpoint`` or by ``transformers.AutoModelForCausalLM.from_pretrained``.
``--quantize nf4`` (``--no-double-quant``, ``--compute-dtype``; ``examples.run_options``) stores the
frozen base's four linear layers of each block as NF4 (a ``--random-init`` base is written to
``OUT/base`` and quantized as it loads from there) and injects the recipe's LoRA on them;
``examples.nlg.beam`` takes the same options. Refused with ``--method full``; a resume must keep them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lora_core
from lora_core.data.nlg import check_data_file, read_encoded
from lora_core.formats.checkpoint import save_model
from lora_core.train.distributed import run_job
from lora_core.train.full_ft import check_full_ft_input
from lora_core.train.recipes import RECIPES, apply_overrides, get_recipe
from lora_core.train.run_dir import check_out_dir
from lora_core.train.trainer import train

from ..run_options import (
    add_run_options,
    apply_run_options,
    doc_summary,
    loaded_quant,
    quantize_kwargs,
    with_quantize_note,
    write_base,
)


def build(backend, args, lora, comm):
    """The model (its LoRA injected on a 4-bit base) and a note of its base weights."""
    quant = quantize_kwargs(args)
    # a 4-bit base: --quantize, or a bitsandbytes 4-bit checkpoint (it loads 4-bit without the options)
    four_bit = bool(loaded_quant(args.init_checkpoint, quant) if args.init_checkpoint else quant)
    if args.init_checkpoint:
        model = backend.from_pretrained(args.init_checkpoint, **quant) if four_bit else \
            backend.from_pretrained(args.init_checkpoint, lora=lora)
        want = lora_core.PRESETS.get(args.recipe_model)
        mismatched = want is not None and (model.config.n_embd, model.config.n_layer) != (want.n_embd, want.n_layer)
        if mismatched and comm.world.is_main:  # once, not once a rank
            print(
                f"note: the recipe is for {args.recipe_model}; {args.init_checkpoint} has n_embd="
                f"{model.config.n_embd}, n_layer={model.config.n_layer}",
                file=sys.stderr,
            )
        note = str(args.init_checkpoint)
    else:
        overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
        cfg = lora_core.gpt2_config(args.random_init, **overrides)
        base = lora_core.init_gpt2_weights(cfg, args.init_seed)
        if args.save_base or quant:  # a 4-bit base is quantized while it loads from OUT/base
            comm.on_main(write_base, args, Path(args.out_dir) / "base", save_model, cfg, base)
        note = f"random-init preset={args.random_init} seed={args.init_seed} {overrides or ''}".strip()
        model = backend.from_pretrained(Path(args.out_dir) / "base", **quant) if quant else \
            backend.build_model(cfg, lora, base=base)
    if four_bit and lora is not None:  # a 4-bit base takes LoRA by injection (the same q, v slices of c_attn)
        backend.inject_lora(model, lora)
    return model, with_quantize_note(note, args, args.init_checkpoint)


def build_parser() -> argparse.ArgumentParser:
    """The command's options."""
    parser = argparse.ArgumentParser(prog="python -m examples.nlg.train", description=doc_summary(__doc__))
    parser.add_argument("--backend", choices=lora_core.BACKENDS, default=None, help="default: $LORA_BACKEND or torch")
    parser.add_argument("--recipe", required=True, choices=sorted(RECIPES))
    parser.add_argument("--train", required=True, type=Path, help="encoded training JSONL")
    parser.add_argument("--valid", type=Path, help="encoded validation JSONL (for valid NLL / perplexity)")
    init = parser.add_mutually_exclusive_group(required=True)
    init.add_argument("--init-checkpoint", type=Path, help="GPT-2 weights (file or folder)")
    init.add_argument("--random-init", choices=sorted(lora_core.PRESETS), help="a random base of this size")
    parser.add_argument("--init-seed", type=int, default=0, help="seed of --random-init weights")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size of a --random-init model")
    parser.add_argument("--save-base", action="store_true", help="write the --random-init base to OUT/base")
    parser.add_argument("--out-dir", required=True, type=Path)
    add_run_options(parser, set_help="override recipe settings, e.g. --set lr=1e-3 eval_every=500 (keys of "
                    "TrainConfig; train.lr=1e-3, as examples.lm.train and examples.cls.train take them, too)",
                    quantize=True, exclusive_resume=False)
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="DYNAMO_BACKEND",
        help="torch backend: compile the training step (torch.compile over padded shape buckets; default "
        "inductor, aot_eager compiles faster)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.vocab_size and not args.random_init:
        parser.error("--vocab-size applies to --random-init only (a checkpoint fixes its vocabulary)")
    if args.compile is not None and not args.compile.strip():
        parser.error("--compile: give a torch.compile backend (inductor, aot_eager), or the option alone for inductor")
    if args.compile and getattr(args, "quantize", None):
        parser.error("--compile with --quantize nf4 is not supported (bitsandbytes' kernels are called through ctypes, "
                     "which torch.compile cannot trace): drop one")

    def body(job) -> str:
        # bad input is refused before any work: the run folder, then the data (read whole, strictly)
        check_out_dir(args.out_dir, resume=args.resume or args.resume_from is not None)
        recipe = get_recipe(args.recipe)
        # keys of TrainConfig, with or without the "train." the other train commands' --set takes
        overrides = [o.removeprefix("train.") for o in args.overrides]
        cfg = apply_run_options(apply_overrides(recipe.train, overrides), args)
        if cfg.method == "full":
            check_full_ft_input("--init-checkpoint", args.init_checkpoint, overrides)
        train_data = read_encoded(check_data_file(args.train, "--train"))
        valid_data = read_encoded(check_data_file(args.valid, "--valid")) if args.valid else None
        args.recipe_model = recipe.model
        backend = lora_core.get_backend(args.backend)
        backend.check_zero(cfg.zero)  # a stage the backend cannot run: refused before the model loads
        comm = job.start(backend, args.dist_timeout)
        model, note = build(backend, args, cfg.lora_config() if cfg.method == "lora" else None, comm)
        backend.to_device(model, args.device)  # device, grad_checkpoint, compile do not change results: not in cfg
        backend.set_grad_checkpoint(model, args.grad_checkpoint)
        if args.compile:
            backend.set_compile(model, True, args.compile)
        summary = train(
            backend,
            model,
            train_data,
            valid_data,
            cfg,
            args.out_dir,
            resume=args.resume,
            progress=not args.no_progress,
            base_note=note,
            kill_after=args.stop_after,
            resume_from=args.resume_from,
            comm=comm,
        )
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())

    return run_job(body)

if __name__ == "__main__":
    sys.exit(main())
