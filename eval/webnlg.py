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
``eval.py``, a final newline does not add an empty instance. Reference files of
different lengths are an error rather than a silent shift, except where ``eval.py``
aligns them (a file one line short that alone ends with a newline: an empty last
reference, as in DART's reference files; :func:`eval.inputs.align_reference_files`).

``eval.py`` hands chrF.py its texts through temporary files that chrF.py reads with
Python's ``codecs`` line splitting, which also breaks lines at a lone CR (the CR of a
CRLF reference joined to the next one with ``*#``), VT, FF, FS, GS, RS, NEL, U+2028 and
U+2029, and so shifts every later instance. Texts that would be split there are
refused when chrF++ is requested (:func:`eval.inputs.codecs_line_break`); with LF
files and ordinary text nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .chrf import chrf_plus_plus
from .common import check_instances, per_instance_rows, select_metrics
from .inputs import (
    EvalInputError,
    align_reference_files,
    codecs_line_break,
    count_mismatch,
    preview,
    read_line_file,
)
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


def _ter_all(hyp_tok: list[str], ref_tok: list[list[str]]) -> list[float]:
    """TER of every instance, each distinct (hypothesis, references) once (DART repeats some)."""
    cache: dict[tuple, float] = {}
    out = []
    for h, rs in zip(hyp_tok, ref_tok, strict=True):
        key = (h, *rs)
        if key not in cache:
            cache[key] = ter_multi(h, rs)
        out.append(cache[key])
    return out


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


def _chrf_split_error(hyps: Sequence[str], refs: Sequence[Sequence[str | None]], where) -> EvalInputError | None:
    """The error for a text that chrF.py's ``codecs`` reading would split (None: none).

    As ``eval.py`` writes them: the hypotheses of instances with a non-blank reference,
    one per line; their non-blank references joined by ``*#``, one instance per line. A
    CR right before a newline (CRLF) is no break; one before ``*#`` is.
    """
    for i, (hyp, rs) in enumerate(zip(hyps, refs, strict=True)):
        kept = [(k, r) for k, r in enumerate(rs) if r is not None and r.strip() != ""]
        if not kept:
            continue
        texts = [(None, hyp[:-1] if hyp.endswith("\r") else hyp)]
        texts += [(k, r if j < len(kept) - 1 else r[:-1] if r.endswith("\r") else r) for j, (k, r) in enumerate(kept)]
        for k, text in texts:
            found = codecs_line_break(text)
            if found is not None:
                return EvalInputError(
                    f"{where(i, k)} contains {found}: GenerationEval's chrF++ reads eval.py's files of "
                    f"hypotheses and '*#'-joined references with Python's codecs line splitting, which "
                    f"breaks the line there and shifts every later instance; convert CRLF files to LF line "
                    f"ends and remove other such characters, or leave chrF++ out (--metrics BLEU,METEOR,TER)"
                )
    return None


def _list_where(i: int, k: int | None) -> str:
    return f"hypothesis {i + 1}" if k is None else f"reference {k + 1} of instance {i + 1}"


def score_webnlg_lists(
    refs: Sequence[Sequence[str | None]],
    hyps: Sequence[str],
    *,
    per_instance: bool = False,
    metrics: Iterable[str] | str | None = None,
) -> dict:
    """WebNLG/DART scores of in-memory texts.

    Args:
        refs: for each instance, its N references in reference-file order; use ``""``
            for an empty line of a reference file (every instance should have the same
            N, as in the files) and None where a file has no line for the instance (its
            last line, when the file is one line short and ends with a newline: empty
            for METEOR, TER and chrF++, absent for multi-bleu-detok; see
            :func:`eval.inputs.align_reference_files`).
        hyps: one hypothesis per instance.
        per_instance: also return ``"per_instance"``: per instance its ``index``,
            sentence BLEU (multi-bleu formula, 0-100), METEOR segment score, TER and
            sentence chrF++ (None where all references are blank).
        metrics: a subset of ``WEBNLG_METRICS`` (default all).

    Returns:
        ``{"BLEU" (0-100), "METEOR", "TER", "chrF++" (0-1)}``, plus ``"per_instance"``.

    Raises:
        EvalInputError: counts that disagree, no instance, or (with chrF++) a text that
            GenerationEval's chrF++ would split into two lines.
        JavaUnavailableError: METEOR requested but no Java runtime.
    """
    return _score(refs, hyps, per_instance, metrics, _list_where)


def _score(refs: Sequence[Sequence[str | None]], hyps: Sequence[str], per_instance: bool, metrics, where) -> dict:
    """:func:`score_webnlg_lists`; ``where(i, k)`` names hypothesis (k None) or reference k
    of instance i in error messages."""
    wanted = select_metrics(metrics, WEBNLG_METRICS)
    check_instances(hyps, refs, "WebNLG/DART")
    if "chrF++" in wanted:
        error = _chrf_split_error(hyps, refs, where)
        if error is not None:
            raise error
    hyps = [h.rstrip("\r") for h in hyps]
    bleu_refs = [[r if r is None else r.rstrip("\r") for r in rs] for rs in refs]
    refs = [["" if r is None else r for r in rs] for rs in bleu_refs]
    java = require_java(["METEOR"], ["BLEU", "TER", "chrF++"]) if "METEOR" in wanted else None
    found: dict = {}
    met = None
    try:
        if "METEOR" in wanted or "TER" in wanted:
            hyp_tok, ref_tok = _tokenize_all(hyps, refs)
            if java is not None:  # the JVM scores while the other metrics are computed
                met = _start_meteor(java, hyp_tok, ref_tok)
            if "TER" in wanted:
                per = _ter_all(hyp_tok, ref_tok)
                found["TER"] = (sum(per) / len(per), per)
        if "BLEU" in wanted:
            found["BLEU"] = multi_bleu_detok(hyps, bleu_refs)
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


def _read_webnlg(ref_paths: Sequence[str | os.PathLike], hyp_path) -> tuple[list[list[str | None]], list[str]]:
    """References per instance (:func:`align_reference_files`) and hypotheses of the files."""
    files = [read_line_file(p) for p in ref_paths]
    refs = align_reference_files(files)
    hyps = read_line_file(hyp_path).lines
    longest = next(f for f in files if len(f.lines) == len(refs))
    if len(hyps) != len(refs):
        n = min(len(hyps), len(refs))
        if len(hyps) > len(refs):
            first = f"{hyp_path} line {n + 1}: {preview(hyps[n])}"
        else:
            first = f"{longest.path} line {n + 1}: {preview(longest.lines[n])}"
        raise count_mismatch(hyp_path, len(hyps), longest.path, len(refs), "lines", first)
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

    def where(i: int, k: int | None) -> str:
        return f"{hyp_path if k is None else ref_paths[k]} line {i + 1}"

    return _score(refs, hyps, per_instance, metrics, where)


score_dart = score_webnlg
score_dart_lists = score_webnlg_lists
