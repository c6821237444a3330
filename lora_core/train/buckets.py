"""Shape buckets for a captured (compiled) training step, and the padding that reaches them.

A compiled step (``torch.compile``) is specialised to the shapes it was traced with; every
new shape compiles again. A training batch has three varying sizes (``lora_core.data.batching``):
the row length T, the number N of real tokens (the packed, unpadded layout) and the number
L of loss positions. ``bucket_shape`` rounds each up to a short fixed list, and
``pad_to_bucket`` pads a collated batch to it, so shapes repeat and the compilations are
bounded by the buckets a run meets (one per ``BucketShape``; the batch size is fixed but
for a smaller last batch).

Padding changes nothing but rounding:
- rows are right-padded to ``T`` columns: the model is causal, so no real token attends to
  a pad;
- the packed layout gets ``N - n`` extra rows after the real ones: they read position 0,
  no padded position reads them (pads read the appended zero row, index N), so they never
  reach a real token, and they are not loss positions;
- ``L - l`` extra loss positions point at packed row 0 with target 0 and ``loss_weight`` 0;
  the loss is ``sum(weight * nll) / sum(weight)``, the mean over the real positions.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def length_bucket(t: int, limit: int, multiple: int = 32) -> int:
    """``t`` rounded up to a multiple of ``multiple``, at most ``limit`` (the model's
    ``n_positions``); ``t`` itself when it is already past ``limit``."""
    if t < 1 or multiple < 1:
        raise ValueError(f"length_bucket: need t >= 1 and multiple >= 1, got t={t}, multiple={multiple}")
    return max(t, min(-(-t // multiple) * multiple, limit))


def count_bucket(n: int, steps_per_octave: int = 4, floor: int = 16) -> int:
    """``n`` rounded up on a geometric grid: ``floor``, then ``steps_per_octave`` evenly spaced
    values per power of two (``16, 20, 24, 28, 32, 40, 48, 56, 64, 80, ...`` for the defaults):
    at most ``1 / steps_per_octave`` padding, ``steps_per_octave`` buckets per doubling of ``n``."""
    if n < 1:
        raise ValueError(f"count_bucket: need n >= 1, got {n}")
    if n <= floor:
        return floor
    octave = 1 << (int(n - 1).bit_length() - 1)  # largest power of two below n
    step = max(octave // steps_per_octave, 1)
    return -(-n // step) * step


@dataclasses.dataclass(frozen=True)
class BucketShape:
    """Padded sizes of a batch: ``rows`` (B), ``length`` (T), ``tokens`` (N), ``loss`` (L)."""

    rows: int
    length: int
    tokens: int
    loss: int


def bucket_shape(batch: dict, limit: int, multiple: int = 32) -> BucketShape:
    """The bucket of a ``lora_core.data.batching.collate`` batch; ``limit`` is ``n_positions``."""
    B, T = batch["input_ids"].shape
    t = length_bucket(T, limit, multiple)
    return BucketShape(B, t, min(count_bucket(len(batch["token_index"])), B * t),
                       count_bucket(len(batch["targets"])))


def pad_to_bucket(batch: dict, shape: BucketShape) -> dict:
    """``batch`` padded to ``shape`` (see the module docstring), with ``loss_weight`` (L,)
    float32: 1 at real loss positions, 0 at padded ones. Keys: ``input_ids``,
    ``token_index``, ``pad_index``, ``packed_loss_index``, ``targets``, ``loss_weight``."""
    ids = batch["input_ids"]
    B, T = ids.shape
    n, n_loss = len(batch["token_index"]), len(batch["targets"])
    if B != shape.rows or shape.length < T or shape.tokens < n or shape.loss < n_loss:
        raise ValueError(f"pad_to_bucket: a batch of {B}x{T}, {n} tokens, {n_loss} loss positions does not fit {shape}")
    t = shape.length
    out_ids = np.zeros((B, t), dtype=np.int64)
    out_ids[:, :T] = ids
    rows, cols = np.divmod(batch["token_index"], T)
    tok = np.zeros(shape.tokens, dtype=np.int64)  # extra packed rows read position 0 of row 0
    tok[:n] = rows * t + cols
    pad = np.full(B * t, shape.tokens, dtype=np.int64)  # padded positions read the zero row
    pad[tok[:n]] = np.arange(n)
    loss = np.zeros(shape.loss, dtype=np.int64)
    loss[:n_loss] = batch["packed_loss_index"]
    targets = np.zeros(shape.loss, dtype=np.int64)
    targets[:n_loss] = batch["targets"]
    weight = np.zeros(shape.loss, dtype=np.float32)
    weight[:n_loss] = 1.0
    return {"input_ids": out_ids, "token_index": tok, "pad_index": pad, "packed_loss_index": loss,
            "targets": targets, "loss_weight": weight}
