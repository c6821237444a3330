"""One beam-search step's scoring, on the host or on the model's device.

Per step each row's next-token logits are post-processed (CTRL repetition penalty over the
generated tokens, eos banned below ``min_length``, no-repeat n-grams) and the search needs
from each row only its log-sum-exp and its ``kk`` best post-processed logits (by value, then
token id). ``logit_edits`` says on the host what post-processing changes (a few entries per
row), so that a backend can apply it where the logits are:

- host scoring (``host_candidates``): the full logits come to numpy (the CPU path);
- device scoring: a backend applies the same edits to logits left on its device, reduces
  there (log-sum-exp, top ``kk`` plus a margin) and brings back only (rows, kk + margin)
  values; ``resolve_topk`` turns them into exact candidates, asking for a whole row only
  when ties reach past the margin. A GPU then sends a few KB per step instead of the
  (rows, vocab) logits.

Both give ``Candidates``; ``lora_core.generate.beam.BeamSearch`` takes either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TIE_MARGIN = 6  # extra values a device brings back per row to settle ties at the k-th place
SCORING = ("auto", "host", "device")


def scoring_on_device(scoring: str, on_gpu: bool) -> bool:
    """Whether beam search scores on the device: ``scoring`` "device", or "auto" on a GPU
    (on a CPU numpy's blocked ranking beats the frameworks' top-k)."""
    if scoring not in SCORING:
        raise ValueError(f"beam search: unknown scoring {scoring!r}; choose from {', '.join(SCORING)}")
    return scoring == "device" or (scoring == "auto" and on_gpu)


@dataclass(frozen=True)
class LogitEdits:
    """Post-processing of one step's (rows, V) logits: at (``pen_rows``, ``pen_cols``) the
    repetition ``penalty`` (x * p if x < 0 else x / p), then -inf at (``ban_rows``, ``ban_cols``)."""

    penalty: float
    pen_rows: np.ndarray
    pen_cols: np.ndarray
    ban_rows: np.ndarray
    ban_cols: np.ndarray


@dataclass(frozen=True)
class Candidates:
    """Per row: ``cols`` (rows, kk) token ids of its best post-processed logits (value
    descending, then id ascending), ``vals`` (rows, kk) those logits (float32) and ``lse``
    (rows,) the log-sum-exp of the whole post-processed row."""

    cols: np.ndarray
    vals: np.ndarray
    lse: np.ndarray


def banned_ngram_tokens(history: np.ndarray, n: int) -> list[list[int]]:
    """Per row, tokens that would repeat an n-gram already in the row (fairseq)."""
    rows, t = history.shape
    if n <= 0 or t + 1 < n:
        return [[] for _ in range(rows)]
    out = []
    for row in history.tolist():
        prefix = tuple(row[t + 1 - n:]) if n > 1 else ()
        out.append([g[-1] for g in zip(*[row[i:] for i in range(n)]) if tuple(g[:-1]) == prefix])
    return out


def _pairs(per_row: list) -> tuple[np.ndarray, np.ndarray]:
    rows = np.repeat(np.arange(len(per_row), dtype=np.int64), [len(c) for c in per_row])
    cols = np.concatenate([np.asarray(c, dtype=np.int64) for c in per_row]) if len(rows) else rows
    return rows, cols


def logit_edits(history: np.ndarray | None, cur_len: int, n_rows: int, cfg) -> LogitEdits:
    """The post-processing of step ``cur_len`` for ``n_rows`` rows with generated tokens
    ``history`` (rows, t) or None before the first (``cfg``: a ``lora_core.generate.beam.BeamConfig``)."""
    pen: list = [[]] * n_rows
    if history is not None and cfg.repetition_penalty != 1.0:
        pen = [np.unique(row) for row in history]
    bans: list = [[] for _ in range(n_rows)]
    if cur_len < cfg.min_length:
        bans = [list(cfg.stop_ids) for _ in range(n_rows)]
    if history is not None and cfg.no_repeat_ngram_size > 0:
        bans = [b + g for b, g in zip(bans, banned_ngram_tokens(history, cfg.no_repeat_ngram_size))]
    return LogitEdits(float(cfg.repetition_penalty), *_pairs(pen), *_pairs(bans))


def apply_edits(scores: np.ndarray, edits: LogitEdits) -> np.ndarray:
    """``edits`` applied to ``scores`` (rows, V) in place; returns ``scores``."""
    if len(edits.pen_rows):
        s = scores[edits.pen_rows, edits.pen_cols]
        scores[edits.pen_rows, edits.pen_cols] = np.where(s < 0, s * edits.penalty, s / edits.penalty)
    scores[edits.ban_rows, edits.ban_cols] = -np.inf
    return scores


def logsumexp(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """Per-row ``log(sum(exp(x)))`` (max-shifted), shape (rows,); NaN in a row gives NaN.
    ``scratch``: an array of ``x``'s shape and dtype to work in (saves an allocation)."""
    m = x.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0).astype(x.dtype)
    z = np.subtract(x, m, out=scratch)
    np.exp(z, out=z)
    with np.errstate(divide="ignore"):
        return (m + np.log(z.sum(-1, keepdims=True)))[:, 0]


