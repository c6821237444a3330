"""ROUGE-L and CIDEr-D as coco-caption (``pycocoevalcap``) computes them.

Inputs are PTB-tokenised strings (see :func:`eval.java.ptb_tokenize`).

- ROUGE-L (``rouge/rouge.py``): tokens by ``split(" ")`` (an empty string is one
  empty token), LCS with every reference, the maximum precision and the maximum
  recall taken separately over references, F with beta 1.2, mean over instances.
  The LCS length is computed with the bit-parallel algorithm of Allison and Dix
  (1986) / Hyyrö (2004) instead of coco's quadratic table; the value is the same.
- CIDEr-D (``cider/cider_scorer.py``): n = 1..4, tf-idf vectors with document
  frequencies over the references of the whole test set and ``log(#instances)``
  as the reference length, clipped cosine similarity, Gaussian length penalty
  (sigma 6) on the difference of the *bigram* counts (coco's quirk), mean over n,
  divided by the number of references, times 10, mean over instances.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

__all__ = ["lcs_length", "rouge_l", "cider_d"]

_BETA = 1.2
_SIGMA = 6.0


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token lists (bit-parallel)."""
    if len(a) < len(b):
        a, b = b, a
    masks: dict = {}
    for i, tok in enumerate(b):
        masks[tok] = masks.get(tok, 0) | (1 << i)
    full = (1 << len(b)) - 1
    v = full
    for tok in a:
        u = v & masks.get(tok, 0)
        v = ((v + u) | (v - u)) & full
    return len(b) - v.bit_count()


def _rouge_one(cand: str, refs: Sequence[str]) -> float:
    tok_c = cand.split(" ")
    prec, rec = [], []
    for ref in refs:
        tok_r = ref.split(" ")
        lcs = lcs_length(tok_r, tok_c)
        prec.append(lcs / float(len(tok_c)))
        rec.append(lcs / float(len(tok_r)))
    p, r = max(prec), max(rec)
    if p != 0 and r != 0:
        return ((1 + _BETA**2) * p * r) / float(r + _BETA**2 * p)
    return 0.0


def rouge_l(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> tuple[float, list[float]]:
    """coco-caption ROUGE-L: ``(mean, per_instance)``.

    Args:
        hyps: tokenised hypotheses.
        refs: tokenised references of each instance (at least one each).
    """
    scores = [_rouge_one(h, rs) for h, rs in zip(hyps, refs, strict=True)]
    return (float(np.mean(np.array(scores))) if scores else 0.0), scores


def _precook(text: str) -> list[Counter]:
    """coco ``precook``: the counts of the n-grams of ``text``, one Counter per order n = 1..4."""
    words = text.split()
    return [Counter(zip(*(words[i:] for i in range(n)))) for n in range(1, 5)]


def _vec(counts: list[Counter], df: dict, ref_len: float) -> tuple[list[dict], list[float], int]:
    """coco ``counts2vec``: tf-idf per order, norms, and the bigram count ("length")."""
    vec, norm = [], []
    get = df.get
    for c in counts:
        # df holds log(max(1, document frequency)); tf * (...) is float(tf) * (...)
        v = {gram: tf * (ref_len - get(gram, 0.0)) for gram, tf in c.items()}
        total = 0.0  # summed in coco's order
        for w in v.values():
            total += w * w
        vec.append(v)
        norm.append(math.sqrt(total))
    return vec, norm, sum(counts[1].values())


def _sim(hyp: tuple, ref: tuple) -> list[float]:
    """coco ``sim``: clipped cosine per order times the Gaussian length penalty."""
    vec_h, norm_h, len_h = hyp
    vec_r, norm_r, len_r = ref
    delta = float(len_h - len_r)
    penalty = math.e ** (-(delta**2) / (2 * _SIGMA**2))
    val = [0.0, 0.0, 0.0, 0.0]
    for n in range(4):
        vr_n = vec_r[n]
        acc = 0.0  # n-grams missing from the reference add 0.0 (all weights are >= 0)
        for gram, wh in vec_h[n].items():
            wr = vr_n.get(gram)
            if wr is not None:
                acc += (wh if wh < wr else wr) * wr
        if norm_h[n] != 0 and norm_r[n] != 0:
            acc /= norm_h[n] * norm_r[n]
        val[n] = acc * penalty
    return val


def cider_d(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> tuple[float, list[float]]:
    """coco-caption CIDEr-D: ``(mean, per_instance)``.

    Args:
        hyps: tokenised hypotheses.
        refs: tokenised references of each instance (at least one each).
    """
    if not hyps:
        return 0.0, []
    crefs = [[_precook(r) for r in rs] for rs in refs]
    counts: dict = {}
    for rs in crefs:
        for gram in {g for c in rs for order in c for g in order}:
            counts[gram] = counts.get(gram, 0) + 1
    log_df = {g: math.log(max(1.0, float(c))) for g, c in counts.items()}
    ref_len = math.log(float(len(crefs)))
    scores = []
    for hyp, rs in zip(hyps, crefs, strict=True):
        vh = _vec(_precook(hyp), log_df, ref_len)
        score = [0.0, 0.0, 0.0, 0.0]
        for rc in rs:
            score = [a + b for a, b in zip(score, _sim(vh, _vec(rc, log_df, ref_len)), strict=True)]
        scores.append(sum(score) / 4 / len(rs) * 10.0)
    return float(np.mean(np.array(scores))), scores
