"""Beam search bookkeeping in numpy, shared by the backends (semantics of the LoRA paper's
``examples/NLG/src/gpt2_beam.py``; banned n-grams after fairseq, repetition penalty after CTRL).

Per step, for each of ``B * beam`` rows: the backend gives next-token logits; here they are
post-processed (CTRL repetition penalty over the generated tokens, eos banned below
``min_length``, no-repeat n-grams over the generated tokens), turned into log-probs and
added to the beam scores; the top ``beam`` of ``beam * vocab`` candidates continue (at the
first step only beam 0 counts, since all beams hold the same prompt). A beam whose last
token is a stop id becomes a candidate with score ``sum_logp / len ** length_penalty``
(``len`` counts generated tokens including the stop token) and its score becomes -inf.
After ``max_new_tokens`` steps the live beams are candidates too. The loop stops early
only when every beam of every input is finished (-inf), which cannot change the result.

The prompt is processed once per input (left-padded batch with an attention mask, so each
row equals its prompt alone) and the cache is then repeated ``beam`` times; the paper code
runs the padded prompt ``beam`` times and lets generated tokens attend to padding.

A step's scoring (post-processing, log-sum-exp, each row's best candidates) lives in
``lora_core.generate.beam_scoring``, on the host or on the backend's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .beam_scoring import Candidates, apply_edits, banned_ngram_tokens, host_candidates, logit_edits, row_topk

__all__ = ["BeamConfig", "BeamSearch", "banned_ngram_tokens", "beam_search_batched", "compose_rows", "left_pad",
           "postprocess", "row_topk", "run_beam_search"]


@dataclass(frozen=True)
class BeamConfig:
    """Beam settings (paper: beam 10, no-repeat 4-grams, max 64 new tokens, eos {50256, 628})."""

    beam: int = 10
    max_new_tokens: int = 64
    length_penalty: float = 1.0
    no_repeat_ngram_size: int = 4
    repetition_penalty: float = 1.0
    min_length: int = 0
    stop_ids: tuple[int, ...] = (50256, 628)

    def __post_init__(self):
        if self.beam < 1 or self.max_new_tokens < 1:
            raise ValueError(f"BeamConfig needs beam >= 1 and max_new_tokens >= 1, got {self.beam}, {self.max_new_tokens}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"BeamConfig.repetition_penalty must be > 0, got {self.repetition_penalty!r}")


def postprocess(logits: np.ndarray, history: np.ndarray | None, cur_len: int, cfg: BeamConfig) -> np.ndarray:
    """Repetition penalty, min-length eos ban and no-repeat n-grams, on a float32 copy."""
    return apply_edits(np.array(logits, dtype=np.float32), logit_edits(history, cur_len, len(logits), cfg))


class BeamSearch:
    """State of a batched beam search over ``batch_size`` inputs (rows are input-major)."""

    def __init__(self, batch_size: int, cfg: BeamConfig):
        self.B, self.cfg, self.k = batch_size, cfg, cfg.beam
        self.scores = np.zeros((batch_size, cfg.beam))
        self.history: np.ndarray | None = None  # (B*beam, t) generated tokens
        self.best_score = [-np.inf] * batch_size
        self.best: list[list[int] | None] = [None] * batch_size
        self.step_index = 0
        self._scratch: np.ndarray | None = None  # host scoring's work array

    @property
    def done(self) -> bool:
        return self.step_index >= self.cfg.max_new_tokens or (self.step_index > 0 and np.isneginf(self.scores).all())

    def step(self, logits, overwrite: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Advance one token. ``logits``: (B*beam, V) for each row's next token, a numpy array
        (host scoring; float32 logits are post-processed in place when ``overwrite``) or a
        backend's device logits (an object with ``shape`` and ``candidates(edits, kk)``,
        see ``lora_core.generate.beam_scoring``).

        Returns:
            ``(rows, tokens)``: for each new row, the old row it continues (reorder the
            cache with it) and the token it appends, both (B*beam,) int64.
        """
        V = logits.shape[-1]
        if V < self.k:  # the first step has V candidates for the k beams
            raise ValueError(f"beam {self.k} is larger than the vocabulary ({V} tokens): choose beam <= {V}")
        edits = logit_edits(self.history, self.step_index, logits.shape[0], self.cfg)
        if hasattr(logits, "candidates"):
            cand = logits.candidates(edits, self.k)
        else:
            x = logits if overwrite and logits.dtype == np.float32 else np.array(logits, dtype=np.float32)
            if self._scratch is None or self._scratch.shape != x.shape:
                self._scratch = np.empty_like(x)
            cand = host_candidates(x, edits, self.k, self._scratch)
        if np.isnan(cand.lse).any():
            raise FloatingPointError(f"beam search step {self.step_index}: the model returned NaN logits "
                                     f"(rows {np.flatnonzero(np.isnan(cand.lse))[:10].tolist()})")
        return self._advance(cand, V)

    def _advance(self, cand: Candidates, V: int) -> tuple[np.ndarray, np.ndarray]:
        B, k = self.B, self.k
        if self.step_index == 0:  # all beams hold the same prompt: candidates of beam 0 only
            index = cand.cols[::k]  # (B, k) tokens
            scores = (cand.vals[::k] - cand.lse[::k, None]).astype(np.float64)
        else:  # the global top k of beam x vocab is among each beam's own top k
            logp = cand.vals - cand.lse[:, None]
            scores = (self.scores.reshape(-1, 1) + logp).reshape(B, -1)
            index = (cand.cols + (np.arange(B * k) % k)[:, None] * V).reshape(B, -1)
        top = _topk(scores, index, k)  # (B, k) positions in scores, by score then flat index
        self.scores = np.take_along_axis(scores, top, 1)
        flat = np.take_along_axis(index, top, 1)  # beam * V + token
        beam_id, tokens = flat // V, (flat % V).reshape(-1)
        rows = (beam_id + np.arange(B)[:, None] * k).reshape(-1)
        col = tokens[:, None]
        self.history = col if self.history is None else np.concatenate([self.history[rows], col], 1)
        self.step_index += 1
        self._collect(only_stopped=True)
        if self.step_index >= self.cfg.max_new_tokens:
            self._collect(only_stopped=False)
        return rows.astype(np.int64), tokens.astype(np.int64)

    def _collect(self, only_stopped: bool) -> None:
        flat = self.scores.reshape(-1)
        t = self.history.shape[1]
        last = self.history[:, -1]
        for i in range(self.B * self.k):
            if only_stopped and last[i] not in self.cfg.stop_ids:
                continue
            score = flat[i] / t ** self.cfg.length_penalty
            b = i // self.k
            if self.best[b] is None or score > self.best_score[b]:
                self.best_score[b], self.best[b] = score, self.history[i].tolist()
            flat[i] = -np.inf

    def results(self) -> list[list[int]]:
        """Best sequence per input (generated tokens, ending with its stop token if it stopped)."""
        return [b if b is not None else [] for b in self.best]


