"""Training batches as numpy: sequence layout, dynamic padding, loss positions.

Paper layout (microsoft/LoRA ``data_utils.py``): an example is ``context + completion``
where ``context = bpe(ctx) + [eos]`` and ``completion = bpe(" " + text) + [eos]``; the
model reads ``seq[:-1]`` and predicts ``seq[1:]``; the loss counts the completion tokens
including the final eos. Batches are right-padded to their longest sequence (or to
``pad_to`` for exact-behaviour runs): with causal attention no real token attends to a
pad, so no attention mask is needed, and the loss positions are gathered explicitly so
the LM head runs only where the loss is taken.

Unpadded training: the backends run every position-wise layer (embeddings, LayerNorm,
the linear layers with their LoRA, the MLP) on the real tokens only, packed into (N, E),
and scatter them into the padded (B, T) layout just for attention. Padding therefore costs
nothing but a little attention; ``pad_to`` only widens the attention window.
"""

from __future__ import annotations

import numpy as np


def collate(examples: list[tuple[list[int], list[int]]], pad_to: int | None = None,
            pad_id: int = 0, max_len: int | None = None) -> dict[str, np.ndarray]:
    """Build a batch.

    Args:
        examples: ``(context_ids, completion_ids)`` pairs, both ending with eos.
        pad_to: pad every row to this many input tokens (default: the longest row).
        max_len: refuse (ValueError) sequences longer than this many input tokens.

    Returns:
        ``input_ids`` (B, T) int64; ``loss_index`` (L,) flat indices into B*T of the
        positions whose next token is a completion token; ``targets`` (L,) int64;
        ``n_tokens`` (real input tokens, for throughput); for unpadded training
        ``token_index`` (N,) flat indices of the real input tokens (row-major),
        ``pad_index`` (B*T,) the packed row of each padded position (N for a pad: a zero
        row appended to the packed tensor) and ``packed_loss_index`` (L,) the loss
        positions as packed rows.
    """
    if not examples:
        raise ValueError("collate: empty batch")
    lengths = [len(c) + len(t) - 1 for c, t in examples]
    T = max(lengths) if pad_to is None else pad_to
    limit = max_len if max_len is not None else T
    for i, ((c, t), n) in enumerate(zip(examples, lengths)):
        if not c or not t:
            raise ValueError(f"collate: example {i} has an empty context or completion")
        if n > limit:
            raise ValueError(f"collate: example {i} has {n} input tokens, more than {limit} "
                             f"(truncating would change it silently)")
    ids = np.full((len(examples), T), pad_id, dtype=np.int64)
    index, targets = [], []
    for b, (c, t) in enumerate(examples):
        seq = list(c) + list(t)
        ids[b, :len(seq) - 1] = seq[:-1]
        start = len(c) - 1  # position whose next token is the first completion token
        index.append(b * T + np.arange(start, len(seq) - 1))
        targets.append(np.asarray(t, dtype=np.int64))
    loss_index = np.concatenate(index).astype(np.int64)
    token_index = np.concatenate([b * T + np.arange(n) for b, n in enumerate(lengths)]).astype(np.int64)
    pad_index = np.full(len(examples) * T, len(token_index), dtype=np.int64)
    pad_index[token_index] = np.arange(len(token_index))
    return {"input_ids": ids, "loss_index": loss_index, "targets": np.concatenate(targets),
            "n_tokens": np.int64(sum(lengths)), "token_index": token_index, "pad_index": pad_index,
            "packed_loss_index": pad_index[loss_index]}


def check_token_ids(ids, vocab_size: int, what: str) -> np.ndarray:
    """``ids`` (host data: a numpy array or nested lists) as an int64 array, every id checked to lie
    in ``[0, vocab_size)``; otherwise ValueError naming ``what`` (``"input ids"``, ``"targets"``,
    ``"prompt"``), the first offending id, its position and the vocabulary size. The backends call
    it where host data enters (forward passes, losses, beam prompts), before the ids reach an
    embedding lookup or a gather: jittor's read out of bounds silently (garbage or NaN) where torch
    raises, and torch's fused frozen-head loss would skip the target. The cost is one min and one
    max over the host array (no copy for int64 input, no device sync); targets have no ignore
    index (``collate`` gathers the loss positions explicitly), so every target must be a token."""
    a = np.asarray(ids)
    if a.dtype != np.int64:
        a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() >= vocab_size):
        bad = np.flatnonzero((a < 0) | (a >= vocab_size))
        pos = np.unravel_index(bad[0], a.shape)
        more = f" ({len(bad)} ids outside it)" if len(bad) > 1 else ""
        raise ValueError(f"{what}: token id {int(a.flat[bad[0]])} at position {tuple(int(i) for i in pos)} is "
                         f"outside the vocabulary of {vocab_size} tokens [0, {vocab_size}){more}")
    return a


def check_prompts(contexts, vocab_size: int) -> None:
    """``check_token_ids`` on each beam-search prompt (``"prompt {i}"`` named in the error)."""
    for i, c in enumerate(contexts):
        check_token_ids(c, vocab_size, f"prompt {i}")


def label_smoothed_nll_reference(logits: np.ndarray, targets: np.ndarray, eps: float) -> float:
    """Numpy reference of the paper loss at the loss positions, averaged over them:
    ``(1 - eps) * NLL + eps * mean_v(-log p_v)``; ``logits`` is (N, V)."""
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(targets)), targets]
    return float(((1 - eps) * nll + eps * (-logp.mean(-1))).mean())
