"""GPT-2 LM with LoRA for Jittor; the contract is documented in ``backends.torch.gpt2``.

``train()``/``eval()`` only switch dropout here: jittor's own ``Module.eval`` stops every
gradient and its ``train`` restarts those it recorded on the first ``eval``, which would
unfreeze frozen base weights; trainability belongs to ``mark_only_lora_as_trainable``.
"""

from __future__ import annotations

import math

import jittor as jt
import numpy as np
from jittor import nn

from lora_core.data.batching import check_token_ids
from lora_core.formats.checkpoint import check_tensors
from lora_core.generate.beam import compose_rows
from lora_core.generate.masks import attention_bias, positions
from lora_core.lora.dropout import BlockMasks, ReplayMasks
from lora_core.lora.layers import decoding_weights
from lora_core.models.gpt2 import GPT2Config, LoRAConfig, check_length, matches_target

from ._gpu_check import ensure_gpu_ok
from ._kernels import bmm, bmm_nt, grow_rows, rows_dot, softmax_scaled
from ._lean_layers import LayerNorm, gelu_tanh
from .lora import (
    LoRAEmbedding,
    LoRALinear,
    LoRAMergedLinear,
    TrainEvalMixin,
    assign_keep_grad,
    linear_decode,
    pack_weight,
)


class KVCache:
    """KV cache for beam search (contract in ``backends.torch.gpt2.KVCache``): the prompt's
    keys and values once per input, shared by its beams, and the generated positions per
    beam, whose pending reorder the next forward pass gathers in the same lazy expression
    that appends the new positions. For inference: no gradient flows through it."""

    def __init__(self, past, repeats: int = 1):
        self.prompt = [(k.detach(), v.detach()) for k, v in past]
        self.repeats, self.length = repeats, past[0][0].shape[2]
        self.generated = [None] * len(past)  # (rows * repeats, nh, t, hs) pairs once t > 0
        self.rows = None  # pending reorder (numpy)
        self._index = None  # as a jittor var, made once per step

    def reorder(self, rows: np.ndarray) -> None:
        """Row ``j`` continues old row ``rows[j]``, a beam of the same input (applied by the
        next forward pass)."""
        self.rows = compose_rows(self.rows, rows, self.repeats)
        self._index = None

    def attend(self, i: int, q: jt.Var, k: jt.Var, v: jt.Var, bias: jt.Var) -> jt.Var:
        """Layer ``i``: append the new keys/values to the (reordered) generated ones and return
        the attention output for the queries ``q`` (rows, nh, T, hs)."""
        k, v = k.detach(), v.detach()
        old = self.generated[i]
        if old is None:
            kg, vg = k, v
        else:
            if self._index is None:  # one index var per step, shared by the layers
                self._index = jt.array(np.arange(k.shape[0], dtype=np.int64) if self.rows is None else self.rows)
            kg, vg = grow_rows(old[0], k, self._index), grow_rows(old[1], v, self._index)
        self.generated[i] = (kg, vg)
        kp, vp = self.prompt[i]
        R, nh, T, hs = q.shape
        B, P, beam = kp.shape[0], kp.shape[2], self.repeats
        if T != 1:  # a multi-token step: attend to the prompt repeated for every beam
            kp, vp = kp.repeat_interleave(beam, 0), vp.repeat_interleave(beam, 0)
            return attention(q, jt.concat([kp, kg], dim=2), jt.concat([vp, vg], dim=2), bias)
        # one token per row: the beams of an input are the query rows of one product with its prompt
        qb = q.reshape(B, beam, nh, hs).transpose(0, 2, 1, 3).reshape(B * nh, beam, hs)
        sp = bmm_nt(qb, kp.reshape(B * nh, P, hs)).reshape(B, nh, beam, P).transpose(0, 2, 1, 3).reshape(R, nh, 1, P)
        sg = rows_dot(q, kg)  # (R, nh, 1, t)
        att = softmax_scaled(jt.concat([sp, sg], dim=-1), bias, 1.0 / math.sqrt(hs))
        ap = att[:, :, :, :P].reshape(B, beam, nh, P).transpose(0, 2, 1, 3).reshape(B * nh, beam, P)
        yp = bmm(ap, vp.reshape(B * nh, P, hs)).reshape(B, nh, beam, hs).transpose(0, 2, 1, 3).reshape(R, nh, 1, hs)
        return yp + (att[:, :, :, P:].transpose(0, 1, 3, 2) * vg).sum(2).unsqueeze(2)

    def advance(self, T: int) -> None:
        """Called once every layer has taken its ``T`` new positions."""
        self.length += T
        self.rows = self._index = None


