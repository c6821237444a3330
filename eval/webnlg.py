"""WebNLG and DART scores: GenerationEval's ``eval.py -m bleu,meteor,ter,chrf++``.

As the LoRA paper ran it (microsoft/LoRA ``examples/NLG/eval``):

- BLEU: ``multi-bleu-detok.perl`` on the raw texts (:func:`eval.mteval.multi_bleu_detok`), 0-100;
- METEOR: METEOR 1.5 (``-l en -norm``, all N references per instance, empty ones
  included) on nltk-3.5-tokenised texts (:mod:`eval.wordtok`); the corpus score
  from the aggregated statistics ("Final score"), 0-1;
- TER: pyter on the tokenised texts, minimum over references, mean (:mod:`eval.ter`);
- chrF++: Popović's chrF.py, c6+w2, beta 2, on the raw texts (:mod:`eval.chrf`), 0-1.

Files: one hypothesis per line; reference file k holds reference k of every
instance (an empty line where an instance has fewer references). Unlike
``eval.py``, a final newline does not add an empty instance, and files of
different lengths are an error rather than a silent shift.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .chrf import chrf_plus_plus
from .common import check_instances, per_instance_rows, select_metrics
from .inputs import EvalInputError, count_mismatch, preview, read_lines, transpose_references
from .java import require_java
from .meteor import MeteorRun, meteor_files
from .mteval import multi_bleu_detok
from .ter import ter_multi

__all__ = ["WEBNLG_METRICS", "score_webnlg", "score_webnlg_lists", "score_dart", "score_dart_lists", "reference_paths"]

WEBNLG_METRICS = ("BLEU", "METEOR", "TER", "chrF++")


def _tokenize_all(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> tuple[list[str], list[list[str]]]:
    """``' '.join(nltk.word_tokenize(x))`` of every text (each distinct text once)."""
    from .wordtok import word_tokenize  # imports nltk: only when needed

    cache: dict[str, str] = {}

    def tok(text: str) -> str:
        out = cache.get(text)
        if out is None:
            out = cache[text] = " ".join(word_tokenize(text))
        return out

    return [tok(h) for h in hyps], [[tok(r) for r in rs] for rs in refs]


class _FileMeteor:
    """METEOR in file mode (for texts containing ``|||``, the ``-stdio`` field separator)."""

    def __init__(self, java: str, hyp_tok: list[str], ref_tok: list[list[str]]):
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._future = self._pool.submit(meteor_files, java, hyp_tok, ref_tok)

    def result(self) -> tuple[float, list[float]]:
        return self._future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _start_meteor(java: str, hyp_tok: list[str], ref_tok: list[list[str]]):
    if any("|||" in t for t in hyp_tok) or any("|||" in r for rs in ref_tok for r in rs):
        return _FileMeteor(java, hyp_tok, ref_tok)
    return MeteorRun(
        java, ["SCORE ||| " + " ||| ".join(rs) + " ||| " + h for h, rs in zip(hyp_tok, ref_tok, strict=True)]
    )


def score_webnlg_lists(
    refs: Sequence[Sequence[str]],
    hyps: Sequence[str],
    *,
    per_instance: bool = False,
    metrics: Iterable[str] | str | None = None,
) -> dict:
    """WebNLG/DART scores of in-memory texts.

    Args:
        refs: for each instance, its N references in reference-file order; use ``""``
            for a missing one (every instance should have the same N, as in the files).
        hyps: one hypothesis per instance.
        per_instance: also return ``"per_instance"``: per instance its ``index``,
            sentence BLEU (multi-bleu formula, 0-100), METEOR segment score, TER and
            sentence chrF++ (None where all references are blank).
        metrics: a subset of ``WEBNLG_METRICS`` (default all).

    Returns:
        ``{"BLEU" (0-100), "METEOR", "TER", "chrF++" (0-1)}``, plus ``"per_instance"``.

    Raises:
        EvalInputError: counts that disagree or no instance.
        JavaUnavailableError: METEOR requested but no Java runtime.
    """
    wanted = select_metrics(metrics, WEBNLG_METRICS)
    check_instances(hyps, refs, "WebNLG/DART")
    hyps = [h.rstrip("\r") for h in hyps]
    refs = [[r.rstrip("\r") for r in rs] for rs in refs]
    java = require_java(["METEOR"], ["BLEU", "TER", "chrF++"]) if "METEOR" in wanted else None
    found: dict = {}
    met = None
    try:
        if "METEOR" in wanted or "TER" in wanted:
            hyp_tok, ref_tok = _tokenize_all(hyps, refs)
            if java is not None:  # the JVM scores while the other metrics are computed
                met = _start_meteor(java, hyp_tok, ref_tok)
            if "TER" in wanted:
                per = [ter_multi(h, rs) for h, rs in zip(hyp_tok, ref_tok, strict=True)]
                found["TER"] = (sum(per) / len(per), per)
        if "BLEU" in wanted:
            found["BLEU"] = multi_bleu_detok(hyps, refs)
        if "chrF++" in wanted:
            found["chrF++"] = chrf_plus_plus(hyps, refs)
        if met is not None:
            found["METEOR"] = met.result()
    finally:
        if met is not None:
            met.close()
    result: dict = {m: found[m][0] for m in wanted}
    if per_instance:
        result["per_instance"] = per_instance_rows(len(hyps), {m: found[m][1] for m in wanted})
    return result


def reference_paths(prefix: str | os.PathLike, num_refs: int) -> list[Path]:
    """``prefix0 .. prefix{N-1}`` (GenerationEval's ``-R prefix -nr N``).

    With N = 1, GenerationEval reads ``prefix`` itself; ``prefix0`` is used when it
    exists (our decode step writes it), else ``prefix``.
    """
    if num_refs < 1:
        raise ValueError(f"num_refs must be >= 1, got {num_refs}")
    prefix = str(prefix)
    if num_refs == 1 and not Path(prefix + "0").exists() and Path(prefix).exists():
        return [Path(prefix)]
    return [Path(f"{prefix}{i}") for i in range(num_refs)]


def _read_webnlg(ref_paths: Sequence[str | os.PathLike], hyp_path) -> tuple[list[list[str]], list[str]]:
    if not ref_paths:
        raise EvalInputError("no reference file given")
    columns = [read_lines(p) for p in ref_paths]
    refs = transpose_references(ref_paths, columns)
    hyps = read_lines(hyp_path)
    if len(hyps) != len(refs):
        n = min(len(hyps), len(refs))
        if len(hyps) > len(refs):
            first = f"{hyp_path} line {n + 1}: {preview(hyps[n])}"
        else:
            first = f"{ref_paths[0]} line {n + 1}: {preview(columns[0][n])}"
        raise count_mismatch(hyp_path, len(hyps), ref_paths[0], len(refs), "lines", first)
    return refs, hyps


def score_webnlg(
    ref_paths: Sequence[str | os.PathLike],
    hyp_path: str | os.PathLike,
    *,
    per_instance: bool = False,
    metrics: Iterable[str] | str | None = None,
) -> dict:
    """WebNLG scores of reference files ``reference0..N-1`` and a hypothesis file.

    Args:
        ref_paths: the N reference files (see :func:`reference_paths`).
        hyp_path: one hypothesis per line.
        per_instance, metrics: as :func:`score_webnlg_lists`.
    """
    refs, hyps = _read_webnlg(ref_paths, hyp_path)
    return score_webnlg_lists(refs, hyps, per_instance=per_instance, metrics=metrics)


score_dart = score_webnlg
score_dart_lists = score_webnlg_lists
