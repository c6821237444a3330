"""Beam-search output + formatted test file -> the evaluator's files (the paper's gpt2_decode.py).

The beam JSONL holds one ``{"index": k, "tokens": [ids]}`` line per unique context of the
test file, in first-appearance order. Paper settings::

    # E2E: predictions one per MR; references grouped by MR, blank line between MRs
    python -m examples.nlg.decode --vocab data/gpt2-vocab --beam out/e2e/beam.jsonl \\
        --test data/e2e/test_formatted.jsonl --ref-type e2e \\
        --ref-out out/e2e/e2e_ref.txt --pred-out out/e2e/e2e_pred.txt
    # WebNLG (DART alike, plus --allow-empty): reference0..5 in a folder, tokenised and lower-cased
    python -m examples.nlg.decode --vocab data/gpt2-vocab --beam out/webnlg/beam.jsonl \\
        --test data/webnlg/test_formatted.jsonl --ref-type webnlg --ref-num 6 \\
        --tokenize --lower --filter all \\
        --ref-out out/webnlg/references --pred-out out/webnlg/hypothesis
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lora_core.data.convert import convert
from lora_core.data.nlg import check_outputs_apart
from lora_core.data.tokenizer import load_tokenizer
from lora_core.generate.decode import make_eval_files

from ..run_options import doc_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.nlg.decode", description=doc_summary(__doc__))
    parser.add_argument("--vocab", required=True, help="tokenizer folder/file or hub name used for encoding")
    parser.add_argument("--beam", type=Path, required=True, help="beam-search JSONL")
    parser.add_argument("--test", type=Path, required=True, help="test data: formatted .jsonl, or raw E2E .txt")
    parser.add_argument("--test-kind", choices=["formatted", "e2e", "webnlg", "dart"], default=None,
                        help="how to read --test (default: by suffix, .txt = e2e, else formatted)")  # fmt: skip
    parser.add_argument("--allow-empty", action="store_true", help="keep empty references (DART's test set has one)")
    parser.add_argument("--ref-type", choices=["e2e", "webnlg", "dart"], required=True)
    parser.add_argument("--ref-out", type=Path, required=True, help="reference file (e2e) or folder (webnlg, dart)")
    parser.add_argument("--pred-out", type=Path, required=True, help="prediction file")
    parser.add_argument(
        "--ref-num",
        type=int,
        default=None,
        help="reference files for webnlg/dart (paper: 6; default: most refs of any input)",
    )
    parser.add_argument("--pad", choices=["first", "empty"], default="first",
                        help="fill for missing references: the first reference (paper) or an empty line")  # fmt: skip
    parser.add_argument("--tokenize", action="store_true", help="split off non-word characters (paper: webnlg, dart)")
    parser.add_argument("--lower", action="store_true", help="lower-case (paper: webnlg, dart)")
    parser.add_argument("--filter", choices=["all", "seen", "unseen"], default="all", help="WebNLG categories")
    args = parser.parse_args(argv)

    kind = args.test_kind or ("e2e" if args.test.suffix == ".txt" else "formatted")
    try:
        check_outputs_apart([("--pred-out", args.pred_out), ("--ref-out", args.ref_out)],
                            [("--beam", args.beam), ("--test", args.test)])  # fmt: skip
        tok = load_tokenizer(args.vocab)
        records = convert(kind, args.test, allow_empty=args.allow_empty)
        info = make_eval_files(
            tok, args.beam, records, args.ref_type, args.ref_out, args.pred_out,
            filter=args.filter, ref_num=args.ref_num, pad=args.pad,
            tokenize=args.tokenize, lower=args.lower, source=str(args.test),
        )  # fmt: skip
    except (ValueError, OSError) as e:  # DataFormatError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    refs = "" if info["references"] is None else f", {info['references']} reference files"
    print(f"{info['instances']} instances{refs} -> {args.pred_out}, {args.ref_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
