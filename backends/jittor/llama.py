"""The Llama family (Llama, Mistral, Qwen2) as a causal LM for Jittor; the contract is documented
in ``backends.torch.llama``, the spec in ``lora_core.models.llama``.

``train()``/``eval()`` only switch ``is_train`` (``TrainEvalMixin``, as in ``backends.jittor.gpt2``):
trainability belongs to ``inject_lora`` / ``mark_only_lora_trainable``. Every projection is a
``LoRALinear``, so ``inject_lora`` adapts it in place and ``decoding()`` packs it; the KV cache
and the attention product are GPT-2's (``KVCache``, ``attention``), grouped-query heads folded
into extra query rows of their key/value head.
"""

from __future__ import annotations

import os

import jittor as jt
import numpy as np
from jittor import nn

from lora_core.data.batching import check_token_ids
from lora_core.formats.checkpoint import check_tensors
from lora_core.generate.masks import attention_bias, positions
from lora_core.lora.layers import decoding_weights
from lora_core.models.build import causal_lm_from_pretrained, in_eval_mode
from lora_core.models.llama import LlamaConfig, check_length, rope_tables

from ._gpu_check import ensure_gpu_ok
from ._lean_layers import frozen_matmul_t
from .gpt2 import KVCache, attention, checkpointed, recomputing
from .lora import LoRAEmbedding, LoRALinear, TrainEvalMixin, assign_keep_grad, linear_decode, pack_weight


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 (transformers' ``LlamaRMSNorm``)."""

    def __init__(self, n: int, eps: float):
        self.weight, self.eps = jt.ones((n,)), eps

    def execute(self, x: jt.Var) -> jt.Var:
        h = x if x.dtype == "float32" else x.float32()
        h = h * jt.rsqrt((h * h).mean(-1, keepdims=True) + self.eps)
        return self.weight * (h if x.dtype == "float32" else h.cast(x.dtype))


def rotate(x: jt.Var, cos: jt.Var, sin: jt.Var) -> jt.Var:
    """RoPE on the last dim (``rotate_half`` layout: pairs (i, i + D/2))."""
    half = x.shape[-1] // 2
    return x * cos + jt.concat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        E, D = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.D, self.groups = cfg.num_attention_heads, cfg.num_key_value_heads, D, cfg.kv_groups
        self.q_proj = LoRALinear(E, self.nh * D, bias=cfg.qkv_bias)
        self.k_proj = LoRALinear(E, self.nkv * D, bias=cfg.qkv_bias)
        self.v_proj = LoRALinear(E, self.nkv * D, bias=cfg.qkv_bias)
        self.o_proj = LoRALinear(self.nh * D, E, bias=cfg.o_bias)
        self.decode_fused = None  # set by LlamaForCausalLM.decoding(): q, k, v as one product

    def execute(self, x, rope, past, bias, unpad=None):
        """``x`` (B, T, E), or the real tokens (N, E) with ``unpad``; ``rope``: cos, sin laid out
        as ``x``'s rows (..., D)."""
        cos, sin = (t.unsqueeze(-2) for t in rope)  # (..., 1, D)
        lead = tuple(x.shape[:-1])
        if self.decode_fused is not None:  # inference: one product for q, k, v; q and k rotated at once
            qkv = linear_decode(x, *self.decode_fused).reshape(*lead, self.nh + 2 * self.nkv, self.D)
            qk = rotate(qkv[..., : self.nh + self.nkv, :], cos, sin)
            q, k, v = qk[..., : self.nh, :], qk[..., self.nh :, :], qkv[..., self.nh + self.nkv :, :]
        else:
            q = rotate(self.q_proj(x).reshape(*lead, self.nh, self.D), cos, sin)
            k = rotate(self.k_proj(x).reshape(*lead, self.nkv, self.D), cos, sin)
            v = self.v_proj(x).reshape(*lead, self.nkv, self.D)
        if unpad is not None:  # packed (N, h, D) -> padded (B, T, h, D); pads read an appended zero row
            token_index, pad_index, B, T = unpad
            q, k, v = (jt.concat([t, jt.zeros((1, *t.shape[1:]), dtype=t.dtype)], 0)[pad_index].reshape(B, T, *t.shape[1:])
                       for t in (q, k, v))
        B, T = q.shape[0], q.shape[1]
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, h, T, D)
        if isinstance(past, tuple) and isinstance(past[0], KVCache):  # (cache, layer)
            y = self._grouped(lambda qg, bg: past[0].attend(past[1], qg, k, v, bg), q, bias)
            present = None
        else:
            if past is not None:
                k, v = jt.concat([past[0], k], dim=2), jt.concat([past[1], v], dim=2)
            present = (k, v)
            y = self._grouped(lambda qg, bg: attention(qg, k, v, bg), q, bias)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, self.nh * self.D)
        if unpad is not None:  # back to the real tokens only
            y = y.reshape(B * T, -1)[unpad[0]]
        return self.o_proj(y), present

    def _grouped(self, attend, q, bias):
        """``attend`` with each key/value head's ``groups`` query heads as extra query rows:
        q (B, nh, T, D) -> (B, nkv, groups * T, D), the mask repeated to match."""
        if self.groups == 1:
            return attend(q, bias)
        B, _, T, D = q.shape
        y = attend(q.reshape(B, self.nkv, self.groups * T, D), bias.repeat(1, 1, self.groups, 1))
        return y.reshape(B, self.nh, T, D)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        E, F_ = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = LoRALinear(E, F_, bias=cfg.mlp_bias)
        self.up_proj = LoRALinear(E, F_, bias=cfg.mlp_bias)
        self.down_proj = LoRALinear(F_, E, bias=cfg.mlp_bias)

    def execute(self, x):
        g = self.gate_proj(x)
        return self.down_proj(g * jt.sigmoid(g) * self.up_proj(x))  # SiLU-gated


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def execute(self, x, rope, past, bias, unpad=None):
        a, present = self.self_attn(self.input_layernorm(x), rope, past, bias, unpad)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        self.embed_tokens = LoRAEmbedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.padding_idx)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(TrainEvalMixin, nn.Module):
    """A Llama-family causal LM (see ``backends.torch.llama``)."""

    peft_module_prefix = ""  # our module names are transformers' LlamaForCausalLM's
    tied_head_adds_lora = False  # a tied head reads embed_tokens' base table, as transformers + peft

    @property
    def tied_embedding(self) -> str | None:
        """The embedding the LM head reads (``tie_word_embeddings``), or None."""
        return "model.embed_tokens" if self.config.tie_word_embeddings else None

    def __init__(self, cfg: LlamaConfig):
        ensure_gpu_ok()  # on a GPU: jittor's numbers checked against numpy before any model work
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else LoRALinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.decode_head = None
        self.grad_checkpoint = False  # set_grad_checkpoint: recompute each layer in the backward pass
        self._rope: tuple[np.ndarray, np.ndarray] | None = None  # cos, sin tables (numpy), grown on demand

    def rope(self, pos, need: int | None = None):
        """cos, sin (pos.shape + (D,)) at the positions ``pos``, all below ``need`` (default: read
        off ``pos``) (the spec's ``rope_tables``, grown when a longer sequence needs them)."""
        pos = _np(pos).astype(np.int64)
        if need is None:
            need = int(pos.max()) + 1 if pos.size else 1
        if self._rope is None or self._rope[0].shape[0] < need:
            n = min(max(need, 256, 0 if self._rope is None else 2 * self._rope[0].shape[0]),
                    self.config.max_position_embeddings)
            self._rope = rope_tables(self.config, max(n, need))
        dt = self.model.embed_tokens.weight.dtype
        return tuple(jt.array(t[pos]).cast(dt) for t in self._rope)

    def decoding(self, rows: int = 80):
        """Weights prepared for no-grad inference inside the block (see the torch backend)."""
        return decoding_weights(self, pack_weight, jt.no_grad, rows, lambda parts: jt.concat(parts, 0))

    def decode_groups(self):
        """The layers that read one input, run as one product when decoding (see the torch backend)."""
        return [(layer.self_attn, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
                for layer in self.model.layers]

    def head_weight(self):
        """The LM head's (vocab, hidden) matrix with its LoRA update added (see the torch backend)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.merged_weight()

    def hidden(self, input_ids, past=None, attention_mask=None, position_ids=None):
        """Final hidden states (B, T, E) and the new KV cache."""
        ids = _ids(input_ids, self.config.vocab_size)
        B, T = ids.shape
        cache = past if isinstance(past, KVCache) else None
        t_past = 0 if past is None else cache.length if cache else past[0][0].shape[2]
        check_length(self.config, t_past + T)
        mask = None if attention_mask is None else _np(attention_mask)
        if position_ids is None:
            position_ids = positions(mask, B, T, t_past)
        bias = jt.array(attention_bias(mask, T, t_past))
        rope = self.rope(position_ids)
        x = self.model.embed_tokens(ids)
        present = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, rope, None if past is None else (cache, i) if cache else past[i], bias)
            present.append(kv)
        if cache:
            cache.advance(T)
            present = cache
        return self.model.norm(x), present

    def hidden_unpadded(self, input_ids, token_index, pad_index):
        """Final hidden states (N, E) of the real tokens of a right-padded batch; see the torch backend."""
        ids = _ids(input_ids, self.config.vocab_size)
        B, T = ids.shape
        check_length(self.config, T)
        tok, pad = _var(token_index), _var(pad_index)
        rope = self.rope(_np(token_index) % T)
        bias = jt.array(attention_bias(None, T, 0))
        x = self.model.embed_tokens(ids.reshape(-1)[tok])
        unpad = (tok, pad, B, T)
        recompute = recomputing(self)
        for layer in self.model.layers:
            x = checkpointed(layer, x, rope, None, bias, unpad) if recompute else layer(x, rope, None, bias, unpad)[0]
        return self.model.norm(x)

    def lm_logits(self, h):
        if self.decode_head is not None:
            return linear_decode(h, self.decode_head, None)
        return frozen_matmul_t(h, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)

    def execute(self, input_ids, past=None, attention_mask=None, position_ids=None):
        h, present = self.hidden(input_ids, past, attention_mask, position_ids)
        return self.lm_logits(h), present

    def load_weights(self, tensors: dict, partial: bool = False) -> None:
        """Copy numpy tensors (memory maps welcome: converted one at a time) into every
        parameter (strict), or (``partial``) into those named."""
        params = dict(self.named_parameters())
        check_tensors("tensors", tensors, {n: tuple(p.shape) for n, p in params.items() if not partial or n in tensors})
        for n in tensors:
            assign_keep_grad(params[n], jt.array(np.ascontiguousarray(tensors[n], dtype=np.float32)))
            params[n].sync()

    def load_partial(self, tensors: dict) -> None:
        """Copy a subset (an adapter); every name must exist with its shape."""
        self.load_weights(tensors, partial=True)

    def state_numpy(self) -> dict:
        """numpy copies of every parameter, canonical names."""
        return {n: p.numpy().copy() for n, p in self.named_parameters()}


@in_eval_mode
def llama_from_pretrained(path: str | os.PathLike, adapter: str | os.PathLike | None = None):
    """A Llama-family model from a transformers checkpoint folder, optionally with an adapter
    folder (ours or peft's); see ``lora_core.models.build.causal_lm_from_pretrained``."""
    from .inject import load_lora_adapter

    ensure_gpu_ok()  # before reading the checkpoint (the model's constructor checks too)
    return causal_lm_from_pretrained(LlamaForCausalLM, load_lora_adapter, path, adapter)


def _np(x):
    return x.numpy() if isinstance(x, jt.Var) else np.asarray(x)


def _var(x):
    return x if isinstance(x, jt.Var) else jt.array(np.asarray(x, dtype=np.int64))


def _ids(x, vocab_size: int):
    """Token ids as a Var: host data (numpy, lists) checked against the vocabulary first
    (``check_token_ids``: ValueError naming the id, as torch). A ``jt.Var`` is taken as it is,
    unchecked (checking it would read it back from the device): jittor's lookup does no bounds
    check, so an id outside the vocabulary gives garbage rows there, not an error."""
    return x if isinstance(x, jt.Var) else jt.array(check_token_ids(x, vocab_size, "input ids"))


__all__ = ["LlamaForCausalLM", "llama_from_pretrained"]
