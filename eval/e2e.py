"""E2E NLG Challenge scores: ``measure_scores.py`` of tuetschek/e2e-metrics, default mode.

BLEU and NIST come from the port of ``mteval-v13a-sig.pl`` (:mod:`eval.mteval`);
METEOR, ROUGE-L and CIDEr follow coco-caption: every text is PTB-tokenised by the
CoreNLP jar (one JVM for all references and hypotheses), then METEOR 1.5 scores
it (:mod:`eval.java`) and ROUGE-L / CIDEr-D are computed here (:mod:`eval.coco`).
METEOR's JVM, the longest step, starts as soon as the PTB tokens are there; BLEU,
NIST, ROUGE-L and CIDEr are computed while it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from .coco import cider_d, rouge_l
from .common import check_instances, per_instance_rows, select_metrics
from .inputs import (
    EvalInputError,
    count_mismatch,
    preview,
    read_e2e_references,
    read_lines,
    refuse_codecs_breaks,
)
from .java import PtbRun, coco_score_line, require_java
from .meteor import MeteorRun
from .mteval import mteval_e2e

__all__ = ["E2E_METRICS", "score_e2e", "score_e2e_lists"]

E2E_METRICS = ("BLEU", "NIST", "METEOR", "ROUGE_L", "CIDEr")
_NEEDS_JAVA = ("METEOR", "ROUGE_L", "CIDEr")


def _clean(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> tuple[list[str], list[list[str]]]:
    """Strip every text (as ``measure_scores.py`` does); references must stay non-empty."""
    hyps = [h.strip() for h in hyps]
    out = []
    for i, rs in enumerate(refs):
        rs = [r.strip() for r in rs]
        if not rs or not all(rs):
            raise EvalInputError(f"E2E instance {i + 1} has no reference or an empty one: {rs!r}")
        out.append(rs)
    return hyps, out


def _split_tokens(tok: list[str], refs: Sequence[Sequence[str]]) -> tuple[list[list[str]], list[str]]:
    """PTB output for ``flat refs + hyps`` -> (references per instance, hypotheses)."""
    ref_tok, pos = [], 0
    for rs in refs:
        ref_tok.append(tok[pos : pos + len(rs)])
        pos += len(rs)
    return ref_tok, tok[pos:]


def score_e2e_lists(
    refs: Sequence[Sequence[str]],
    hyps: Sequence[str],
    *,
    per_instance: bool = False,
    metrics: Iterable[str] | str | None = None,
) -> dict:
    """E2E scores of in-memory texts.

    Args:
        refs: the references of each instance (non-empty texts, at least one each).
        hyps: one hypothesis per instance (may be empty).
        per_instance: also return ``"per_instance"``: one dict per instance with its
            ``index`` and mteval segment BLEU/NIST, METEOR, ROUGE_L and CIDEr.
        metrics: a subset of ``E2E_METRICS`` (default all).

    Returns:
        ``{"BLEU", "NIST", "METEOR", "ROUGE_L", "CIDEr"}`` on the official scales
        (BLEU, METEOR, ROUGE_L 0-1; NIST and CIDEr raw), plus ``"per_instance"``.

    Raises:
        EvalInputError: counts that disagree, no instance, a missing or empty reference.
        JavaUnavailableError: METEOR/ROUGE_L/CIDEr requested but no Java runtime.
    """
    wanted = select_metrics(metrics, E2E_METRICS)
    check_instances(hyps, refs, "E2E")
    hyps, refs = _clean(hyps, refs)
    java_metrics = [m for m in wanted if m in _NEEDS_JAVA]
    java = require_java(java_metrics, ["BLEU", "NIST"]) if java_metrics else None
    found: dict[str, tuple[float, list[float]]] = {}
    ptb = PtbRun(java, [r for rs in refs for r in rs] + hyps) if java else None
    met = None
    try:
        if ptb is not None:  # METEOR's JVM is the long pole: started as soon as the tokens are there
            ref_tok, hyp_tok = _split_tokens(ptb.result(), refs)
            if "METEOR" in wanted:
                met = MeteorRun(java, [coco_score_line(h, rs) for h, rs in zip(hyp_tok, ref_tok, strict=True)])
        if "BLEU" in wanted or "NIST" in wanted:
            mt = mteval_e2e(hyps, refs)
            found["BLEU"], found["NIST"] = (mt.bleu, mt.seg_bleu), (mt.nist, mt.seg_nist)
        if "ROUGE_L" in wanted:
            found["ROUGE_L"] = rouge_l(hyp_tok, ref_tok)
        if "CIDEr" in wanted:
            found["CIDEr"] = cider_d(hyp_tok, ref_tok)
        if met is not None:
            found["METEOR"] = met.result()
    finally:
        if met is not None:
            met.close()
        if ptb is not None:
            ptb.close()
    result: dict = {m: found[m][0] for m in wanted}
    if per_instance:
        result["per_instance"] = per_instance_rows(len(hyps), {m: found[m][1] for m in wanted})
    return result


def score_e2e(
    ref_path: str | os.PathLike,
    hyp_path: str | os.PathLike,
    *,
    per_instance: bool = False,
    metrics: Iterable[str] | str | None = None,
) -> dict:
    """E2E scores of a reference file and a hypothesis file (``measure_scores.py`` layout).

    Args:
        ref_path: references of one instance on consecutive lines, instances separated
            by one empty line (or one reference per line if there is no empty line).
        hyp_path: one hypothesis per line (as ``measure_scores.py`` reads them: a final
            newline or blank line at the end is no reference group or instance, CRLF
            is LF; a lone CR, VT, FF, FS, GS, RS, NEL, U+2028 or U+2029, which its
            ``codecs`` reading takes for a line end, is refused).
        per_instance, metrics: as :func:`score_e2e_lists`.
    """
    refs, starts = read_e2e_references(ref_path)
    hyp_lines = read_lines(hyp_path)
    refuse_codecs_breaks(hyp_path, hyp_lines, "measure_scores.py")
    if len(hyp_lines) != len(refs):
        n = min(len(hyp_lines), len(refs))
        if len(hyp_lines) > len(refs):
            first = f"{hyp_path} line {n + 1}: {preview(hyp_lines[n])}"
        else:
            first = f"{ref_path} instance {n + 1} at line {starts[n]}: {preview(refs[n][0])}"
        unit = (
            "reference groups (separated by empty lines)" if len(starts) < sum(map(len, refs)) else "references (lines)"
        )
        raise count_mismatch(hyp_path, len(hyp_lines), ref_path, len(refs), unit, first)
    return score_e2e_lists(refs, hyp_lines, per_instance=per_instance, metrics=metrics)
