"""LoRA layers for PyTorch (loralib names and layouts; peft-style explicit merge).

The contract (shapes, init, merge semantics) is defined in ``lora_core.models.gpt2`` and
``lora_core.lora.reference``; this file is its PyTorch form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_core.lora.layers import lora_layers, merge_lora, set_dropout_source, unmerge_lora
from lora_core.lora.naming import LORA_MARK, adapter_names


class _AutocastFrozenLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` as ``torch.autocast`` runs it (``x`` given in autocast's
    dtype, the weight and bias cast to it, the product in it) for a frozen weight and bias,
    keeping for the backward pass only the float32 weight itself (the parameter: no copy) and
    casting it again there. Autocast caches the casts
    of trained weights only, so a frozen weight's low-precision copy lived from its layer's
    forward pass to its backward pass: 2 bytes per frozen weight at the backward pass's start
    (1.9 GB for Llama-3.2-1B's 16 layers in bf16). The same products, the same bits
    (``tests/test_autocast_frozen.py``); one more cast per layer in the backward pass."""

    # (no autocast context switched off inside: every operand is already in autocast's dtype, so
    # its casts do nothing; switching it cost ~10 us a call, and these steps are launch-bound on a GPU)
    @staticmethod
    def forward(ctx, x, weight, bias):  # x already in the autocast dtype (cast by the caller, as autocast does)
        ctx.save_for_backward(weight)
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        return g.matmul(weight.to(g.dtype)), None, None  # linear's input gradient: g W


def _frozen_autocast_linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor | None:
    """``_AutocastFrozenLinear``'s product where it applies (autocast on, gradients wanted for
    ``x`` only: weight and bias frozen; not while compiling, where the compiler plans the
    memory), else None (the caller runs ``F.linear``)."""
    if not x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad):
        return None
    dev = x.device.type
    if not (torch.is_autocast_enabled(dev) and torch.is_grad_enabled()) or x.dtype == torch.float64 \
            or torch.compiler.is_compiling():  # autocast leaves float64 alone
        return None
    # the input cast outside the function, as autocast casts it: the same autograd graph (a cast
    # node, then the product's), so gradients are summed in the same order, bit for bit
    return _AutocastFrozenLinear.apply(x.to(torch.get_autocast_dtype(dev)), weight, bias)


