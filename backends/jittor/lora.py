"""LoRA layers for Jittor; contract and math as in ``backends.torch.lora`` / ``lora_core.lora.reference``.

Jittor idioms: ``execute``; weights change through ``Var.update`` (no ``.data`` writes);
trainability is ``Var.requires_grad`` (``stop_grad``), owned by
``mark_only_lora_as_trainable`` and kept across ``train()``/``eval()`` by ``GPT2LMModel``.
"""

from __future__ import annotations

import jittor as jt
from jittor import nn

from lora_core.lora.layers import lora_layers, merge_lora, set_dropout_source, unmerge_lora
from lora_core.lora.naming import LORA_MARK, adapter_names

from ._lean_layers import frozen_matmul_t


def assign_keep_grad(p: jt.Var, value: jt.Var) -> None:
    """Write ``value`` into parameter ``p`` in place, keeping whether ``p`` trains
    (``Var.update``/``assign`` under ``no_grad`` would make it ``stop_grad``)."""
    trains = p.requires_grad
    p.assign(value.detach())
    p.requires_grad = trains


class TrainEvalMixin:
    """``train()``/``eval()`` that only switch ``is_train`` on every module: jittor's own also
    change which parameters train, and trainability belongs to ``mark_only_lora_as_trainable``."""

    def train(self):
        for m in self.modules():
            m.is_train = True
        return self

    def eval(self):
        for m in self.modules():
            m.is_train = False
        return self


def _dropout(p: float):
    return nn.Dropout(p) if p > 0 else nn.Identity()


