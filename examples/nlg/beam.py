"""Beam-decode the unique contexts of a test file with base + adapter (either backend).

    python -m examples.nlg.beam --backend jittor --base BASE_DIR --adapter OUT/ckpt-1000 \\
        --test data/e2e/test_formatted.jsonl --vocab ../shared/data/gpt2-vocab \\
        --recipe e2e-medium --out OUT/beam.jsonl

Writes one JSON line per unique context, in ``group_references`` order:
``{"index": k, "tokens": [...]}`` (generated tokens), which ``examples.nlg.decode`` reads.
The adapter is always loaded on top of its base (an adapter alone is an error); an adapter
trained with ``--quantize nf4`` (QLoRA) is decoded on the same 4-bit base with the same
``--quantize`` options.

Under ``torchrun --nproc_per_node N -m examples.nlg.beam ...`` or ``mpirun -np N python -m
examples.nlg.beam ...`` each process decodes a contiguous share of whole batches and rank 0
writes the outputs merged in input order: the same file as one process writes.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import lora_core
from lora_core.data.nlg import check_outputs_apart, group_references, read_formatted, write_jsonl_atomic
from lora_core.data.tokenizer import load_tokenizer
from lora_core.device import DEVICE_CHOICES
from lora_core.generate.beam_scoring import SCORING
from lora_core.generate.static_cache import DECODE_STEPS
from lora_core.models import check_length
from lora_core.train.distributed import batch_shard, gather_outputs, run_job
from lora_core.train.precision import PRECISIONS
from lora_core.train.recipes import RECIPES, apply_overrides, get_recipe

from ..run_options import (
    add_quantize_options,
    check_quantize,
    doc_summary,
    positive,
    quantize_kwargs,
    resolve_base_adapter,
)


def encode_prompts(tok, contexts: list[str]) -> list[list[int]]:
    """Prompt layout of the paper: ``bpe(context) + [eos]``."""
    return [tok.encode(c) + [tok.eos_id] for c in contexts]


def check_prompt_lengths(prompts: list[list[int]], lines: list[int], model_config, max_new_tokens: int, source) -> None:
    """Refuse, before any decoding, a prompt the beam search would stop on mid-run: it feeds the
    prompt and then each generated token but the last, ``len(prompt) + max_new_tokens - 1``
    tokens, which the model's own check (``lora_core.models.check_length``) must accept.
    ``lines``: the ``--test`` line of each prompt's context (its first record)."""
    for prompt, line in zip(prompts, lines, strict=True):
        try:
            check_length(model_config, len(prompt) + max_new_tokens - 1)
        except ValueError as e:
            raise ValueError(
                f"--test {source} line {line}: its context is {len(prompt)} tokens (eos included); with "
                f"max_new_tokens={max_new_tokens} the beam search would reach {len(prompt) + max_new_tokens - 1} "
                f"tokens, which the model refuses ({e}): shorten the context or lower max_new_tokens "
                f"(--set max_new_tokens=N)"
            ) from None


def decode_prompts(
    backend,
    model,
    prompts: list[list[int]],
    beam_cfg,
    batch_size: int = 8,
    progress: bool = True,
    scoring: str = "auto",
    decode_step: str = "auto",
) -> list[list[int]]:
    """Batched beam search of encoded prompts (:func:`encode_prompts`)."""
    return backend.beam_search(
        model, prompts, beam_cfg, batch_size=batch_size, progress=progress, scoring=scoring, decode_step=decode_step
    )


def decode_contexts(backend, model, tok, contexts: list[str], beam_cfg, batch_size: int = 8,
                    progress: bool = True, scoring: str = "auto", decode_step: str = "auto") -> list[list[int]]:
    """Prompt layout of the paper (``bpe(context) + [eos]``), then batched beam search."""
    return decode_prompts(
        backend, model, encode_prompts(tok, contexts), beam_cfg, batch_size, progress, scoring, decode_step
    )


def write_beam_jsonl(path, outputs: list[list[int]]) -> None:
    write_jsonl_atomic(path, ({"index": i, "tokens": [int(t) for t in toks]} for i, toks in enumerate(outputs)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.nlg.beam", description=doc_summary(__doc__))
    p.add_argument("--backend", choices=lora_core.BACKENDS, default=None)
    p.add_argument("--base", required=True, help="base checkpoint (HF/OpenAI files or save_model folder)")
    p.add_argument("--adapter", help="adapter folder (adapter_config.json + adapter.safetensors)")
    p.add_argument("--test", required=True, type=Path, help="formatted test JSONL (context, completion)")
    p.add_argument("--vocab", required=True, help="tokenizer folder or tokenizer.json")
    p.add_argument("--recipe", default="e2e-medium", choices=sorted(RECIPES))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="beam overrides, e.g. beam=5")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--allow-empty", action="store_true", help="accept empty references (DART test)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="auto", help=f"{DEVICE_CHOICES} (auto: the GPU when the backend has one)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="forward-pass precision")
    p.add_argument("--scoring", choices=SCORING, default="auto",
                   help="where each step's logits are ranked: on the model's device (only candidates reach the "
                        "host) or on the host with numpy; auto: device on a GPU, host on the CPU")  # fmt: skip
    p.add_argument("--decode-step", choices=DECODE_STEPS, default="auto",
                   help="captured: a preallocated cache reordered in place, the step recorded once per shape as a "
                        "CUDA graph (torch; op by op on a CPU); eager: a growing cache; auto: captured on a GPU, "
                        "eager on the CPU (the same beams either way)")  # fmt: skip
    p.add_argument("--dist-timeout", type=float, default=300.0, help="seconds to wait for the other processes")
    add_quantize_options(p)
    a = p.parse_args(argv)
    def body(job) -> str:
        check_quantize(a)
        check_outputs_apart([("--out", a.out)], [("--test", a.test)])
        positive("--batch-size", a.batch_size)
        backend = lora_core.get_backend(a.backend)
        comm = job.start(backend, a.dist_timeout)
        tok = load_tokenizer(a.vocab)
        beam_cfg = apply_overrides(dataclasses.replace(get_recipe(a.recipe).beam, stop_ids=tok.stop_ids), a.set)
        base, adapter = resolve_base_adapter(a.base, a.adapter, quantize_kwargs(a), warn=comm.world.is_main)
        records = read_formatted(a.test, allow_empty=a.allow_empty)
        groups = group_references(records, str(a.test))
        if not groups:
            raise ValueError(f"--test {a.test}: the file holds no examples")
        first_line: dict[str, int] = {}
        for no, rec in enumerate(records, 1):
            first_line.setdefault(rec["context"], no)
        prompts = encode_prompts(tok, [g.context for g in groups])
        model = backend.from_pretrained(base, adapter=adapter, trainable=False, **quantize_kwargs(a))
        # every context against the model before any decoding (not when its batch comes)
        lines = [first_line[g.context] for g in groups]
        check_prompt_lengths(prompts, lines, model.config, beam_cfg.max_new_tokens, a.test)
        backend.to_device(model, a.device)
        backend.set_precision(model, a.precision)
        start, stop = batch_shard(len(groups), a.batch_size, comm.world)
        mine = decode_prompts(
            backend,
            model,
            prompts[start:stop],
            beam_cfg,
            a.batch_size,
            progress=comm.world.is_main,
            scoring=a.scoring,
            decode_step=a.decode_step,
        )
        outputs = gather_outputs(comm, mine, start, len(groups))
        comm.on_main(write_beam_jsonl, a.out, outputs)
        return f"wrote {len(outputs)} beams to {a.out}"

    return run_job(body)

if __name__ == "__main__":
    raise SystemExit(main())
