"""The Llama family (Llama, Mistral, Qwen2) as a causal LM for PyTorch, with transformers'
``LlamaForCausalLM`` module and parameter names (spec: ``lora_core.models.llama``).

Contract (same in every backend):
    ``LlamaForCausalLM(cfg)``; ``model(input_ids, past=None, attention_mask=None,
    position_ids=None) -> (logits, present)``; ``model.hidden(...) -> (h, present)``;
    ``model.hidden_unpadded(input_ids, token_index, pad_index) -> (N, E)``;
    ``model.lm_logits(h)``; ``model.load_weights(tensors)`` (strict); ``load_partial``;
    ``state_numpy()``; ``decoding(rows)``. The same as ``GPT2LMModel``'s, so the trainer, the
    KV cache (``KVCache``) and beam search serve both. LoRA goes on with ``inject_lora``
    (peft names: ``q_proj``, ``v_proj``, ...); a peft adapter trained on transformers' model
    loads as it is (``peft_module_prefix`` is empty: the names are the same).
``attention_mask`` (B, T_past + T) marks real tokens with 1; position ids default to
``cumsum(mask) - 1``. Grouped-query attention: the cache keeps ``num_key_value_heads`` heads;
a query head ``h`` reads key/value head ``h // kv_groups`` (transformers' ``repeat_kv``).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lora_core.data.batching import check_token_ids
from lora_core.formats.checkpoint import check_tensors
from lora_core.generate.masks import attention_bias, positions
from lora_core.lora.layers import decoding_weights
from lora_core.models.build import causal_lm_from_pretrained, in_eval_mode
from lora_core.models.llama import LlamaConfig, check_length, rope_tables
from lora_core.train import heap
from lora_core.train.recompute import mlp_chunk_rows

from ._attention import attention
from .gpt2 import KVCache, checkpointed, checkpointed_to
from .lora import LoRALinear, linear_decode, pack_weight


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 (transformers' ``LlamaRMSNorm``)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last dim (``rotate_half`` layout: pairs (i, i + D/2))."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        E, D = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.D, self.groups = cfg.num_attention_heads, cfg.num_key_value_heads, D, cfg.kv_groups
        self.q_proj = LoRALinear(E, self.nh * D, bias=cfg.qkv_bias)
        self.k_proj = LoRALinear(E, self.nkv * D, bias=cfg.qkv_bias)
        self.v_proj = LoRALinear(E, self.nkv * D, bias=cfg.qkv_bias)
        self.o_proj = LoRALinear(self.nh * D, E, bias=cfg.o_bias)
        self.decode_fused = None  # set by LlamaForCausalLM.decoding(): q, k, v as one product

    def forward(self, x, rope, past, bias, unpad=None):
        """``x`` (B, T, E), or the real tokens (N, E) with ``unpad``; ``rope``: cos, sin laid out
        as ``x``'s rows (..., D)."""
        cos, sin = (t.unsqueeze(-2) for t in rope)  # (..., 1, D)
        lead = x.shape[:-1]
        if self.decode_fused is not None:  # inference: one product for q, k, v; q and k rotated at once
            qkv = linear_decode(x, *self.decode_fused).view(*lead, self.nh + 2 * self.nkv, self.D)
            qk = rotate(qkv[..., : self.nh + self.nkv, :], cos, sin)
            q, k, v = qk[..., : self.nh, :], qk[..., self.nh :, :], qkv[..., self.nh + self.nkv :, :]
        else:
            q = rotate(self.q_proj(x).view(*lead, self.nh, self.D), cos, sin)
            k = rotate(self.k_proj(x).view(*lead, self.nkv, self.D), cos, sin)
            v = self.v_proj(x).view(*lead, self.nkv, self.D)
        if unpad is not None:  # packed (N, h, D) -> padded (B, T, h, D); pads read an appended zero row
            token_index, pad_index, B, T = unpad
            if pad_index is None:  # nothing padded (packed text blocks): a view
                q, k, v = (t.view(B, T, *t.shape[1:]) for t in (q, k, v))
            else:
                q, k, v = (torch.cat([t, t.new_zeros(1, *t.shape[1:])]).index_select(0, pad_index)
                           .view(B, T, *t.shape[1:]) for t in (q, k, v))
        B, T = q.shape[0], q.shape[1]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h, T, D)
        if isinstance(past, tuple) and not isinstance(past[0], torch.Tensor):  # a cache object: (cache, layer)
            y = self._grouped(lambda qg, bg: past[0].attend(past[1], qg, k, v, bg), q, bias)
            present = None
        else:
            if past is not None:
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            # the training path on real tokens keeps no cache (and returns no views of k, v: FSDP2
            # warns of a wrapped layer's view outputs)
            present = None if unpad is not None else (k, v)
            if bias is None:  # no past, no padding: plain causal attention
                y = attention(q, k, v, is_causal=True, enable_gqa=self.groups > 1)
            else:
                y = self._grouped(lambda qg, bg: _attend(qg, k, v, bg), q, bias)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.D)
        if unpad is not None:  # back to the real tokens only
            y = y.reshape(B * T, -1) if unpad[1] is None else y.reshape(B * T, -1).index_select(0, unpad[0])
        return self.o_proj(y), present

    def _grouped(self, attend, q, bias):
        """``attend`` with each key/value head's ``groups`` query heads as extra query rows:
        q (B, nh, T, D) -> (B, nkv, groups * T, D), the mask repeated to match (none: the
        preallocated cache of a captured decode step, which keeps its own)."""
        if self.groups == 1:
            return attend(q, bias)
        B, _, T, D = q.shape
        if bias is not None and T > 1:  # one query per row (decoding): its mask row broadcasts
            bias = bias.repeat(1, 1, self.groups, 1)
        y = attend(q.reshape(B, self.nkv, self.groups * T, D), bias)
        return y.reshape(B, self.nh, T, D)


