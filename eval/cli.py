"""``lora-eval``: score E2E, WebNLG or DART output files like the official scorers.

Usage::

    lora-eval e2e --ref REF --hyp HYP [--json] [--per-instance OUT.jsonl] [--metrics BLEU,NIST]
    lora-eval webnlg (--refs R0 R1 ... | --ref-prefix P --num-refs N) --hyp HYP [...]
    lora-eval dart   (--refs R0 R1 ... | --ref-prefix P --num-refs N) --hyp HYP [...]

Prints a short table (or, with ``--json``, one JSON object of the scores).
Exit status: 0 scored, 2 bad input or arguments (or ``--per-instance`` not written: the scores
are printed first), 3 Java needed but missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .e2e import E2E_METRICS, score_e2e
from .inputs import EvalInputError, JavaUnavailableError
from .webnlg import WEBNLG_METRICS, reference_paths, score_webnlg

__all__ = ["main", "build_parser", "format_table"]

_SCALES = {
    "BLEU": "0-1",
    "NIST": "raw",
    "METEOR": "0-1",
    "ROUGE_L": "0-1",
    "CIDEr": "raw",
    "TER": "0-1",
    "chrF++": "0-1",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``lora-eval`` argument parser."""
    parser = argparse.ArgumentParser(prog="lora-eval", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="task", required=True)
    e2e = sub.add_parser("e2e", help="E2E NLG challenge scores (measure_scores.py)")
    e2e.add_argument(
        "--ref",
        required=True,
        help="reference file: references of an instance on consecutive lines, instances separated by one empty line",
    )
    for name in ("webnlg", "dart"):
        p = sub.add_parser(name, help=f"{name.upper()} scores (GenerationEval eval.py)")
        refs = p.add_mutually_exclusive_group(required=True)
        refs.add_argument("--refs", nargs="+", help="reference files reference0 reference1 ...")
        refs.add_argument("--ref-prefix", help="prefix P of reference files P0 .. P{N-1}")
        p.add_argument("--num-refs", type=int, help="N, with --ref-prefix")
    for name, p in sub.choices.items():
        names = ",".join(E2E_METRICS if name == "e2e" else WEBNLG_METRICS)
        p.add_argument("--hyp", required=True, help="hypothesis file, one instance per line")
        p.add_argument("--json", action="store_true", help="print the scores as one JSON object")
        p.add_argument("--per-instance", metavar="OUT", help="write per-instance scores (JSON lines) to OUT")
        p.add_argument("--metrics", help=f"comma-separated subset of {names} (default all)")
    return parser


def format_table(task: str, scores: dict, n: int, seconds: float) -> str:
    """A short human-readable table of ``scores``."""
    head = f"{task.upper()} scores ({n} instances, {seconds:.1f} s)"
    lines = [head]
    for name, value in scores.items():
        if name == "per_instance":
            continue
        scale = "0-100" if (name == "BLEU" and task != "e2e") else _SCALES.get(name, "")
        lines.append(f"  {name:<8} {value:10.4f}   {scale}")
    return "\n".join(lines)


def _ref_paths(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list:
    if args.refs:
        if args.num_refs is not None:
            parser.error("--num-refs goes with --ref-prefix, not --refs")
        return list(args.refs)
    if args.num_refs is None:
        parser.error("--ref-prefix needs --num-refs N")
    try:
        return reference_paths(args.ref_prefix, args.num_refs)
    except ValueError as exc:
        parser.error(str(exc))


def _per_instance_problem(path: str) -> str | None:
    """Why ``--per-instance`` cannot be written where asked (a folder, or a file where a folder
    of its path must be), checked before scoring (the scores are not lost at the end), or None."""
    out = Path(path)
    if out.is_dir():
        return f"--per-instance {out}: is a folder (give a file name)"
    for parent in out.parents:
        if parent.exists():  # False below a file (ENOTDIR): the loop reaches that file
            if not parent.is_dir():
                return f"--per-instance {out}: {parent} is a file, not a folder"
            break
    return None


def _write_per_instance(path: str, rows: list[dict]) -> None:
    """The rows as JSON lines, written atomically (a unique temp file beside ``path``, removed on error)."""
    from lora_core.data.nlg import write_text_atomic

    write_text_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lora-eval``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    metrics = args.metrics
    start = time.perf_counter()
    refs = [args.ref] if args.task == "e2e" else _ref_paths(args, parser)
    if args.per_instance:  # written after scoring: it must not be one of the files scored
        same = [p for p in [args.hyp, *refs] if Path(p).resolve() == Path(args.per_instance).resolve()]
        if same:
            print(f"lora-eval: --per-instance {args.per_instance}: is an input ({same[0]}): it would be overwritten; "
                  f"give another path", file=sys.stderr)  # fmt: skip
            return 2
        problem = _per_instance_problem(args.per_instance)
        if problem:
            print(f"lora-eval: {problem}", file=sys.stderr)
            return 2
    try:
        if args.task == "e2e":
            scores = score_e2e(args.ref, args.hyp, per_instance=True, metrics=metrics)
        else:
            scores = score_webnlg(refs, args.hyp, per_instance=True, metrics=metrics)
    except EvalInputError as exc:
        print(f"lora-eval: input error: {exc}", file=sys.stderr)
        return 2
    except JavaUnavailableError as exc:
        print(f"lora-eval: {exc}", file=sys.stderr)
        return 3
    except ValueError as exc:  # unknown metric names
        print(f"lora-eval: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    rows = scores.pop("per_instance")
    if args.json:
        print(json.dumps(scores))
    else:
        print(format_table(args.task, scores, len(rows), seconds))
    if args.per_instance:  # after the scores are printed: a failed write loses none of them
        try:
            _write_per_instance(args.per_instance, rows)
        except OSError as exc:
            print(
                f"lora-eval: --per-instance {args.per_instance}: cannot write it ({exc.strerror or exc})",
                file=sys.stderr,
            )
            return 2
    return 0