def attention(q: jt.Var, k: jt.Var, v: jt.Var, bias: jt.Var, dropout=None) -> jt.Var:
    """softmax(q k^T / sqrt(hs) + bias) v for (B, nh, T|L, hs) operands -> (B, nh, T, hs)."""
    B, nh, T, hs = q.shape
    L = k.shape[2]
    if T == 1 and dropout is None:  # one token against a cache: fused multiply-reduce, no transposed copy of k
        att = softmax_scaled((q * k).sum(-1).unsqueeze(2), bias, 1.0 / math.sqrt(hs))  # (B, nh, 1, L)
        return (att.transpose(0, 1, 3, 2) * v).sum(2).unsqueeze(2)
    att = bmm_nt(q.reshape(B * nh, T, hs), k.reshape(B * nh, L, hs))
    att = softmax_scaled(att.reshape(B, nh, T, L), bias, 1.0 / math.sqrt(hs))
    if dropout is not None:
        att = dropout(att)
    return bmm(att.reshape(B * nh, T, L), v.reshape(B * nh, L, hs)).reshape(B, nh, T, hs)


def _linear(name: str, fin: int, fout: int, lora: LoRAConfig | None) -> LoRALinear:
    if lora is None or lora.r == 0 or not any(matches_target(name, t) for t in lora.target_modules):
        return LoRALinear(fin, fout)
    if name.endswith("attn.c_attn") and lora.enable_lora is not None:
        return LoRAMergedLinear(fin, fout, lora.r, lora.alpha, lora.dropout, lora.enable_lora)
    return LoRALinear(fin, fout, lora.r, lora.alpha, lora.dropout)