def _attend(q, k, v, bias):
    att = torch.softmax(q @ k.transpose(-1, -2) * (1.0 / q.shape[-1] ** 0.5) + bias, dim=-1)
    return att @ v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        E, F_ = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = LoRALinear(E, F_, bias=cfg.mlp_bias)
        self.up_proj = LoRALinear(E, F_, bias=cfg.mlp_bias)
        self.down_proj = LoRALinear(F_, E, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(self.swiglu(x))

    def swiglu(self, x):
        """``silu(gate_proj(x)) * up_proj(x)``, the input of ``down_proj`` (in training through
        ``SwiGLU``, which keeps less for the backward pass)."""
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return SwiGLU.apply(gate, up)
        return F.silu(gate) * up


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` keeping only its two inputs for the backward pass (autograd's chain
    would also keep ``silu(gate)``, one more (tokens, intermediate) tensor per layer). The
    backward pass recomputes ``silu(gate)`` and takes the rest as autograd's chain does:
    d up = g * silu(gate), d gate = silu_backward(g * up, gate), four passes over the
    (tokens, intermediate) tensors (the formula written out, g * up * s * (1 + gate * (1 - s)),
    took nine: 0.18 s more of a 2 x 256-token step at llama-bench widths than transformers')."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        d_up = g * F.silu(gate) if ctx.needs_input_grad[1] else None
        d_gate = torch.ops.aten.silu_backward(g * up, gate) if ctx.needs_input_grad[0] else None
        return d_gate, d_up


class FrozenMLP(torch.autograd.Function):
    """``mlp(xn)`` for an MLP whose three projections are frozen without LoRA, ``mlp_chunk_rows``
    tokens at a time (``lora_core.train.recompute``), keeping only ``xn`` for the backward pass,
    which recomputes ``gate`` and ``up`` and takes the input gradient in the same pieces: the same
    products as the layer's recomputation up to ``down_proj`` followed by autograd's backward,
    without a (tokens, intermediate) tensor of the whole batch. Used inside a checkpointed layer
    (:func:`checkpointed_frozen_mlp`), whose recomputation passes ``skip``: the MLP's output is
    not needed there, only ``xn`` saved again."""

    @staticmethod
    def forward(ctx, xn, mlp, skip: bool = False):
        ctx.mlp = mlp
        ctx.save_for_backward(xn)
        x2 = xn.reshape(-1, xn.shape[-1])
        out = x2.new_empty(x2.shape[0], mlp.down_proj.out_features)
        if not skip:  # in pieces too: no (tokens, intermediate) tensor of the whole batch here either
            rows = mlp_chunk_rows(x2.shape[0], mlp.gate_proj.out_features, xn.element_size(), True, xn.device.type)
            for a in range(0, x2.shape[0], rows):
                out[a : a + rows] = mlp(x2[a : a + rows])
        return out.view(*xn.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        (xn,) = ctx.saved_tensors
        mlp = ctx.mlp
        x2, g2 = xn.reshape(-1, xn.shape[-1]), g.reshape(-1, g.shape[-1])
        n = x2.shape[0]
        rows = mlp_chunk_rows(n, mlp.gate_proj.out_features, xn.element_size(), device=xn.device.type)
        out = torch.empty_like(x2)
        for a in range(0, n, rows):  # SwiGLU's backward as SwiGLU.backward takes it, then gate's and up's
            xc = x2[a : a + rows]
            gate, up = mlp.gate_proj(xc), mlp.up_proj(xc)
            dh = mlp.down_proj.input_grad(g2[a : a + rows])
            d_up = dh * F.silu(gate)
            d_gate = torch.ops.aten.silu_backward(dh.mul_(up), gate)
            del gate, up, dh
            out[a : a + rows] = mlp.gate_proj.input_grad(d_gate).add_(mlp.up_proj.input_grad(d_up))
        return out.view_as(xn), None, None


def _hooked(*modules) -> bool:
    """Whether any of ``modules`` runs with forward hooks (FSDP2's ``fully_shard`` gathers its
    parameters in them): such a layer is recomputed whole under activation checkpointing."""
    return any(m._forward_pre_hooks or m._forward_hooks for m in modules)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, past, bias, unpad=None):
        a, present = self.self_attn(self.input_layernorm(x), rope, past, bias, unpad)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present

    def down_keeps_nothing(self) -> bool:
        """Whether ``mlp.down_proj`` keeps nothing for the backward pass: frozen, without LoRA
        (its input gradient needs only its weight), and the layer runs without module hooks (a
        sharded layer gathers its parameters in its own). Activation checkpointing then leaves
        it out of what is recomputed (:meth:`before_down`)."""
        d = self.mlp.down_proj
        return (
            not _hooked(self, self.mlp, d)
            and not d.r
            and not any(p.requires_grad for n, p in d.named_parameters() if not n.endswith("bias"))
        )

    def mlp_frozen(self) -> bool:
        """Whether the MLP's three projections are frozen without LoRA, their biases too
        (``FrozenMLP``'s backward gives the input gradient only), and run without module hooks:
        activation checkpointing then keeps of the MLP only its input and takes its backward in
        pieces of tokens."""
        m = self.mlp
        projs = (m.gate_proj, m.up_proj, m.down_proj)
        return not _hooked(self, m, *projs) and not any(
            p.r or any(q.requires_grad for q in p.parameters(recurse=False)) for p in projs
        )

    def before_down(self, x, rope, unpad=None):
        """The training forward up to ``mlp.down_proj``: the residual stream after attention and
        SwiGLU's output; ``forward``'s output is ``x + mlp.down_proj(h)`` of these, the same ops."""
        a, _ = self.self_attn(self.input_layernorm(x), rope, None, None, unpad)
        x = x + a
        return x, self.mlp.swiglu(self.post_attention_layernorm(x))


def checkpointed_frozen_mlp(layer: LlamaDecoderLayer, x, rope, unpad):
    """``layer``'s training forward on the real tokens ``x`` under activation checkpointing, its
    MLP frozen (``layer.mlp_frozen()``): the layer keeps only its input; the backward pass
    recomputes attention and the MLP's input (not the MLP: ``FrozenMLP`` is told to skip it, its
    output is not used) and runs the MLP's backward in pieces of tokens."""
    passes = []

    def run(h):
        skip = bool(passes)  # the first call is the forward pass, later ones the recomputation
        passes.append(1)
        a, _ = layer.self_attn(layer.input_layernorm(h), rope, None, None, unpad)
        h = h + a
        return h + FrozenMLP.apply(layer.post_attention_layernorm(h), layer.mlp, skip)

    return checkpointed_to(run, layer, x)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.padding_idx)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TrimHeap(torch.autograd.Function):
    """The identity at a decoder layer's input, returning the freed heap to the OS
    (``lora_core.train.heap``) where the forward pass enters the layer (``fwd``) and where the
    backward pass leaves it (``bwd``): a CPU training step's peak then holds its live tensors, not
    the free pages glibc keeps of earlier layers' intermediates. Used where ``heap.wanted`` says
    (by default with activation checkpointing or a 4-bit base), at ``heap.trim_points``."""

    @staticmethod
    def forward(ctx, x, fwd: bool = True, bwd: bool = True):
        ctx.bwd = bwd
        if fwd:
            heap.trim()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.bwd:
            heap.trim()
        return g, None, None


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM (see module docstring)."""

    peft_module_prefix = ""  # our module names are transformers' LlamaForCausalLM's
    tied_head_adds_lora = False  # a tied head reads embed_tokens' base table, as transformers + peft

    @property
    def tied_embedding(self) -> str | None:
        """The embedding the LM head reads (``tie_word_embeddings``), or None."""
        return "model.embed_tokens" if self.config.tie_word_embeddings else None

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else LoRALinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.decode_head = None
        self.grad_checkpoint = False  # set_grad_checkpoint: recompute each layer in the backward pass
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin tables, grown on demand

    def rope(self, pos: torch.Tensor, need: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (pos.shape + (D,)) at the positions ``pos``, all below ``need`` (default: read
        off ``pos``): one table lookup per step (the table comes from the spec's ``rope_tables``
        and grows when a longer sequence needs it; ``need`` keeps its size static under compile)."""
        if need is None:
            need = int(pos.max()) + 1 if pos.numel() else 1
        dev = self.model.embed_tokens.weight.device
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].device != dev:
            n = min(max(need, 256, 0 if self._rope is None else 2 * self._rope[0].shape[0]),
                    self.config.max_position_embeddings)
            self._rope = tuple(torch.from_numpy(t).to(dev) for t in rope_tables(self.config, max(n, need)))
        dt = self.model.embed_tokens.weight.dtype
        return tuple(t.index_select(0, pos.reshape(-1)).view(*pos.shape, -1).to(dt) for t in self._rope)

    def decoding(self, rows: int = 80):
        """Weights prepared for no-grad inference inside the block (each projection's weight with
        its LoRA update added, pre-packed for oneDNN on CPU; an attention block's q, k and v as
        one stacked weight where they are copies anyway: ``decode_groups``); parameters untouched."""
        return decoding_weights(self, pack_weight, torch.no_grad, rows, torch.cat)

    def decode_groups(self):
        """The layers that read one input, run as one product when decoding (``decoding_weights``)."""
        return [(layer.self_attn, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
                for layer in self.model.layers]

    def head_weight(self) -> torch.Tensor:
        """The LM head's (vocab, hidden) matrix with its LoRA update added: ``lm_head``'s, or the
        tied ``embed_tokens``' (what :meth:`lm_logits` multiplies by)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.merged_weight()

    def hidden(self, input_ids, past=None, attention_mask=None, position_ids=None):
        """Final hidden states (B, T, E) and the new KV cache: per layer (k, v), (B, nkv, T_all, D),
        or ``past`` itself, advanced in place, when it is a ``KVCache``."""
        dev = self.model.embed_tokens.weight.device
        ids = _ids(input_ids, self.config.vocab_size).to(dev)
        B, T = ids.shape
        cache = past if isinstance(past, KVCache) else None
        t_past = 0 if past is None else cache.length if cache else past[0][0].shape[2]
        check_length(self.config, t_past + T)
        mask = None if attention_mask is None else _np(attention_mask)
        need = None if position_ids is not None else t_past + T  # positions given: read their range
        if position_ids is None:
            position_ids = positions(mask, B, T, t_past)
        bias = None if mask is None and t_past == 0 else torch.from_numpy(attention_bias(mask, T, t_past)).to(dev)
        rope = self.rope(_tensor(position_ids).to(dev), need)
        x = self.model.embed_tokens(ids)
        present = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, rope, None if past is None else (cache, i) if cache else past[i], bias)
            present.append(kv)
        if cache:
            cache.advance(T)
            present = cache
        return self.model.norm(x), present

    def hidden_unpadded(self, input_ids, token_index, pad_index) -> torch.Tensor:
        """Final hidden states (N, E) of the real tokens of a right-padded batch (positions
        0..len-1 per row): norms, projections and MLP on the N real tokens only, attention on
        the padded (B, T) layout; indices as ``lora_core.data.batching.collate`` makes them."""
        dev = self.model.embed_tokens.weight.device
        ids = _ids(input_ids, self.config.vocab_size).to(dev)
        B, T = ids.shape
        check_length(self.config, T)
        tok, pad = _tensor(token_index).to(dev), _tensor(pad_index).to(dev)
        rope = self.rope(tok % T, T)
        dense = tok.numel() == B * T  # no padding: the tokens are the (B, T) layout, row-major
        x = self.model.embed_tokens(ids.reshape(-1) if dense else ids.reshape(-1).index_select(0, tok))
        unpad = (None, None, B, T) if dense else (tok, pad, B, T)
        recompute = self.grad_checkpoint and self.training and torch.is_grad_enabled()
        # (is_compiling first: dynamo cannot trace heap.available's ctypes lookup of the C library)
        trim = (not torch.compiler.is_compiling() and self.training and torch.is_grad_enabled()
                and x.device.type == "cpu"
                and heap.wanted(recompute, any(getattr(m, "is_4bit", False) for m in self.modules()))
                and heap.available())  # fmt: skip
        points = heap.trim_points(len(self.model.layers)) if trim else None
        for i, layer in enumerate(self.model.layers):
            x = TrimHeap.apply(x, *points[i]) if trim and any(points[i]) else x
            # (compiled: the plain checkpoint; dynamo's checkpoint refuses FrozenMLP's skip flag, a side effect)
            if (recompute and layer.mlp_frozen() and not torch.is_autocast_enabled(x.device.type)
                    and not torch.compiler.is_compiling()):  # fmt: skip
                x = checkpointed_frozen_mlp(layer, x, rope, unpad)  # the MLP's backward in pieces of tokens
            elif recompute and layer.down_keeps_nothing():  # recompute up to down_proj: 26% fewer GEMMs at Llama widths
                x, h = checkpointed_to(layer.before_down, layer, x, rope, unpad)
                x = x + layer.mlp.down_proj(h)
            else:
                x = checkpointed(layer, x, rope, None, None, unpad) if recompute else layer(x, rope, None, None, unpad)[0]
        return self.model.norm(x)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.decode_head is not None:
            return linear_decode(h, self.decode_head, None)
        return h @ self.model.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(h)

    def forward(self, input_ids, past=None, attention_mask=None, position_ids=None):
        h, present = self.hidden(input_ids, past, attention_mask, position_ids)
        return self.lm_logits(h), present

    @torch.no_grad()
    def load_weights(self, tensors: dict, partial: bool = False) -> None:
        """Copy numpy tensors (memory maps welcome: converted one at a time) into every
        parameter (strict), or (``partial``) into those named.

        A parameter still on the meta device (a model ``llama_from_pretrained`` builds) takes
        the array itself when it is float32 and contiguous: the pages of a memory-mapped
        checkpoint then back the weight, shared with the page cache and not the process's own
        memory, as transformers' safetensors loading does; a write to it (an optimizer step,
        ``merge_lora``) copies the page it touches (a copy-on-write map: the file never changes)."""
        params = dict(self.named_parameters())
        check_tensors("tensors", tensors, {n: tuple(p.shape) for n, p in params.items() if not partial or n in tensors})
        for n in tensors:
            p, arr = params[n], np.asarray(tensors[n])  # a LazyTensor is read here
            if not p.is_meta:
                p.copy_(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)))
                continue
            if not (arr.dtype == np.float32 and arr.flags.c_contiguous and arr.flags.writeable):
                arr = np.array(arr, dtype=np.float32, order="C")
            owner, _, leaf = n.rpartition(".")
            setattr(self.get_submodule(owner), leaf, nn.Parameter(torch.from_numpy(arr), requires_grad=p.requires_grad))
        left = [n for n, p in self.named_parameters() if p.is_meta]
        if left and not partial:
            raise RuntimeError(f"parameters left without values: {left[:5]}")

    def load_partial(self, tensors: dict) -> None:
        """Copy a subset (an adapter); every name must exist with its shape."""
        self.load_weights(tensors, partial=True)

    def state_numpy(self) -> dict:
        """numpy copies of every parameter, canonical names."""
        return {n: p.detach().cpu().numpy().copy() for n, p in self.named_parameters()}


@in_eval_mode
def llama_from_pretrained(path: str | os.PathLike, adapter: str | os.PathLike | None = None):
    """A Llama-family model from a transformers checkpoint folder (``model.safetensors``,
    sharded safetensors with an index, ``pytorch_model.bin`` or its sharded form), optionally
    with an adapter folder (ours or peft's); see ``lora_core.models.build.causal_lm_from_pretrained``."""
    from .inject import load_lora_adapter

    return causal_lm_from_pretrained(_on_meta, load_lora_adapter, path, adapter)


def _on_meta(cfg: LlamaConfig) -> LlamaForCausalLM:
    """The model without storage: ``load_weights`` gives every parameter the checkpoint's array."""
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _np(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, dtype=np.int64))


def _ids(x, vocab_size: int):
    """Token ids as a tensor: host data (numpy, lists) checked against the vocabulary first
    (``check_token_ids``: ValueError naming the id); a tensor as it is (its lookup raises)."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(check_token_ids(x, vocab_size, "input ids"))


__all__ = ["LlamaForCausalLM", "llama_from_pretrained"]
