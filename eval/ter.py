"""TER as WebNLG's GenerationEval computes it: ``pyter.ter`` (PyPI ``pyter3`` 0.3).

pyter's algorithm, reproduced decision for decision:

1. ``pre`` = Levenshtein distance (unit costs, on words) of hypothesis and reference.
2. Candidate shifts: for every hypothesis position ``i1`` and reference position
   ``i2 != i1`` whose words are equal, the maximal run ``L`` of equal words from
   there; the block ``hyp[i1:i1+L]`` is cut out and inserted at index ``i2`` of
   what remains (appended when ``i2`` is past its end).
3. The candidate with the largest ``pre - distance(candidate)`` wins; ties go to
   the candidate whose word list is largest in Python's list order (pyter sorts
   ``(gain, words)`` tuples and takes the last). If the gain is positive, the
   shift is applied, counted as one edit, and step 1 repeats.
4. TER = (shifts + final distance) / reference length.

GenerationEval scores each instance by the minimum over its references (an empty
reference scores 1) and averages over instances.

pyter recomputes a quadratic table for every candidate; here each distance is the
bit-parallel Levenshtein algorithm of Myers (1999) in Hyyrö's (2001) global
form, restarted from the cached state of the longest prefix a candidate shares
with the current hypothesis. Results are identical.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

__all__ = ["ter", "ter_multi"]


class _Ref:
    """Bit masks of the reference words for the bit-parallel distance."""

    def __init__(self, words: Sequence[str]):
        self.m = len(words)
        self.mask = (1 << self.m) - 1
        self.top = 1 << (self.m - 1)
        self.peq: dict[str, int] = {}
        self.pos: dict[str, list[int]] = {}
        for i, w in enumerate(words):
            self.peq[w] = self.peq.get(w, 0) | (1 << i)
            self.pos.setdefault(w, []).append(i)
        self.words = list(words)

    def run(self, state: tuple[int, int, int], words: Sequence[str]) -> tuple[int, int, int]:
        """Advance the (VP, VN, distance) state over ``words``."""
        vp, vn, score = state
        peq, mask, top = self.peq, self.mask, self.top
        for w in words:
            x = peq.get(w, 0) | vn
            d0 = (((x & vp) + vp) ^ vp) | x
            hp = vn | (~(d0 | vp) & mask)
            hn = vp & d0
            if hp & top:
                score += 1
            elif hn & top:
                score -= 1
            x = ((hp << 1) | 1) & mask
            vp = ((hn << 1) | ~(d0 | x)) & mask
            vn = x & d0
        return vp, vn, score

    def prefix_states(self, words: Sequence[str]) -> list[tuple[int, int, int]]:
        """States after ``words[:k]`` for every k (distance to the whole reference)."""
        states = [(self.mask, 0, self.m)]
        for w in words:
            states.append(self.run(states[-1], (w,)))
        return states


def _runs(hyp: Sequence[str], ref: _Ref):
    """pyter ``_findpairs``: (i1, i2, maximal run length) for equal words, i1 != i2."""
    n, m, rwords = len(hyp), ref.m, ref.words
    for i1, w in enumerate(hyp):
        for i2 in ref.pos.get(w, ()):
            if i1 == i2:
                continue
            length = 1
            while i1 + length < n and i2 + length < m and hyp[i1 + length] == rwords[i2 + length]:
                length += 1
            yield i1, i2, length


def _best_shift(hyp: list[str], ref: _Ref, states) -> tuple[int, list[str] | None]:
    """The winning (gain, shifted words) of one pyter ``_shift`` round."""
    pre = states[-1][2]
    best_gain, best = None, None
    for i1, i2, length in _runs(hyp, ref):
        block = hyp[i1 : i1 + length]
        if i2 < i1:  # candidate = hyp[:i2] + tail
            start, tail = i2, block + hyp[i2:i1] + hyp[i1 + length :]
        else:  # block re-inserted at index `ins` of hyp without it
            ins = min(i2, len(hyp) - length)
            start, tail = i1, hyp[i1 + length : ins + length] + block + hyp[ins + length :]
        gain = pre - ref.run(states[start], tail)[2]
        if best_gain is None or gain >= best_gain:
            cand = hyp[:start] + tail
            if best_gain is None or gain > best_gain or cand > best:
                best_gain, best = gain, cand
    return (0, None) if best_gain is None else (best_gain, best)


def ter(hyp: Sequence[str], ref: Sequence[str]) -> float:
    """``pyter.ter(hyp, ref)`` on word lists; ZeroDivisionError for an empty reference.

    Args:
        hyp: hypothesis words.
        ref: reference words.
    """
    if not ref:
        raise ZeroDivisionError("empty reference")
    r = _Ref(ref)
    words = list(hyp)
    shifts = 0
    while True:
        states = r.prefix_states(words)
        gain, shifted = _best_shift(words, r, states)
        if gain <= 0:
            return (shifts + states[-1][2]) / r.m
        shifts += 1
        words = shifted


def _lower_bound(bag: Counter, n: int, rwords: list[str]) -> float:
    common = sum((bag & Counter(rwords)).values())
    return (max(n, len(rwords)) - common) / len(rwords)


def ter_multi(hyp: str, refs: Sequence[str]) -> float:
    """GenerationEval ``ter_score`` for one instance: min over references of pyter TER.

    A reference is skipped when it cannot lower the minimum: shifts only reorder the
    hypothesis, so TER >= (max(n, m) - |bag(hyp) & bag(ref)|) / m.

    Args:
        hyp: tokenised hypothesis (tokens joined by spaces).
        refs: tokenised references; an empty one scores 1.
    """
    words = hyp.split()
    bag = Counter(words)
    best = None
    for ref in refs:
        if len(ref) == 0:
            score = 1.0
        else:
            rwords = ref.split()
            if not rwords:  # pyter raises ZeroDivisionError, GenerationEval catches: 1
                score = 1.0
            elif best is not None and _lower_bound(bag, len(words), rwords) >= best:
                continue
            else:
                score = ter(words, rwords)
        best = score if best is None else min(best, score)
    return 1.0 if best is None else best