def _dropout(p: float):
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, lora: LoRAConfig | None, prefix: str):
        E = cfg.n_embd
        self.n_head = cfg.n_head
        self.c_attn = _linear(prefix + "attn.c_attn", E, 3 * E, lora)
        self.c_proj = _linear(prefix + "attn.c_proj", E, E, lora)
        self.attn_dropout = _dropout(cfg.attn_pdrop)
        self.resid_dropout = _dropout(cfg.resid_pdrop)

    def execute(self, x, past, bias, unpad=None):
        qkv = self.c_attn(x)
        if unpad is not None:  # packed (N, 3E) -> padded (B, T, 3E); pads read an appended zero row
            token_index, pad_index, B, T = unpad
            qkv = jt.concat([qkv, jt.zeros((1, qkv.shape[-1]))], 0)[pad_index].reshape(B, T, -1)
        B, T, E = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        hs = E // self.n_head
        q, k, v = (qkv[..., i * E:(i + 1) * E].reshape(B, T, self.n_head, hs).transpose(0, 2, 1, 3)
                   for i in range(3))  # (B, nh, T, hs)
        if isinstance(past, tuple) and isinstance(past[0], KVCache):
            y, present = past[0].attend(past[1], q, k, v, bias), None
        else:
            if past is not None:
                k, v = jt.concat([past[0], k], dim=2), jt.concat([past[1], v], dim=2)
            y, present = attention(q, k, v, bias, self.attn_dropout if self.is_training() else None), (k, v)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, E)
        if unpad is not None:  # back to the real tokens only
            y = y.reshape(B * T, E)[token_index]
        return self.resid_dropout(self.c_proj(y)), present


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config, lora: LoRAConfig | None, prefix: str):
        E = cfg.n_embd
        self.c_fc = _linear(prefix + "mlp.c_fc", E, 4 * E, lora)
        self.c_proj = _linear(prefix + "mlp.c_proj", 4 * E, E, lora)
        self.dropout = _dropout(cfg.resid_pdrop)

    def execute(self, x):
        return self.dropout(self.c_proj(gelu_tanh(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, lora: LoRAConfig | None, prefix: str):
        self.ln_1 = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg, lora, prefix)
        self.ln_2 = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, lora, prefix)

    def execute(self, x, past, bias, unpad=None):
        a, present = self.attn(self.ln_1(x), past, bias, unpad)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class GPT2LMModel(TrainEvalMixin, nn.Module):
    """GPT-2 with a tied LM head and optional LoRA layers."""

    peft_module_prefix = "transformer."  # module names of transformers' GPT2LMHeadModel (peft adapters)
    # the LM head reads wte (tied), its LoRA update included: a peft adapter that adapts or saves
    # wte means another head (peft keeps the head on the base table), lora_core.formats.adapter_io
    tied_embedding, tied_head_adds_lora = "wte", True

    def __init__(self, cfg: GPT2Config, lora: LoRAConfig | None = None):
        ensure_gpu_ok()  # on a GPU: jittor's numbers checked against numpy before any model work
        self.config, self.lora_config = cfg, lora
        wte_lora = lora is not None and lora.r and "wte" in lora.target_modules
        self.wte = LoRAEmbedding(cfg.vocab_size, cfg.n_embd, lora.r, lora.alpha) if wte_lora \
            else LoRAEmbedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = LoRAEmbedding(cfg.n_positions, cfg.n_embd)
        self.drop = _dropout(cfg.embd_pdrop)
        self.h = nn.ModuleList([Block(cfg, lora, f"h.{i}.") for i in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.decode_head = None
        self.grad_checkpoint = False  # set_grad_checkpoint: recompute each block in the backward pass

    def decoding(self, rows: int = 80):
        """Weights prepared for no-grad inference inside the block (see the torch backend):
        each linear layer and the LM head use a materialised (in, out) copy of their weight
        with the LoRA update added. The parameters are untouched."""
        return decoding_weights(self, pack_weight, jt.no_grad, rows)

    def head_weight(self):
        """The tied LM head's (vocab, n_embd) matrix, ``wte``'s with its LoRA update added (what
        :meth:`lm_logits` multiplies by)."""
        return self.wte.merged_weight()

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
        x = self.drop(self.wte(ids) + self.wpe(_var(position_ids)))
        present = []
        for i, block in enumerate(self.h):
            x, kv = block(x, None if past is None else (cache, i) if cache else past[i], bias)
            present.append(kv)
        if cache:
            cache.advance(T)
            present = cache
        return self.ln_f(x), present

    def hidden_unpadded(self, input_ids, token_index, pad_index):
        """Final hidden states (N, E) of the real tokens of a right-padded batch; see the torch backend."""
        ids = _ids(input_ids, self.config.vocab_size)
        B, T = ids.shape
        check_length(self.config, T)
        tok, pad = _var(token_index), _var(pad_index)
        bias = jt.array(attention_bias(None, T, 0))
        x = self.drop(self.wte(ids.reshape(-1)[tok]) + self.wpe(tok % T))
        recompute = recomputing(self)
        for block in self.h:
            unpad = (tok, pad, B, T)
            x = checkpointed(block, x, None, bias, unpad) if recompute else block(x, None, bias, unpad)[0]
        return self.ln_f(x)

    def lm_logits(self, h):
        if self.decode_head is not None:
            return linear_decode(h, self.decode_head, None)
        w = self.wte.weight
        if self.wte.r and not self.wte.merged:
            w = w + self.wte.delta_weight()
        return nn.matmul_transpose(h, w)

    def execute(self, input_ids, past=None, attention_mask=None, position_ids=None):
        h, present = self.hidden(input_ids, past, attention_mask, position_ids)
        return self.lm_logits(h), present

    def load_weights(self, tensors: dict) -> None:
        """Copy numpy tensors into every parameter (strict)."""
        params = dict(self.named_parameters())
        check_tensors("tensors", tensors, {n: tuple(p.shape) for n, p in params.items()})
        self._assign(params, tensors)

    def load_partial(self, tensors: dict) -> None:
        """Copy a subset (an adapter); every name must exist with its shape."""
        params = dict(self.named_parameters())
        check_tensors("tensors", tensors, {n: tuple(p.shape) for n, p in params.items() if n in tensors})
        self._assign(params, tensors)

    @staticmethod
    def _assign(params, tensors):
        for n, v in tensors.items():
            if n in params:
                assign_keep_grad(params[n], jt.array(np.ascontiguousarray(v, dtype=np.float32)))
        jt.sync(list(params.values()))

    def state_numpy(self) -> dict:
        return {n: p.numpy().copy() for n, p in self.named_parameters()}


class _Recomputed(jt.Function):
    """``run(x)`` whose intermediates are not kept: the forward pass runs under ``no_grad``
    and keeps only ``x``; the backward pass runs ``run`` again with gradients on and
    differentiates it for ``x`` and ``params`` (the trainable parameters ``run`` reads,
    passed as inputs so that their gradients leave through this function)."""

    def __init__(self, run, params: list):
        self.run, self.params = run, params  # the parameters themselves: execute gets taped copies

    def execute(self, x, *params):
        self.x = x
        with jt.no_grad():
            y = self.run(x)
        return y

    def grad(self, g):
        x = self.x.detach()
        needs_x = self.input_mask[0] >= 0  # (jt.Function's record; the taped x reads as stop_grad)
        with jt.enable_grad():
            if needs_x:
                x.start_grad()
            out = self.run(x)
            wrt = ([x] if needs_x else []) + list(self.params)
            # g detached: else the outer backward pass counts the parameters' use here again
            grads = jt.grad((out * g.detach()).sum(), wrt) if wrt else []
        return ([None] if not needs_x else []) + list(grads)


class _JittorMasks:
    """jittor's own dropout masks (``nn.Dropout``'s: keep where a uniform draw exceeds ``p``)
    as a mask source, so that ``ReplayMasks`` can record them."""

    @staticmethod
    def mask(shape: tuple[int, ...], p: float) -> jt.Var:
        return (jt.random(shape) > p).stop_grad()


def _replayed_dropout(m: nn.Dropout, replay: ReplayMasks):
    def execute(x):
        if not (m.is_train and 0 < m.p < 1):
            return nn.Dropout.execute(m, x)
        return (x * replay.mask(tuple(x.shape), m.p).int() / (1.0 - m.p)).to(x.dtype)  # as nn.Dropout
    return execute


class _BlockDropout:
    """Every dropout mask of one checkpointed block, recorded in the first pass and replayed
    in the recomputation: parity-mode masks (``BlockMasks``) and jittor's own, which its RNG
    draws when the graph runs (so re-seeding could not repeat them)."""

    def __init__(self, block):
        self.parity = BlockMasks(block.modules())
        self.own = [m for m in block.modules()
                    if isinstance(m, nn.Dropout) and m.p > 0 and getattr(m, "mask_source", None) is None]
        self.replays = [ReplayMasks(_JittorMasks) for _ in self.own]

    def run(self, fn, *args):
        sources = self.parity.start()
        for m, r in zip(self.own, self.replays):
            r.start()
            m.execute = _replayed_dropout(m, r)  # an instance attribute: shadows the class's execute
        try:
            return fn(*args)
        finally:
            self.parity.stop(sources)
            for m in self.own:
                del m.execute


def checkpointed(block, x: jt.Var, *args) -> jt.Var:
    """``block(x, *args)`` (or its first output) without keeping its activations (see the torch backend): a
    ``jt.Function`` recomputes them in the backward pass, with the dropout masks of the
    forward pass (``_BlockDropout``)."""
    params = [p for p in block.parameters() if p.requires_grad]
    masks = _BlockDropout(block)
    return _Recomputed(lambda h: first(masks.run(block, h, *args)), params)(x, *params)


def recomputing(model) -> bool:
    """Whether ``model``'s blocks are checkpointed now: asked for, training, gradients on."""
    return bool(getattr(model, "grad_checkpoint", False)) and model.is_training() and not jt.flags.no_grad


def first(out):
    """A block's hidden states: its output, or the first of its outputs."""
    return out[0] if isinstance(out, tuple) else out


def set_grad_checkpoint(model, enabled: bool = True) -> None:
    """Activation checkpointing per transformer block in training (see the torch backend)."""
    for m in [model, *model.modules()]:
        if m is model or hasattr(m, "grad_checkpoint"):
            m.grad_checkpoint = bool(enabled)


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
