"""Continue prompts with a causal LM (base + optional adapter), greedy or beam search with a
KV cache, in either backend::

    python -m examples.lm.generate --backend jittor --base Llama-3.2-3B/ --adapter runs/wt2-llama \\
        --tokenizer Llama-3.2-3B/ --prompt "The history of" --max-new-tokens 40
    python -m examples.lm.generate ... --beam 4 --prompts-file prompts.txt   # one prompt a line
    python -m examples.lm.generate ... --adapter runs/qlora --quantize nf4    # a QLoRA adapter on its 4-bit base

Generation stops at the tokenizer's end-of-text token or after ``--max-new-tokens``. A prompt
starts with what the tokenizer's post-processor puts first (Llama 3's ``<|begin_of_text|>``,
Llama 2's ``<s>``; nothing for GPT-2), as transformers' ``tokenizer(prompt)`` does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lora_core
from lora_core.data.text import check_tokenizer_fits, load_text_tokenizer, model_eos_ids, read_utf8
from lora_core.generate.beam import BeamConfig
from lora_core.train.tasks import max_positions

from ..run_options import (
    add_quantize_options,
    check_quantize,
    doc_summary,
    positive,
    quantize_kwargs,
    resolve_base_adapter,
)


def generate(backend_name: str | None, base: Path, adapter: Path | None, tokenizer: Path, prompts: list[str],
             max_new_tokens: int = 40, beam: int = 1, device: str = "auto", quant: dict | None = None) -> list[str]:
    """The continuation of each prompt (text); ``quant``: the backends' ``from_pretrained``
    arguments of a 4-bit base (``quantize="nf4"``, ...)."""
    backend = lora_core.get_backend(backend_name)
    tok = load_text_tokenizer(tokenizer)
    base, adapter = resolve_base_adapter(base, adapter, quant or {})
    model = backend.from_pretrained(base, adapter=adapter, **(quant or {}))
    check_tokenizer_fits(tok.vocab_size, model.config.vocab_size, f"the tokenizer {tokenizer}", eos_id=tok.eos_id,
                         model_eos=model_eos_ids(model.config))
    backend.to_device(model, device)
    empty = [i for i, p in enumerate(prompts) if not tok.encode(p)]
    if empty:
        raise ValueError(f"prompt {empty[0] + 1} is empty")
    contexts = [tok.encode_prompt(p) for p in prompts]  # with the BOS a Llama tokenizer puts first
    longest, P = max(len(c) for c in contexts), max_positions(model)
    if longest >= P:  # room for one new token at least: the prompt's P - 1 positions read, one predicted
        raise ValueError(f"the longest prompt ({longest} tokens) leaves no room in the model's {P} positions: "
                         f"shorten it to at most {P - 1} tokens")  # fmt: skip
    # the last new token is predicted, never read back: prompt + new - 1 positions are read
    if longest + max_new_tokens - 1 > P:
        raise ValueError(f"the longest prompt ({longest} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                         f"model's {P} positions: give at most {P - longest + 1} new tokens or a shorter prompt")  # fmt: skip
    cfg = BeamConfig(beam=beam, max_new_tokens=max_new_tokens, no_repeat_ngram_size=0, stop_ids=(tok.eos_id,))
    outs = backend.beam_search(model, contexts, cfg, batch_size=min(8, len(contexts)))
    return continuations(tok, contexts, outs)


def continuations(tok, contexts: list[list[int]], outs: list[list[int]]) -> list[str]:
    """The text each search result adds to its prompt (:func:`continuation`), the end-of-text
    token left out; token ids beyond the tokenizer's (a model's padded vocabulary rows, which
    decode to nothing) are named in a warning on stderr, not dropped without a word."""
    texts = []
    for i, (c, o) in enumerate(zip(contexts, outs), 1):
        new = [t for t in o if t != tok.eos_id]
        textless = sorted({t for t in new if t >= tok.vocab_size})
        if textless:
            print(f"warning: prompt {i}: generated token id(s) {textless} beyond the tokenizer's {tok.vocab_size} "
                  f"tokens (the model's padded vocabulary rows): they have no text and are left out of it",
                  file=sys.stderr)  # fmt: skip
        texts.append(continuation(tok, c, new))
    return texts


def continuation(tok, context: list[int], generated: list[int]) -> str:
    """The text ``generated`` adds to ``context``: the two decoded together, less the context's
    own text (as transformers' text pipelines take it), so that a word boundary at the join
    survives: SentencePiece decoders (Llama 2, Mistral) drop the leading space of a text's first
    token, which the continuation decoded alone would lose."""
    whole, head = tok.decode(context + generated), tok.decode(context)
    return whole[len(head):] if whole.startswith(head) else tok.decode(generated)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.lm.generate", description=doc_summary(__doc__))
    p.add_argument("--backend", choices=lora_core.BACKENDS, default=None, help="default: $LORA_BACKEND or torch")
    p.add_argument("--base", required=True, type=Path,
                   help="the base checkpoint folder (or the run folder of a --method full run: its latest checkpoint)")
    p.add_argument("--adapter", type=Path, help="a checkpoint of examples.lm.train, its run folder, or a peft adapter")
    p.add_argument("--tokenizer", required=True, type=Path, help="as for examples.lm.prepare")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument("--prompts-file", type=Path, help="UTF-8 text, one prompt a line")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--beam", type=int, default=1, help="1: greedy")
    p.add_argument("--device", default="auto")
    add_quantize_options(p)
    args = p.parse_args(argv)
    try:
        check_quantize(args)
        positive("--max-new-tokens", args.max_new_tokens)
        positive("--beam", args.beam)
        prompts = args.prompt or [ln for ln in read_utf8(args.prompts_file, "prompts").splitlines() if ln.strip()]
        outs = generate(args.backend, args.base, args.adapter, args.tokenizer, prompts, args.max_new_tokens, args.beam,
                        args.device, quantize_kwargs(args))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for prompt, out in zip(prompts, outs):
        print(f"{prompt}{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
