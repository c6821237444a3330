"""DistilBERT for sequence classification in Jittor; contract in ``backends.torch.distilbert``,
spec in ``lora_core.models.distilbert``. ``train()``/``eval()`` only switch dropout (as in
``backends.jittor.gpt2``): trainability belongs to ``mark_only_lora_trainable``."""

from __future__ import annotations

import os

import jittor as jt
import numpy as np
from jittor import nn

from lora_core.formats.checkpoint import check_tensors
from lora_core.models.build import in_eval_mode
from lora_core.models.distilbert import DistilBertConfig, attention_scale, classifier_from_pretrained, pack_indices

from ._gpu_check import ensure_gpu_ok
from ._kernels import bmm, bmm_nt, softmax_scaled
from ._lean_layers import LayerNorm, gelu
from .gpt2 import checkpointed, recomputing
from .lora import LoRAEmbedding, TrainEvalMixin, assign_keep_grad

_NEG = -1e30  # additive bias of padded keys (finite: no inf - inf)


class Dropout(nn.Dropout):
    """``nn.Dropout``; in parity mode its masks come from the shared numpy stream."""

    mask_source = None

    def execute(self, x: jt.Var) -> jt.Var:
        if self.mask_source is not None and self.is_training() and self.p > 0:
            return x * jt.array(self.mask_source.mask(tuple(x.shape), self.p))
        return super().execute(x)


class Packed:
    """Index Vars of the real tokens of a padded batch (``lora_core.models.distilbert.pack_indices``)."""

    def __init__(self, token_index, pad_index, cls_index):
        self.token_index, self.pad_index, self.cls_index = (jt.array(a) for a in (token_index, pad_index, cls_index))

    @staticmethod
    def of(attention_mask: jt.Var) -> Packed | None:
        found = pack_indices(attention_mask.numpy())
        return None if found is None else Packed(*found)