def _topk(x: np.ndarray, index: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k best per row: score descending, then ``index`` ascending."""
    if k < x.shape[1]:
        part = np.argpartition(x, x.shape[1] - k, axis=1)[:, x.shape[1] - k:]
        kth = np.take_along_axis(x, part, 1).min(1, keepdims=True)
        # ties at the boundary: take every candidate at least as good as the k-th, then order
        rows = [np.flatnonzero(row >= t) for row, t in zip(x, kth[:, 0])]
    else:
        rows = [np.arange(x.shape[1])] * len(x)
    out = []
    for r, cols in enumerate(rows):
        order = np.lexsort((index[r, cols], -x[r, cols]))[:k]
        out.append(cols[order])
    return np.array(out)


def left_pad(contexts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ids and attention mask (B, T) for a batch of prompts."""
    if any(len(c) == 0 for c in contexts):
        raise ValueError("beam search: an empty prompt")
    T = max(len(c) for c in contexts)
    ids = np.full((len(contexts), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(contexts), T), dtype=np.int64)
    for b, c in enumerate(contexts):
        ids[b, T - len(c):], mask[b, T - len(c):] = c, 1
    return ids, mask


def compose_rows(pending: np.ndarray | None, rows: np.ndarray, repeats: int) -> np.ndarray | None:
    """A cache reorder that waits for the next forward pass: ``rows`` (row ``j`` continues old
    row ``rows[j]``) applied after ``pending`` (or nothing); None when the result is the
    identity. Rows may only move within their input's ``repeats`` beams (the shared prompt)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not np.array_equal(rows // repeats, np.arange(len(rows)) // repeats):
        raise ValueError("KVCache.reorder: a row may only continue a beam of its own input")
    if pending is not None:
        rows = pending[rows]
    return None if np.array_equal(rows, np.arange(len(rows))) else rows


def run_beam_search(forward: Callable, repeat_rows: Callable, reorder: Callable,
                    contexts: Sequence[Sequence[int]], cfg: BeamConfig) -> list[list[int]]:
    """Drive one batch. The backend supplies three tensor primitives:

    - ``forward(ids, past, mask) -> (last_logits (rows, V) numpy, past)``
    - ``repeat_rows(past, n, mask)``: each row's cache repeated ``n`` times (input-major);
      ``mask`` (inputs, P) is the prompts' attention mask, for a cache that lays them out itself
    - ``reorder(past, rows)``: cache rows selected by ``rows``
    """
    ids, mask = left_pad(contexts)
    logits, past = forward(ids, None, mask)
    k = cfg.beam
    past, mask = repeat_rows(past, k, mask), np.repeat(mask, k, axis=0)
    logits = np.repeat(logits, k, axis=0) if isinstance(logits, np.ndarray) else logits.repeat_rows(k)
    search = BeamSearch(len(contexts), cfg)
    while True:
        rows, tokens = search.step(logits, overwrite=True)
        if search.done:
            break
        past = reorder(past, rows)
        mask = np.concatenate([mask[rows], np.ones((len(rows), 1), dtype=mask.dtype)], 1)
        logits, past = forward(tokens[:, None], past, mask)
    return search.results()


def beam_search_batched(forward: Callable, repeat_rows: Callable, reorder: Callable,
                        contexts: Sequence[Sequence[int]], cfg: BeamConfig, batch_size: int = 8,
                        progress: bool = False) -> list[list[int]]:
    """``run_beam_search`` over ``contexts`` in batches of ``batch_size`` (with a progress bar)."""
    from ..progress import batched

    out: list[list[int]] = []
    for chunk in batched(contexts, batch_size, progress, desc="beam"):
        out.extend(run_beam_search(forward, repeat_rows, reorder, chunk, cfg))
    return out