def _n_blocks(n: int, target: int = 64) -> int:
    """A divisor of ``n`` near ``n / target`` (rows then reshape into strided blocks without a copy)."""
    divisors = [d for d in range(max(1, n // 256), n // 16 + 1) if n % d == 0]
    return min(divisors, key=lambda d: abs(n // d - target)) if divisors else 0


def row_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Column indices of the k largest per row, by value descending then index ascending.

    Exact, and faster than ``argpartition`` on wide rows: columns are grouped into ``nb``
    strided blocks (block j = columns j, j + nb, ...); every block whose maximum reaches the
    k-th largest block maximum is kept (k blocks, more on ties), and since any other block
    is beaten by k blocks' maxima, the k largest entries lie in the kept ones.
    """
    rows, n = x.shape
    nb = _n_blocks(n)
    if nb <= k:
        cols = np.broadcast_to(np.arange(n), (rows, n))
    else:
        bmax = x.reshape(rows, n // nb, nb).max(1)  # (rows, nb): max over each strided block
        part = np.argpartition(bmax, nb - k, axis=1)[:, nb - k:]
        kth = np.take_along_axis(bmax, part, 1).min(1)
        counts = (bmax >= kth[:, None]).sum(1)
        if (counts == k).all():  # no ties at the boundary: the argpartition blocks are the kept ones
            blocks = part
        else:  # keep every tied block; rows with fewer repeat their last block (repeats dropped below)
            kept = [np.flatnonzero(bm >= t) for bm, t in zip(bmax, kth)]
            blocks = np.array([np.concatenate([b, np.full(counts.max() - len(b), b[-1])]) for b in kept])
        cols = (blocks[:, :, None] + nb * np.arange(n // nb)).reshape(rows, -1)
    vals = np.take_along_axis(x, cols, 1)
    ranked = np.take_along_axis(cols, np.lexsort((cols, -vals), axis=-1), 1)
    if nb <= k or (counts == k).all():
        return ranked[:, :k]
    out = np.empty((rows, k), dtype=np.int64)
    for r, row in enumerate(ranked):  # drop the repeated columns of filler blocks
        _, first = np.unique(row, return_index=True)
        out[r] = row[np.sort(first)][:k]
    return out


def host_candidates(x: np.ndarray, edits: LogitEdits, kk: int, scratch: np.ndarray | None = None) -> Candidates:
    """Candidates from full float32 logits ``x`` (rows, V), post-processed in place."""
    apply_edits(x, edits)
    lse = logsumexp(x, scratch)
    cols = row_topk(x, kk)
    return Candidates(cols, np.take_along_axis(x, cols, 1), lse)


def resolve_topk(vals: np.ndarray, cols: np.ndarray, lse: np.ndarray, kk: int,
                 full_rows: Callable[[np.ndarray], np.ndarray]) -> Candidates:
    """Exact candidates from a device's top ``m > kk`` per row (``vals``/``cols`` (rows, m),
    values descending, ties in any order). Where the ``m``-th value still equals the
    ``kk``-th, an entry of that value may lie beyond the ``m`` taken: those rows are fetched
    whole (``full_rows(row_ids) -> (n, V)`` post-processed logits) and ranked on the host."""
    vals = np.asarray(vals, dtype=np.float32)
    order = np.lexsort((cols, -vals), axis=-1)  # value descending, then id ascending
    vals, cols = np.take_along_axis(vals, order, 1), np.take_along_axis(np.asarray(cols, dtype=np.int64), order, 1)
    out_cols, out_vals = cols[:, :kk].copy(), vals[:, :kk].copy()
    if vals.shape[1] > kk:
        unsure = np.flatnonzero(vals[:, kk - 1] == vals[:, -1])
        if len(unsure):
            whole = np.asarray(full_rows(unsure), dtype=np.float32)
            out_cols[unsure] = row_topk(whole, kk)
            out_vals[unsure] = np.take_along_axis(whole, out_cols[unsure], 1)
    return Candidates(out_cols, out_vals, np.asarray(lse, dtype=np.float32))