class Embeddings(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        # torch's nn.Embedding(padding_idx=pad_token_id), as transformers: the pad row gets no gradient
        self.word_embeddings = LoRAEmbedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.dim)
        self.LayerNorm = LayerNorm(cfg.dim, eps=1e-12)
        self.dropout = Dropout(cfg.dropout)

    def execute(self, ids: jt.Var, packed: Packed | None = None) -> jt.Var:
        pos = jt.arange(ids.shape[1])
        if packed is not None:  # (N,) real tokens
            ids, pos = ids.reshape(-1)[packed.token_index], pos.repeat(ids.shape[0])[packed.token_index]
        return self.dropout(self.LayerNorm(self.word_embeddings(ids) + self.position_embeddings(pos)))


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        self.n_heads, self.scale = cfg.n_heads, attention_scale(cfg)
        self.q_lin, self.k_lin = nn.Linear(cfg.dim, cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.v_lin, self.out_lin = nn.Linear(cfg.dim, cfg.dim), nn.Linear(cfg.dim, cfg.dim)
        self.dropout = Dropout(cfg.attention_dropout)

    def execute(self, x: jt.Var, bias: jt.Var, packed: Packed | None = None) -> jt.Var:
        B, T, E = bias.shape[0], bias.shape[-1], x.shape[-1]
        nh, hs = self.n_heads, E // self.n_heads

        def heads(t):  # (B, T, E) or packed (N, E) -> (B * nh, T, hs)
            if packed is not None:  # padding reads an appended zero row
                t = jt.concat([t, jt.zeros((1, E), dtype=t.dtype)])[packed.pad_index]
            return t.reshape(B, T, nh, hs).transpose(0, 2, 1, 3).reshape(B * nh, T, hs)

        q, k, v = heads(self.q_lin(x)), heads(self.k_lin(x)), heads(self.v_lin(x))
        att = softmax_scaled(bmm_nt(q, k).reshape(B, nh, T, T), bias, self.scale)  # (B, nh, T, T)
        y = bmm(self.dropout(att).reshape(B * nh, T, T), v)  # (B * nh, T, hs)
        y = y.reshape(B, nh, T, hs).transpose(0, 2, 1, 3).reshape(B, T, E)
        if packed is not None:
            y = y.reshape(B * T, E)[packed.token_index]  # (N, E)
        return self.out_lin(y)


class FFN(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        self.lin1, self.lin2 = nn.Linear(cfg.dim, cfg.hidden_dim), nn.Linear(cfg.hidden_dim, cfg.dim)
        self.dropout = Dropout(cfg.dropout)

    def execute(self, x: jt.Var) -> jt.Var:
        return self.dropout(self.lin2(gelu(self.lin1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        self.attention = MultiHeadSelfAttention(cfg)
        self.sa_layer_norm = LayerNorm(cfg.dim, eps=1e-12)
        self.ffn = FFN(cfg)
        self.output_layer_norm = LayerNorm(cfg.dim, eps=1e-12)

    def execute(self, x: jt.Var, bias: jt.Var, packed: Packed | None = None) -> jt.Var:
        x = self.sa_layer_norm(self.attention(x, bias, packed) + x)
        return self.output_layer_norm(self.ffn(x) + x)


class Transformer(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        self.layer = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])


class DistilBertModel(nn.Module):
    def __init__(self, cfg: DistilBertConfig):
        self.embeddings = Embeddings(cfg)
        self.transformer = Transformer(cfg)
        self.grad_checkpoint = False  # set_grad_checkpoint: recompute each block in the backward pass

    def execute(self, ids: jt.Var, attention_mask: jt.Var | None = None) -> jt.Var:
        """Hidden states (B, T, E); with padding, its rows are zeros."""
        h, packed = self._run(ids, attention_mask)
        if packed is None:
            return h
        B, T = ids.shape
        return jt.concat([h, jt.zeros((1, h.shape[-1]), dtype=h.dtype)])[packed.pad_index].reshape(B, T, -1)

    def first_token(self, ids: jt.Var, attention_mask: jt.Var | None = None) -> jt.Var:
        """Hidden state of each sequence's first token, (B, E)."""
        h, packed = self._run(ids, attention_mask)
        return h[:, 0] if packed is None else h[packed.cls_index]

    def _run(self, ids, attention_mask):
        """Per-token layers on the real tokens only (packed (N, E)); attention padded."""
        B, T = ids.shape
        packed = None if attention_mask is None else Packed.of(attention_mask)
        if packed is None:
            bias = jt.zeros((B, 1, T, T))
        else:
            bias = ((1.0 - attention_mask.float32()) * _NEG).reshape(B, 1, 1, T).broadcast((B, 1, T, T))
        h = self.embeddings(ids, packed)
        recompute = recomputing(self)
        for block in self.transformer.layer:
            h = checkpointed(block, h, bias, packed) if recompute else block(h, bias, packed)
        return h, packed


class DistilBertForSequenceClassification(TrainEvalMixin, nn.Module):
    """``transformers.DistilBertForSequenceClassification`` (see ``backends.torch.distilbert``)."""

    def __init__(self, cfg: DistilBertConfig):
        ensure_gpu_ok()  # on a GPU: jittor's numbers checked against numpy before any model work
        self.config = cfg
        self.distilbert = DistilBertModel(cfg)
        self.pre_classifier = nn.Linear(cfg.dim, cfg.dim)
        self.classifier = nn.Linear(cfg.dim, cfg.num_labels)
        self.dropout = Dropout(cfg.seq_classif_dropout)

    def execute(self, input_ids: jt.Var, attention_mask: jt.Var | None = None) -> jt.Var:
        h = self.distilbert.first_token(input_ids, attention_mask)  # (B, E)
        return self.classifier(self.dropout(nn.relu(self.pre_classifier(h))))

    def load_weights(self, tensors: dict, partial: bool = False) -> None:
        """Copy numpy tensors into every parameter (strict), or (``partial``) into those named."""
        params = dict(self.named_parameters())
        check_tensors("tensors", tensors, {n: tuple(p.shape) for n, p in params.items() if not partial or n in tensors})
        for n in tensors:
            assign_keep_grad(params[n], jt.array(np.ascontiguousarray(tensors[n], dtype=np.float32)))
        jt.sync([params[n] for n in tensors])

    def load_partial(self, tensors: dict) -> None:
        """Copy a subset (an adapter); every name must exist with its shape."""
        self.load_weights(tensors, partial=True)

    def state_numpy(self) -> dict:
        return {n: p.numpy().copy() for n, p in self.named_parameters()}


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

    ensure_gpu_ok()  # before reading the checkpoint (the model's constructor checks too)
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
