"""DistilBERT for sequence classification in PyTorch, module names of ``transformers``'
``DistilBertForSequenceClassification`` (spec: ``lora_core.models.distilbert``).

Contract (same in every backend): ``DistilBertForSequenceClassification(cfg)``;
``model(input_ids, attention_mask=None) -> logits`` (B, num_labels); ``attention_mask``
(B, T) marks real tokens with 1 (padded keys get no attention); ``load_weights`` (strict);
``state_numpy()``. LoRA goes on with ``inject_lora`` (e.g. ``q_lin``, ``v_lin`` +
``modules_to_save=("classifier",)``).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lora_core.formats.checkpoint import check_tensors
from lora_core.models.build import in_eval_mode
from lora_core.models.distilbert import DistilBertConfig, attention_scale, classifier_from_pretrained, pack_indices

from .gpt2 import checkpointed

_NEG = -1e30  # additive bias of padded keys (finite: no inf - inf)


class Dropout(nn.Dropout):
    """``nn.Dropout``; in parity mode (``set_dropout_source``) its masks come from a shared
    numpy stream (``lora_core.lora.dropout.NumpyDropout``), so both backends drop the same units."""

    mask_source = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask_source is not None and self.training and self.p > 0:
            return x * torch.from_numpy(self.mask_source.mask(tuple(x.shape), self.p)).to(x.device)
        return super().forward(x)


class Packed:
    """Index tensors of the real tokens of a padded batch (``lora_core.models.distilbert.pack_indices``)."""

    def __init__(self, token_index, pad_index, cls_index, device):
        self.token_index, self.pad_index, self.cls_index = (
            torch.from_numpy(a).to(device) for a in (token_index, pad_index, cls_index)
        )

    @staticmethod
    def of(attention_mask: torch.Tensor) -> Packed | None:
        found = pack_indices(attention_mask.cpu().numpy())
        return None if found is None else Packed(*found, attention_mask.device)


class Embeddings(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.dim)
        self.LayerNorm = nn.LayerNorm(cfg.dim, eps=1e-12)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, ids: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        if packed is not None:  # (N,) real tokens
            ids, pos = ids.reshape(-1)[packed.token_index], pos.repeat(ids.shape[0])[packed.token_index]
        return self.dropout(self.LayerNorm(self.word_embeddings(ids) + self.position_embeddings(pos)))


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        super().__init__()
        self.n_heads, self.scale = cfg.n_heads, attention_scale(cfg)
        self.q_lin, self.k_lin = nn.Linear(cfg.dim, cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.v_lin, self.out_lin = nn.Linear(cfg.dim, cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.dropout = Dropout(cfg.attention_dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        B, T, E = bias.shape[0], bias.shape[-1], x.shape[-1]

        def heads(t):  # (B, T, E) or packed (N, E) -> (B, nh, T, hs)
            if packed is not None:  # padding reads an appended zero row
                t = torch.cat([t, t.new_zeros(1, E)]).index_select(0, packed.pad_index)
            return t.view(B, T, self.n_heads, E // self.n_heads).transpose(1, 2)

        q, k, v = heads(self.q_lin(x)), heads(self.k_lin(x)), heads(self.v_lin(x))
        att = torch.softmax((q @ k.transpose(-1, -2)) * self.scale + bias, dim=-1)  # (B, nh, T, T)
        y = (self.dropout(att) @ v).transpose(1, 2).reshape(B, T, E)
        if packed is not None:
            y = y.view(B * T, E).index_select(0, packed.token_index)  # (N, E)
        return self.out_lin(y)


class FFN(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(cfg.dim, cfg.hidden_dim), nn.Linear(cfg.hidden_dim, cfg.dim)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.lin2(F.gelu(self.lin1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        super().__init__()
        self.attention = MultiHeadSelfAttention(cfg)
        self.sa_layer_norm = nn.LayerNorm(cfg.dim, eps=1e-12)
        self.ffn = FFN(cfg)
        self.output_layer_norm = nn.LayerNorm(cfg.dim, eps=1e-12)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        x = self.sa_layer_norm(self.attention(x, bias, packed) + x)
        return self.output_layer_norm(self.ffn(x) + x)


class Transformer(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        super().__init__()
        self.layer = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))


class DistilBertModel(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.transformer = Transformer(cfg)
        self.grad_checkpoint = False  # set_grad_checkpoint: recompute each block in the backward pass

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (B, T, E); with padding, its rows are zeros (the real tokens are
        computed packed, see ``first_token``)."""
        h, packed = self._run(ids, attention_mask)
        if packed is None:
            return h
        B, T = ids.shape
        return torch.cat([h, h.new_zeros(1, h.shape[-1])]).index_select(0, packed.pad_index).view(B, T, -1)

    def first_token(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden state of each sequence's first token, (B, E)."""
        h, packed = self._run(ids, attention_mask)
        return h[:, 0] if packed is None else h.index_select(0, packed.cls_index)

    def _run(self, ids, attention_mask):
        """Embeddings, LayerNorms, linear layers and FFN run on the real tokens only (packed
        (N, E)); attention on the padded (B, nh, T, T) layout with padded keys masked."""
        B, T = ids.shape
        packed = None if attention_mask is None else Packed.of(attention_mask)
        if packed is None:
            bias = torch.zeros((B, 1, T, T), device=ids.device)
        else:
            bias = ((1.0 - attention_mask.float()) * _NEG).view(B, 1, 1, T).expand(B, 1, T, T)
        h = self.embeddings(ids, packed)
        recompute = self.grad_checkpoint and self.training and torch.is_grad_enabled()
        for block in self.transformer.layer:
            h = checkpointed(block, h, bias, packed) if recompute else block(h, bias, packed)
        return h, packed


class DistilBertForSequenceClassification(nn.Module):
    """``transformers.DistilBertForSequenceClassification`` (see module docstring)."""

    def __init__(self, cfg: DistilBertConfig):
        super().__init__()
        self.config = cfg
        self.distilbert = DistilBertModel(cfg)
        self.pre_classifier = nn.Linear(cfg.dim, cfg.dim)
        self.classifier = nn.Linear(cfg.dim, cfg.num_labels)
        self.dropout = Dropout(cfg.seq_classif_dropout)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.distilbert.first_token(input_ids, attention_mask)  # (B, E)
        return self.classifier(self.dropout(F.relu(self.pre_classifier(h))))

    def load_weights(self, tensors: dict, partial: bool = False) -> None:
        """Copy numpy tensors into every parameter (strict), or (``partial``) into those named."""
        params = dict(self.named_parameters())
        check_tensors("tensors", tensors, {n: tuple(p.shape) for n, p in params.items() if not partial or n in tensors})
        with torch.no_grad():
            for n in tensors:
                params[n].copy_(torch.from_numpy(np.ascontiguousarray(tensors[n], dtype=np.float32)))

    def load_partial(self, tensors: dict) -> None:
        """Copy a subset (an adapter); every name must exist with its shape."""
        self.load_weights(tensors, partial=True)

    def state_numpy(self) -> dict:
        return {n: p.detach().cpu().numpy().copy() for n, p in self.named_parameters()}


@in_eval_mode
def distilbert_from_pretrained(
    path: str | os.PathLike, adapter: str | os.PathLike | None = None, num_labels: int | None = None, head_seed: int = 0,
    quantize: str | None = None, double_quant: bool | None = None, compute_dtype: str | None = None, blocksize: int | None = None,
):
    """A DistilBERT classifier from HF weights (a checkpoint without a classification head
    gets ``init_head(cfg, head_seed)``), optionally with an adapter folder (ours or peft's);
    see ``lora_core.models.distilbert.classifier_from_pretrained``. ``quantize="nf4"`` (or a
    bitsandbytes 4-bit checkpoint): a QLoRA base, see ``lora_core.quant.distilbert4bit``."""
    from lora_core.quant import checkpoint4bit as q4

    from .inject import load_lora_adapter

    if q4.wants_4bit(path, quantize, double_quant, compute_dtype, blocksize):
        from lora_core.quant.distilbert4bit import build_4bit_classifier

        from .quant import empty_model, to_4bit

        explicit = q4.check_4bit_request(path, None, quantize, double_quant, blocksize)
        return build_4bit_classifier(DistilBertForSequenceClassification, empty_model, to_4bit, load_lora_adapter, path,
                                     adapter, num_labels, head_seed, quantize, double_quant, compute_dtype, blocksize,
                                     explicit)
    return classifier_from_pretrained(DistilBertForSequenceClassification, load_lora_adapter, path, adapter,
                                      num_labels, head_seed)


__all__ = ["DistilBertForSequenceClassification", "distilbert_from_pretrained"]
