"""Raw data -> formatted JSONL -> encoded JSONL (the paper's create_datasets.sh in one command).

For each ``SPLIT=PATH`` input (a bare ``PATH`` uses its file stem as the split name; a path
holding "=" is a bare ``PATH`` when it is an existing file or a "/" comes before the "=") it
writes ``OUT/SPLIT_formatted.jsonl`` (``{"context", "completion"[, "cate"]}``) and
``OUT/SPLIT.jsonl`` (token ids in the paper layout: ``bpe(context) + [eos]``,
``bpe(" " + completion) + [eos]``), the names microsoft/LoRA uses. Examples::

    python -m examples.nlg.prepare e2e --vocab data/gpt2-vocab --out-dir data/e2e \\
        train=data/e2e/train.txt valid=data/e2e/valid.txt test=data/e2e/test.txt
    python -m examples.nlg.prepare webnlg --vocab data/gpt2-vocab --out-dir data/webnlg \\
        train=data/webnlg/train.json valid=data/webnlg/dev.json test=data/webnlg/test.json
    python -m examples.nlg.prepare formatted --vocab ../shared/data/gpt2-vocab --out-dir out/dart \\
        ../shared/data/dart/test_formatted.jsonl          # already formatted: encode only
    python -m examples.nlg.prepare toy --out-dir out/toy  # the embedded data set + its tokenizer
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lora_core.data.convert import CONVERTERS, convert
from lora_core.data.nlg import write_jsonl_atomic
from lora_core.data.tokenizer import encode_file, load_tokenizer
from lora_core.data.toy import make_toy_dataset

from ..run_options import doc_summary


def _split_arg(text: str) -> tuple[str, Path]:
    """``SPLIT=PATH`` or a bare ``PATH`` (split: its stem, less ``_formatted``). A ``PATH`` may hold
    "=": the text is read as ``SPLIT=PATH`` only when the part before the first "=" is a plain
    split name (no path separator) and the whole text is not an existing file."""
    name, sep, path = text.partition("=")
    separators = {"/", os.sep, os.altsep} - {None}
    if not sep or any(c in name for c in separators) or Path(text).is_file():
        stem = Path(text).stem
        return stem[: -len("_formatted")] if stem.endswith("_formatted") else stem, Path(text)
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected SPLIT=PATH or PATH, got {text!r}")
    return name, Path(path)


def prepare(
    kind: str,
    inputs: list[tuple[str, Path]],
    out_dir: Path,
    vocab: str,
    progress: bool = True,
    allow_empty: bool = False,
) -> dict:
    """Convert and encode each ``(split, path)``; returns ``{split: (formatted, encoded)}`` paths."""
    tok = load_tokenizer(vocab)
    done = {}
    for split, path in inputs:
        records = convert(kind, path, allow_empty=allow_empty)
        if not records:  # a split of no examples would train, decode or score nothing
            raise ValueError(f"{path}: no examples in the file ({split} split)")
        formatted = out_dir / f"{split}_formatted.jsonl"
        encoded = out_dir / f"{split}.jsonl"
        in_place = formatted.resolve() == path.resolve()  # a formatted input in OUT: keep it
        if encoded.resolve() == path.resolve() or (in_place and kind != "formatted"):
            raise ValueError(f"an output in {out_dir} would overwrite the input {path}")
        if not in_place:
            write_jsonl_atomic(formatted, records)
        write_jsonl_atomic(encoded, encode_file(tok, records, progress=progress))
        print(f"{split}: {len(records)} examples from {path} -> {formatted.name}, {encoded.name}")
        done[split] = (formatted, encoded)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.nlg.prepare", description=doc_summary(__doc__))
    sub = parser.add_subparsers(dest="kind", required=True)
    for kind in CONVERTERS:
        p = sub.add_parser(kind, help=f"convert {kind} inputs" if kind != "formatted" else "encode formatted JSONL")
        p.add_argument("inputs", nargs="+", type=_split_arg, metavar="[SPLIT=]PATH")
        p.add_argument(
            "--vocab", required=True, help="tokenizer folder/file or hub name, e.g. ../shared/data/gpt2-vocab"
        )
        p.add_argument("--out-dir", type=Path, required=True)
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--allow-empty", action="store_true", help="keep empty completions (DART's test set has one)")
    p = sub.add_parser("toy", help="write the embedded toy data set and its tokenizer, then prepare it")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    try:
        if args.kind == "toy":
            paths = make_toy_dataset(args.out_dir, seed=args.seed, vocab_size=args.vocab_size)
            inputs = [(s, paths[s]) for s in ("train", "valid", "test")]
            prepare("e2e", inputs, args.out_dir, str(paths["tokenizer"]), not args.no_progress)
        else:
            names = [s for s, _ in args.inputs]
            if len(set(names)) != len(names):
                parser.error(f"split names must differ, got {names}")
            prepare(args.kind, args.inputs, args.out_dir, args.vocab, not args.no_progress, args.allow_empty)
    except (ValueError, OSError) as e:  # DataFormatError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
