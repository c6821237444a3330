"""Benchmark of the evaluator against the official scorers' run times.

``python -m eval.bench --data-dir ../shared`` times, end to end (files read,
Java started, every metric computed):

- E2E full test set: ``data/e2e/test.txt`` grouped by MR (630 instances,
  4,693 references); hypothesis = the first reference of each MR. The official
  ``measure_scores.py`` takes about 35 s on 2 cores; target < 8 s.
- WebNLG example: ``evalcases/webnlg_ge_example`` (1,862 instances, 4 reference
  files), checked against its ``gold.json``. Official GenerationEval ``eval.py``:
  about 130 s; target < 20 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .e2e import score_e2e
from .webnlg import reference_paths, score_webnlg

__all__ = ["e2e_test_groups", "main"]

OFFICIAL_E2E_S, TARGET_E2E_S = 35.0, 8.0
OFFICIAL_WEBNLG_S, TARGET_WEBNLG_S = 130.0, 20.0


def e2e_test_groups(test_txt: str | os.PathLike) -> tuple[list[str], list[list[str]]]:
    """``MR||text`` lines -> (MRs, references per MR), consecutive equal MRs grouped."""
    mrs: list[str] = []
    refs: list[list[str]] = []
    for line in Path(test_txt).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        mr, text = line.split("||", 1)
        if mrs and mrs[-1] == mr:
            refs[-1].append(text.strip())
        else:
            mrs.append(mr)
            refs.append([text.strip()])
    return mrs, refs


def _cpu() -> float:
    self_, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + children.ru_utime + children.ru_stime


def _time(fn, repeat: int) -> tuple[float, dict]:
    """Best wall time of ``repeat`` runs (CPU seconds and load average are printed)."""
    best, out = float("inf"), {}
    for _ in range(repeat):
        load, cpu, start = os.getloadavg()[0], _cpu(), time.perf_counter()
        out = fn()
        wall = time.perf_counter() - start
        print(f"  run: {wall:.1f} s wall, {_cpu() - cpu:.1f} s CPU (Python + Java), load average {load:.1f}")
        best = min(best, wall)
    return best, out


def bench_e2e(data_dir: Path, repeat: int) -> tuple[float, dict, int]:
    """Time :func:`score_e2e` on the full E2E test set written to temporary files."""
    _, refs = e2e_test_groups(data_dir / "data" / "e2e" / "test.txt")
    with tempfile.TemporaryDirectory() as tmp:
        ref_path, hyp_path = Path(tmp, "ref.txt"), Path(tmp, "hyp.txt")
        ref_path.write_text("\n".join("".join(r + "\n" for r in rs) for rs in refs), encoding="utf-8")
        hyp_path.write_text("".join(rs[0] + "\n" for rs in refs), encoding="utf-8")
        seconds, scores = _time(lambda: score_e2e(ref_path, hyp_path), repeat)
    return seconds, scores, len(refs)


def bench_webnlg(data_dir: Path, repeat: int) -> tuple[float, dict, dict]:
    """Time :func:`score_webnlg` on the WebNLG example case; returns its gold too."""
    case = data_dir / "evalcases" / "webnlg_ge_example"
    gold = json.loads((case / "gold.json").read_text(encoding="utf-8"))
    paths = reference_paths(case / "reference", int(gold["num_refs"]))
    seconds, scores = _time(lambda: score_webnlg(paths, case / "hyp.txt"), repeat)
    return seconds, scores, gold["gold"]


def _warm_cache() -> None:
    """Build the one-time paraphrase index outside the timed runs (and report it)."""
    from .java import find_java, meteor_jar
    from .paraphrase import ensure_index, index_ready

    if find_java() is None:
        return
    table = meteor_jar().parent / "data" / "paraphrase-en.gz"
    if index_ready(table):
        return
    start = time.perf_counter()
    ensure_index(table)
    print(f"one-time METEOR paraphrase index: {time.perf_counter() - start:.1f} s (not in the timings)")


def _row(name: str, n: int, ours: float, official: float, target: float) -> str:
    ok = "ok" if ours < target else "SLOW"
    return f"{name:<28}{n:>6}{ours:>9.1f}{official:>10.0f}{target:>8.0f}{official / ours:>9.1f}x  {ok}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0 (timings are reported, not enforced)."""
    parser = argparse.ArgumentParser(prog="python -m eval.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("LORA_SHARED", "../shared"),
        help="the shared folder holding data/ and evalcases/ (default ../shared)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the best time is shown")
    parser.add_argument("--only", choices=["e2e", "webnlg"], help="run one case only")
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir)
    _warm_cache()
    header = f"{'case':<28}{'n':>6}{'ours s':>9}{'official':>10}{'target':>8}{'speedup':>10}"
    rows = []
    if args.only in (None, "e2e"):
        sec, scores, n = bench_e2e(data_dir, args.repeat)
        rows.append(_row("E2E test set (630 MRs)", n, sec, OFFICIAL_E2E_S, TARGET_E2E_S))
        print("E2E scores:", json.dumps({k: round(v, 4) for k, v in scores.items()}))
    if args.only in (None, "webnlg"):
        sec, scores, gold = bench_webnlg(data_dir, args.repeat)
        rows.append(_row("WebNLG example (4 refs)", 1862, sec, OFFICIAL_WEBNLG_S, TARGET_WEBNLG_S))
        print("WebNLG |ours - gold|:", json.dumps({k: abs(scores[k] - gold[k]) for k in gold}))
    print(header)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