class LoRALinear(nn.Module):
    """``y = x W^T + b + scaling * dropout(x) A^T B^T``; W (out, in), A (r, in), B (out, r)."""

    def __init__(self, in_features: int, out_features: int, r: int = 0, alpha: float = 1.0,
                 dropout: float = 0.0, bias: bool = True):
        self.in_features, self.out_features, self.r = in_features, out_features, r
        self.weight = jt.zeros((out_features, in_features))
        self.bias = jt.zeros((out_features,)) if bias else None
        self.scaling = alpha / r if r else 0.0
        self.p = dropout
        self.lora_dropout = _dropout(dropout)
        self.mask_source = None  # a lora_core.lora.dropout.NumpyDropout in parity mode
        self.merged = False
        self.decode_weight = None  # set by decoding(): the merged weight from pack_weight (layout, weight)
        if r:
            self.lora_A = jt.zeros((self._n_slices() * r, in_features))
            self.lora_B = jt.zeros((self._slice_out() * self._n_slices(), r))

    def _n_slices(self) -> int:
        return 1

    def _slice_out(self) -> int:
        return self.out_features

    def _drop(self, x: jt.Var) -> jt.Var:
        if self.mask_source is not None and self.is_training() and self.p > 0:
            return x * jt.array(self.mask_source.mask(tuple(x.shape), self.p))
        return self.lora_dropout(x)

    def _lora_out(self, x: jt.Var, base: jt.Var) -> jt.Var:
        # torch's order (its addmm): the scaling on the rank-r product, then the sum
        after_a = nn.matmul_transpose(self._drop(x), self.lora_A) * self.scaling
        return base + nn.matmul_transpose(after_a, self.lora_B)

    def execute(self, x: jt.Var) -> jt.Var:
        if self.decode_weight is not None:
            return linear_decode(x, self.decode_weight, self.bias)
        y = frozen_matmul_t(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        if self.r and not self.merged:
            y = self._lora_out(x, y)
        return y

    def input_grad(self, g: jt.Var) -> jt.Var:
        """``g W``: the input gradient of the frozen base product for the output gradient ``g``
        (rows, out) (what the product's backward computes for it); the LoRA pair's part is not in it."""
        return jt.matmul(g, self.weight)

    def merged_weight(self) -> jt.Var:
        """``W + scaling * B A`` (what a merged layer holds), without changing the layer."""
        return self.weight + self.delta_weight() if self.r and not self.merged else self.weight

    def delta_weight(self) -> jt.Var:
        return jt.matmul(self.lora_B, self.lora_A) * self.scaling

    def merge(self) -> None:
        if self.r and not self.merged:
            self.premerge_weight = self.weight.numpy().copy()  # numpy: not a parameter of the module
            assign_keep_grad(self.weight, self.weight + self.delta_weight())
            self.merged = True

    def unmerge(self) -> None:
        if self.r and self.merged:
            assign_keep_grad(self.weight, jt.array(self.premerge_weight))
            self.premerge_weight = None
            self.merged = False


FEW_ROWS = 3  # at most this many rows per step (greedy decoding of 1-3 sequences): x W^T, see pack_weight


def pack_weight(w: jt.Var, rows: int) -> tuple[str, jt.Var]:
    """A frozen (out, in) weight prepared for ``linear_decode``, with its layout's name:
    ``"in_out"``, a materialised (in, out) copy, the layout in which jittor's oneDNN matmul runs
    fastest (99 vs 77-83 GFLOP/s at beam-search sizes, one thread); or where ``rows`` (the rows
    a decoding step will have) is at most ``FEW_ROWS``, ``"out_in"``, the weight itself: every
    product is then x W^T (``matmul_transpose``), which read the weight at 18-21 GB/s at 2 rows
    where x (W^T) read it at 10-12 (AMD EPYC, one thread), and no copy is made (the transposed
    copies of llama-bench's weights took 0.54 s of a 1.7 s greedy call; the prompt's 64-row
    products run 1.3-1.6x slower this way, 0.1 s)."""
    with jt.no_grad():
        if rows <= FEW_ROWS:
            return "out_in", w.detach()
        packed = w.transpose().clone().stop_grad()
        packed.sync()
        return "in_out", packed


def linear_decode(x: jt.Var, packed: tuple[str, jt.Var], bias: jt.Var | None) -> jt.Var:
    """``x W^T + b`` with a weight from ``pack_weight`` (no autograd)."""
    layout, w = packed
    if layout == "out_in":
        rows = x.numel() // x.shape[-1]
        y = jt.nn.matmul_transpose(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    else:
        y = jt.matmul(x, w)
    return y if bias is None else y + bias


class LoRAMergedLinear(LoRALinear):
    """Fused qkv with one LoRA pair per enabled slice (loralib ``MergedLinear``)."""

    def __init__(self, in_features: int, out_features: int, r: int = 0, alpha: float = 1.0,
                 dropout: float = 0.0, enable_lora: tuple[bool, ...] = (True, False, True), bias: bool = True):
        self.enable_lora = tuple(enable_lora)
        self.enabled = [i for i, on in enumerate(self.enable_lora) if on]
        super().__init__(in_features, out_features, r, alpha, dropout, bias)

    def _n_slices(self) -> int:
        return len(self.enabled)

    def _slice_out(self) -> int:
        return self.out_features // len(self.enable_lora)

    def _lora_out(self, x: jt.Var, base: jt.Var) -> jt.Var:
        after_a = nn.matmul_transpose(self._drop(x), self.lora_A)  # (..., k*r)
        r, o = self.r, self._slice_out()
        parts = [base[..., i * o:(i + 1) * o] for i in range(len(self.enable_lora))]
        for j, i in enumerate(self.enabled):
            parts[i] = parts[i] + nn.matmul_transpose(after_a[..., j * r:(j + 1) * r],
                                                      self.lora_B[j * o:(j + 1) * o]) * self.scaling
        return jt.concat(parts, dim=-1)

    def delta_weight(self) -> jt.Var:
        r, o = self.r, self._slice_out()
        rows = []
        for i in range(len(self.enable_lora)):
            if i in self.enabled:
                j = self.enabled.index(i)
                rows.append(jt.matmul(self.lora_B[j * o:(j + 1) * o], self.lora_A[j * r:(j + 1) * r]))
            else:
                rows.append(jt.zeros((o, self.in_features)))
        return jt.concat(rows, dim=0) * self.scaling


def _lookup(table: jt.Var, ids: jt.Var, padding_idx: int | None, scale_grad_by_freq: bool = False) -> jt.Var:
    """``table[ids]``; the rows of ``padding_idx`` tokens pass no gradient back to the table, and
    with ``scale_grad_by_freq`` each row's gradient is divided by its id's count in ``ids``
    (torch's ``F.embedding``): the same values, the gradient of a copy cut from the graph at the
    padding positions, scaled by a factor elsewhere."""
    rows = table[ids]
    if (padding_idx is None and not scale_grad_by_freq) or jt.flags.no_grad or not table.requires_grad:
        return rows
    if scale_grad_by_freq:
        flat = ids.reshape(-1)
        counts = jt.zeros((table.shape[0],), dtype="float32").scatter_(0, flat, jt.ones(flat.shape), reduce="add")
        f = (1.0 / counts[flat]).reshape(ids.shape).unsqueeze(-1).stop_grad()
        rows = rows.detach() + (rows - rows.detach()) * f  # values unchanged, gradients / count
    if padding_idx is None:
        return rows
    pad = (ids == padding_idx).unsqueeze(-1)
    return jt.where(pad, rows.detach(), rows)  # (stop_grad() would cut the graph of rows itself)


class LoRAEmbedding(nn.Module):
    """``W[ids] + scaling * A^T[ids] B^T``; A (r, vocab), B (dim, r) (loralib ``Embedding``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, r: int = 0, alpha: float = 1.0,
                 padding_idx: int | None = None, scale_grad_by_freq: bool = False):
        self.r = r
        self.padding_idx = padding_idx  # its row of W and of A^T gets no gradient (torch's nn.Embedding, peft's)
        self.scale_grad_by_freq = scale_grad_by_freq  # gradients divided by each id's count in the batch
        self.weight = jt.zeros((num_embeddings, embedding_dim))
        self.scaling = alpha / r if r else 0.0
        self.merged = False
        if r:
            self.lora_A = jt.zeros((r, num_embeddings))
            self.lora_B = jt.zeros((embedding_dim, r))

    def execute(self, ids: jt.Var) -> jt.Var:
        y = _lookup(self.weight, ids, self.padding_idx, self.scale_grad_by_freq)
        if self.r and not self.merged:
            a = _lookup(self.lora_A.transpose(), ids, self.padding_idx, self.scale_grad_by_freq)
            y = y + nn.matmul_transpose(a, self.lora_B) * self.scaling
        return y

    def delta_weight(self) -> jt.Var:
        return jt.matmul(self.lora_B, self.lora_A).transpose() * self.scaling

    merge = LoRALinear.merge
    unmerge = LoRALinear.unmerge
    merged_weight = LoRALinear.merged_weight


def mark_only_lora_as_trainable(model: nn.Module, bias: str = "none") -> None:
    """Freeze all but ``lora_`` parameters and the biases ``bias`` selects."""
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"bias must be 'none', 'all' or 'lora_only', got {bias!r}")
    lora_biases = {id(m.bias) for m in lora_layers(model) if getattr(m, "bias", None) is not None}
    for name, p in model.named_parameters():
        p.requires_grad = (LORA_MARK in name or (bias == "all" and name.endswith(".bias"))
                           or (bias == "lora_only" and id(p) in lora_biases))


def trainable_parameters(model: nn.Module) -> dict[str, jt.Var]:
    """Name -> parameter of everything that trains, in module order."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def count_trainable(model: nn.Module) -> int:
    """Number of trainable scalars."""
    return sum(int(p.numel()) for p in trainable_parameters(model).values())


def lora_state_dict(model: nn.Module) -> dict:
    """numpy copies of the adapter: ``lora_`` tensors and the biases the LoRA config trains."""
    names = adapter_names(model)
    return {n: p.numpy().copy() for n, p in model.named_parameters() if n in names}


__all__ = ["LoRAEmbedding", "LoRALinear", "LoRAMergedLinear", "count_trainable", "lora_state_dict",
           "mark_only_lora_as_trainable", "merge_lora", "set_dropout_source", "trainable_parameters", "unmerge_lora"]