class LoRALinear(nn.Module):
    """``y = x W^T + b + scaling * dropout(x) A^T B^T``; W (out, in), A (r, in), B (out, r)."""

    def __init__(self, in_features: int, out_features: int, r: int = 0, alpha: float = 1.0,
                 dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.r = in_features, out_features, r
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.scaling = alpha / r if r else 0.0
        self.p = dropout
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.mask_source = None  # a lora_core.lora.dropout.NumpyDropout in parity mode
        self.merged = False
        self.decode_weight = None  # set by GPT2LMModel.decoding(): merged, maybe pre-packed weight
        if r:
            self.lora_A = nn.Parameter(torch.zeros(self._n_slices() * r, in_features))
            self.lora_B = nn.Parameter(torch.zeros(self._slice_out() * self._n_slices(), r))

    def _n_slices(self) -> int:
        return 1

    def _slice_out(self) -> int:
        return self.out_features

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask_source is not None and self.training and self.p > 0:
            m = self.mask_source.mask(tuple(x.shape), self.p)  # numpy, or a tensor in a compiled step
            return x * (m if isinstance(m, torch.Tensor) else torch.from_numpy(m).to(x.device))
        return self.lora_dropout(x)

    def _lora_out(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        # the scaling on the rank-r product and the sum fused into the second GEMM (addmm):
        # two elementwise passes over the (tokens, out) output fewer than ``base + BAx * s``
        h = (self._drop(x) @ self.lora_A.t()) * self.scaling
        out = torch.addmm(base.reshape(-1, base.shape[-1]), h.reshape(-1, h.shape[-1]), self.lora_B.t())
        return out.view(base.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode_weight is not None:
            return linear_decode(x, self.decode_weight, self.bias)
        y = _frozen_autocast_linear(x, self.weight, self.bias)
        if y is None:
            y = F.linear(x, self.weight, self.bias)
        if self.r and not self.merged:
            y = self._lora_out(x, y)
        return y

    def input_grad(self, g: torch.Tensor) -> torch.Tensor:
        """``g W``: the input gradient of the frozen base product for the output gradient ``g``
        (rows, out) (what autograd's backward of ``F.linear`` computes for it); the LoRA pair's
        part is not in it."""
        return g @ self.weight

    def merged_weight(self) -> torch.Tensor:
        """``W + scaling * B A`` (what a merged layer holds), without changing the layer."""
        return self.weight + self.delta_weight() if self.r and not self.merged else self.weight

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B A`` laid out like ``weight``."""
        return (self.lora_B @ self.lora_A) * self.scaling

    @torch.no_grad()
    def merge(self) -> None:
        """Add the update into ``weight`` (idempotent). A copy of the weight is kept while
        merged, so that ``unmerge`` restores it bit for bit."""
        if self.r and not self.merged:
            self.premerge_weight = self.weight.detach().clone()
            self.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the weight as it was before ``merge`` (idempotent, exact)."""
        if self.r and self.merged:
            self.weight.copy_(self.premerge_weight)
            self.premerge_weight = None
            self.merged = False


# Below this many rows per product (greedy decoding of one or two sequences) MKL's plain
# product beats oneDNN's packed one (measured, one thread: 1024 x 2816 at 2 rows 642 vs 729 us,
# at 4 rows 1314 vs 722 us), and packing costs a copy of every weight per call.
PACK_MIN_ROWS = 4
# input rows for which a plain CPU product runs as W x^T (``linear_decode``): greedy decoding of
# 2 or 3 sequences. F.linear (x W^T) with so few rows ran at 4-8 GB/s of weight read where
# W x^T reads 9-18 GB/s (one thread, AMD EPYC, torch 2.13 with MKL; widths 1024-8000): the same
# products, the weight streamed once; with one row both run alike, from 4 rows F.linear is faster
FEW_ROWS = (2, 3)
# ... and W x^T with more input features than this reads a weight streamed from memory at 10-13
# GB/s in MKL (one thread, AMD EPYC, torch 2.13; 2 rows: 1024 x 2816 10.8 GB/s, 2048 x 2048 12.7,
# 2048 x 8192 10.0), where the same product summed over contiguous blocks of at most this many
# columns reads 17-19 GB/s (1024 x 2816 in 3 blocks 18.0; views of the blocks, strided, 5 GB/s):
# for greedy decoding of 2-3 sequences such a weight is copied once into its column blocks
DECODE_K_BLOCK = 1024


def pack_weight(w: torch.Tensor, rows: int) -> tuple[str, torch.Tensor | tuple]:
    """A frozen (out, in) weight prepared for ``linear_decode``: pre-packed into oneDNN's
    blocked layout on CPU (1.3-2.3x MKL's speed at beam-search sizes, one thread); for
    ``FEW_ROWS`` rows on CPU with more than ``DECODE_K_BLOCK`` input features, the weight and a
    copy of it in contiguous column blocks (``"blocks"``); else the plain weight. ``rows`` is the
    expected number of input rows (a layout hint)."""
    w = w.detach().contiguous()
    if w.device.type == "cpu" and rows >= PACK_MIN_ROWS and torch.backends.mkldnn.is_available():
        try:
            return "onednn", torch.ops.mkldnn._reorder_linear_weight(w, rows)
        except (AttributeError, RuntimeError):  # a build without the op: plain matmul
            pass
    if w.device.type == "cpu" and FEW_ROWS[0] <= rows <= FEW_ROWS[1] and w.shape[1] > DECODE_K_BLOCK:
        n = w.shape[1]
        width = -(-n // -(-n // DECODE_K_BLOCK))  # equal blocks, the fewest of at most DECODE_K_BLOCK
        return "blocks", (w, tuple(w[:, k : k + width].contiguous() for k in range(0, n, width)))
    return "plain", w


def _few_rows_product(blocks: tuple, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x W^T`` for ``rows`` input rows as W x^T over the weight's column ``blocks`` (the weight
    itself as one block; each further block's product added into the first's: ``addmm``), the
    output made row-major again (a transposed view would make the next product's input the layout
    MKL runs slowest with, 3 GB/s) by stacking its columns: 2.4x ``.t().contiguous()``'s speed at
    (2816, 2) (7.7 vs 18.8 us, one thread)."""
    xt = x.reshape(rows, -1).t()
    k = blocks[0].shape[1]
    y = torch.mm(blocks[0], xt[:k])
    for b in blocks[1:]:
        y = torch.addmm(y, b, xt[k : k + b.shape[1]])
        k += b.shape[1]
    return torch.stack(y.unbind(1))


def linear_decode(x: torch.Tensor, packed: tuple[str, torch.Tensor | tuple], bias: torch.Tensor | None,
                  gelu: bool = False) -> torch.Tensor:
    """``x W^T + b`` with a weight from ``pack_weight`` (no autograd); ``gelu``: then GELU
    (tanh form), fused into the oneDNN product when packed."""
    kind, w = packed
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "gelu" if gelu else "none", [], "tanh" if gelu else "")
    w, blocks = w if kind == "blocks" else (w, (w,))
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if w.device.type == "cpu" and FEW_ROWS[0] <= rows <= FEW_ROWS[1] and x.dtype == w.dtype:
        # W x^T: the weight streamed once against the few rows (2-3x F.linear's speed here)
        y = _few_rows_product(blocks, x, rows).view(*x.shape[:-1], w.shape[0])
        y = y if bias is None else y + bias
    else:
        y = F.linear(x, w, bias)
    return F.gelu(y, approximate="tanh") if gelu else y


class LoRAMergedLinear(LoRALinear):
    """Fused qkv projection with one LoRA pair per enabled slice (loralib ``MergedLinear``).

    A is (k*r, in), B is (k*out/3, r) for k enabled slices; slice j uses rows
    ``A[j*r:(j+1)*r]`` and ``B[j*o:(j+1)*o]``. No LoRA work is done on disabled slices.
    """

    def __init__(self, in_features: int, out_features: int, r: int = 0, alpha: float = 1.0,
                 dropout: float = 0.0, enable_lora: tuple[bool, ...] = (True, False, True), bias: bool = True):
        self.enable_lora = tuple(enable_lora)
        self.enabled = [i for i, on in enumerate(self.enable_lora) if on]
        super().__init__(in_features, out_features, r, alpha, dropout, bias)

    def _n_slices(self) -> int:
        return len(self.enabled)

    def _slice_out(self) -> int:
        return self.out_features // len(self.enable_lora)

    def _lora_out(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        after_a = self._drop(x) @ self.lora_A.t()  # (..., k*r)
        r, o = self.r, self._slice_out()
        parts = list(base.split(o, dim=-1))
        for j, i in enumerate(self.enabled):
            parts[i] = parts[i] + (after_a[..., j * r:(j + 1) * r] @ self.lora_B[j * o:(j + 1) * o].t()) * self.scaling
        return torch.cat(parts, dim=-1)

    def delta_weight(self) -> torch.Tensor:
        r, o = self.r, self._slice_out()
        delta = self.weight.new_zeros((self.out_features, self.in_features))
        for j, i in enumerate(self.enabled):
            delta[i * o:(i + 1) * o] = self.lora_B[j * o:(j + 1) * o] @ self.lora_A[j * r:(j + 1) * r]
        return delta * self.scaling


class LoRAEmbedding(nn.Module):
    """``W[ids] + scaling * A^T[ids] B^T``; A (r, vocab), B (dim, r) (loralib ``Embedding``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, r: int = 0, alpha: float = 1.0,
                 padding_idx: int | None = None, scale_grad_by_freq: bool = False):
        super().__init__()
        self.r = r
        self.padding_idx = padding_idx  # its row of W and of A^T gets no gradient (nn.Embedding's, peft's)
        self.scale_grad_by_freq = scale_grad_by_freq  # gradients divided by each id's count in the batch
        self.weight = nn.Parameter(torch.zeros(num_embeddings, embedding_dim))
        self.scaling = alpha / r if r else 0.0
        self.merged = False
        if r:
            self.lora_A = nn.Parameter(torch.zeros(r, num_embeddings))
            self.lora_B = nn.Parameter(torch.zeros(embedding_dim, r))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = F.embedding(ids, self.weight, self.padding_idx, scale_grad_by_freq=self.scale_grad_by_freq)
        if self.r and not self.merged:
            a = F.embedding(ids, self.lora_A.t(), self.padding_idx, scale_grad_by_freq=self.scale_grad_by_freq)
            y = y + (a @ self.lora_B.t()) * self.scaling
        return y

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A).t() * self.scaling

    merge = LoRALinear.merge
    unmerge = LoRALinear.unmerge
    merged_weight = LoRALinear.merged_weight


def mark_only_lora_as_trainable(model: nn.Module, bias: str = "none") -> None:
    """Freeze everything but ``lora_`` parameters and the biases ``bias`` selects
    (``none``, ``all``, ``lora_only``: biases of layers that have LoRA)."""
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"bias must be 'none', 'all' or 'lora_only', got {bias!r}")
    for name, p in model.named_parameters():
        p.requires_grad_(LORA_MARK in name or (bias == "all" and name.endswith(".bias")))
    if bias == "lora_only":
        for m in lora_layers(model):
            if getattr(m, "bias", None) is not None:
                m.bias.requires_grad_(True)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> parameter of everything that trains, in module order."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def count_trainable(model: nn.Module) -> int:
    """Number of trainable scalars."""
    return sum(p.numel() for p in trainable_parameters(model).values())


def lora_state_dict(model: nn.Module) -> dict:
    """numpy copies of the adapter: ``lora_`` tensors and the biases the LoRA config trains."""
    names = adapter_names(model)
    return {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters() if n in names}


__all__ = ["LoRAEmbedding", "LoRALinear", "LoRAMergedLinear", "count_trainable", "lora_state_dict",
           "mark_only_lora_as_trainable", "merge_lora", "set_dropout_source", "trainable_parameters", "unmerge_lora"]
