"""chrF++ as WebNLG's GenerationEval computes it (Popović's ``chrF.py``, c6+w2, beta 2).

Behaviour reproduced from GenerationEval's ``metrics/chrF.py`` and the way
``eval.py`` calls it:

- instances whose references are all blank are dropped (hypothesis included),
  and blank references are dropped from the others;
- characters: the stripped line with ASCII spaces removed, n = 1..6; words: the
  stripped line split on whitespace, with one leading *or* trailing
  ``string.punctuation`` character split off words longer than one character,
  n = 1..2;
- per sentence and reference, an order contributes F-beta of its precision and
  recall only if it has a matching n-gram; the sentence score is the sum over
  the 8 orders divided by 8; the first reference with the strictly best sentence
  score is kept, and its match, reference and hypothesis counts are added to the
  corpus totals (hypothesis counts only for the orders that the kept reference
  has: a quirk of ``ngram_matches``);
- corpus chrF++ = mean over the 8 orders of F-beta from the summed counts, with
  chrF.py's 1e-16 stand-ins for empty counts.
"""

from __future__ import annotations

import string
from collections import Counter
from collections.abc import Sequence

__all__ = ["chrf_plus_plus"]

_PUNCT = frozenset(string.punctuation)
_NCHAR, _NWORD, _BETA = 6, 2, 2.0


def _words(line: str) -> list[str]:
    out: list[str] = []
    for w in line.strip().split():
        if len(w) == 1:
            out.append(w)
        elif w[-1] in _PUNCT:
            out += [w[:-1], w[-1]]
        elif w[0] in _PUNCT:
            out += [w[0], w[1:]]
        else:
            out.append(w)
    return out


def _counts(seq: Sequence, order: int, as_str: bool) -> list[Counter]:
    """n-gram counts per order for the orders that occur (shorter input: fewer orders)."""
    out = []
    for n in range(1, min(order, len(seq)) + 1):
        if as_str:
            out.append(Counter(seq[i : i + n] for i in range(len(seq) - n + 1)))
        else:
            out.append(Counter(zip(*(seq[i:] for i in range(n)), strict=False)))
    return out


def _stats(ref: list[Counter], hyp: list[Counter]) -> list[tuple[float, float, float]]:
    """chrF.py ``ngram_matches``: (match, ref total, hyp total) for each order of ``ref``."""
    out = []
    for n, rc in enumerate(ref):
        hc = hyp[n] if n < len(hyp) else Counter()
        match = sum(min(c, hc[g]) for g, c in rc.items() if g in hc)
        out.append((float(match), float(sum(rc.values())), float(sum(hc.values()))))
    return out


def _f(match: float, ref_total: float, hyp_total: float) -> float:
    """chrF.py ``ngram_precrecf`` for one order."""
    prec = match / hyp_total if hyp_total > 0 else 1e-16
    rec = match / ref_total if ref_total > 0 else 1e-16
    denom = _BETA**2 * prec + rec
    return (1 + _BETA**2) * prec * rec / denom if denom > 0 else 1e-16


def _sentence_f(stats: list[tuple[float, float, float]]) -> float:
    # only orders with a match exist in chrF.py's dicts; a missing order adds nothing
    return sum(_f(*s) for s in stats if s[0] > 0)


def chrf_plus_plus(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> tuple[float, list[float | None]]:
    """Corpus chrF++ (0-1) and the per-instance best sentence chrF++ (None: no reference).

    Args:
        hyps: raw hypotheses.
        refs: raw references of each instance (blank ones are ignored).
    """
    norder = float(_NCHAR + _NWORD)
    tot_c = [[0.0, 0.0, 0.0] for _ in range(_NCHAR)]
    tot_w = [[0.0, 0.0, 0.0] for _ in range(_NWORD)]
    per: list[float | None] = []
    for hyp, rs in zip(hyps, refs, strict=True):
        kept = [r for r in rs if r.strip() != ""]
        if not kept:
            per.append(None)
            continue
        # eval.py joins the kept references with '*#' and chrF.py splits them again
        kept = "*#".join(kept).split("*#")
        h_c = _counts(hyp.strip().replace(" ", ""), _NCHAR, True)
        h_w = _counts(_words(hyp), _NWORD, False)
        best_f, best = -1.0, None
        for ref in kept:
            s_c = _stats(_counts(ref.strip().replace(" ", ""), _NCHAR, True), h_c)
            s_w = _stats(_counts(_words(ref), _NWORD, False), h_w)
            f = (_sentence_f(s_c) + _sentence_f(s_w)) / norder
            if f > best_f:
                best_f, best = f, (s_c, s_w)
        per.append(best_f)
        for tot, stats in zip((tot_c, tot_w), best, strict=True):
            for n, s in enumerate(stats):
                for k in range(3):
                    tot[n][k] += s[k]
    if not any(p is not None for p in per):
        return 0.0, per
    total = sum(_f(*t) for t in tot_c) + sum(_f(*t) for t in tot_w)
    return total / norder, per
