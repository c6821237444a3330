"""Text files -> packed token blocks for causal-LM training (``lora_core.data.text``).

Tokenises with the model's tokenizer (GPT-2's BPE folder, or a checkpoint folder /
``tokenizer.json`` for Llama-family models), joins the documents with its end-of-text token
and cuts fixed blocks (``--block-size``, 512 as the LoRA/QLoRA studies use). Writes
``OUT/train.jsonl`` and ``OUT/valid.jsonl`` (``{"ids": [...]}`` per block) and
``OUT/meta.json`` (tokenizer, vocabulary size, block size, token and block counts, the files'
SHA-256: ``lora_core.data.text.write_prepared``; a re-run that fails half-way leaves no
``meta.json``, so no command reads a mix of two preparations)::

    python -m examples.lm.prepare --tokenizer ../shared/data/gpt2-vocab \\
        --train data/wikitext-2-raw/wiki.train.raw --valid data/wikitext-2-raw/wiki.valid.raw \\
        --block-size 512 --out-dir out/wikitext2-gpt2
    python -m examples.lm.prepare --tokenizer Llama-3.2-3B/ --train ... --out-dir out/wikitext2-llama

Without ``--valid``, ``--valid-fraction`` of the training blocks (the last ones) are held out.
A bad file stops with its name (and line, for text that is not UTF-8).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lora_core.data.text import load_text_tokenizer, pack_blocks, read_documents, tokenize_documents, write_prepared

from ..run_options import doc_summary, no_file_above


def prepare(tokenizer: Path, train: list[Path], valid: list[Path] | None, block_size: int, out_dir: Path,
            valid_fraction: float = 0.05) -> dict:
    """Encode, pack and write; returns the summary written to ``meta.json``."""
    tok = load_text_tokenizer(tokenizer)
    train_docs = read_documents(train)  # every file is checked before anything is written
    valid_docs = read_documents(valid, "text to validate on") if valid else None
    train_blocks = pack_blocks(tokenize_documents(tok, train_docs), block_size, tok.eos_id)
    if valid_docs is not None:
        valid_blocks = pack_blocks(tokenize_documents(tok, valid_docs), block_size, tok.eos_id)
    else:
        if not 0 < valid_fraction < 1:
            raise ValueError(f"--valid-fraction must be in (0, 1), got {valid_fraction}")
        n = max(1, round(len(train_blocks) * valid_fraction))
        if len(train_blocks) < 2:
            raise ValueError(f"{len(train_blocks)} block of training text: too few to hold some out; give --valid")
        if n >= len(train_blocks):
            raise ValueError(f"--valid-fraction {valid_fraction} of {len(train_blocks)} training blocks holds out {n}, "
                             f"leaving none to train on: give a smaller --valid-fraction, or --valid")  # fmt: skip
        train_blocks, valid_blocks = train_blocks[:-n], train_blocks[-n:]
    meta = {
        "tokenizer": str(tokenizer), "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "block_size": block_size,
        "train_files": [str(p) for p in train], "valid_files": [str(p) for p in valid] if valid else None,
    }
    return write_prepared(out_dir, {"train": train_blocks, "valid": valid_blocks}, meta)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.lm.prepare", description=doc_summary(__doc__))
    p.add_argument("--tokenizer", required=True, type=Path,
                   help="GPT-2 vocabulary folder, a checkpoint folder with tokenizer.json, or a tokenizer.json")
    p.add_argument("--train", required=True, type=Path, nargs="+", help="text files (one document each)")
    p.add_argument("--valid", type=Path, nargs="+", help="held-out text files")
    p.add_argument("--valid-fraction", type=float, default=None,
                   help="without --valid: the share of the training blocks held out, the last ones (default 0.05)")
    p.add_argument("--block-size", type=int, default=512, help="tokens per block (the model reads block - 1)")
    p.add_argument("--out-dir", required=True, type=Path)
    args = p.parse_args(argv)
    if args.out_dir.exists() and not args.out_dir.is_dir():
        p.error(f"--out-dir {args.out_dir}: exists and is not a folder")
    try:
        no_file_above("--out-dir", args.out_dir)
    except ValueError as e:
        p.error(str(e))
    if args.valid and args.valid_fraction is not None:
        p.error("--valid-fraction holds out training blocks when there is no --valid: give one of the two")
    try:
        meta = prepare(args.tokenizer, args.train, args.valid, args.block_size, args.out_dir,
                       0.05 if args.valid_fraction is None else args.valid_fraction)
    except (ValueError, OSError) as e:  # a bad file; a write that failed (no meta.json then)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{meta['train_blocks']} training blocks ({meta['train_tokens']} tokens), {meta['valid_blocks']} "
          f"validation blocks ({meta['valid_tokens']} tokens) of {args.block_size} -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
