"""GPT-2 LM with LoRA for PyTorch (HF ``GPT2LMHeadModel`` semantics, nanoGPT layout).

Names follow ``lora_core.models.gpt2`` so that ``named_parameters()`` are the canonical names.
Contract (same in every backend):
    ``GPT2LMModel(cfg, lora=None)``; ``model(input_ids, past=None, attention_mask=None,
    position_ids=None) -> (logits, present)``; ``model.hidden(...) -> (h, present)``;
    ``model.lm_logits(h)``; ``model.load_weights(tensors)`` (strict);
    ``model.state_numpy()``.
``attention_mask`` (B, T_past + T) marks real tokens with 1; position ids default to
``cumsum(mask) - 1`` so left-padded batches get the positions of their real tokens.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lora_core.data.batching import check_token_ids
from lora_core.formats.checkpoint import check_tensors
from lora_core.generate.beam import compose_rows
from lora_core.generate.masks import attention_bias, positions
from lora_core.lora.dropout import BlockMasks
from lora_core.lora.layers import decoding_weights
from lora_core.models.gpt2 import GPT2Config, LoRAConfig, check_length, matches_target

from ._attention import attention
from .lora import LoRAEmbedding, LoRALinear, LoRAMergedLinear, linear_decode, pack_weight

Past = list[tuple[torch.Tensor, torch.Tensor]]


class KVCache:
    """KV cache for beam search: per layer the prompt's keys and values once per input,
    (inputs, n_head, P, head_size), shared by that input's ``repeats`` beams, and the generated
    positions per beam, (inputs * repeats, n_head, t, head_size).

    The generated positions live in buffers with room to spare (doubled when full): a step
    writes its keys and values in place. ``reorder`` only records the new row order; the next
    forward pass gathers the generated part's rows straight into a new buffer
    (``index_select(out=...)``): one copy of the generated positions per reordered step, none
    of the prompt, where concatenating and reordering a full cache copies everything twice.
    Attention reads the prompt once per input (the beams are extra query rows of one matrix
    product). With one beam per input (greedy decoding: no reorder can happen) the prompt
    heads the same buffer and attention is one product over all positions. For inference: no
    gradient flows through it.

    ``KVCache(past, repeats)`` takes a list-of-(k, v) cache of the prompts.
    """

    def __init__(self, past: Past, repeats: int = 1):
        self.repeats, self.length = repeats, past[0][0].shape[2]
        rows, nh, self.prompt_len, hs = past[0][0].shape
        self.joint = repeats == 1  # the prompt at the head of the generated positions' buffer
        if self.joint:
            self.prompt = None
            self.generated = [tuple(_grown(t.detach(), self.length, self.length + GROW_MIN) for t in kv) for kv in past]
        else:
            self.prompt = [(k.detach(), v.detach()) for k, v in past]
            shape = (rows * repeats, nh, GROW_MIN, hs)
            self.generated = [(past[0][0].new_empty(shape), past[0][0].new_empty(shape)) for _ in past]
        self.pending: np.ndarray | None = None  # reorder for the next forward pass
        self.rows: torch.Tensor | None = None  # the same as a tensor

    def reorder(self, rows: np.ndarray) -> None:
        """Row ``j`` continues old row ``rows[j]``, a beam of the same input (applied by the
        next forward pass)."""
        self.pending = compose_rows(self.pending, rows, self.repeats)
        self.rows = None if self.pending is None else torch.from_numpy(self.pending).to(self.generated[0][0].device)

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Layer ``i``: store the new keys/values ``k``, ``v`` (rows, nh, T, hs) after the
        (reordered) generated ones and return the attention output for the queries ``q``;
        ``bias`` (rows, 1, T, length + T) is the additive mask."""
        # the positions held before this step: the generated ones, after the prompt where it heads the buffer
        held = self.length - (0 if self.joint else self.prompt_len)
        end = held + k.shape[2]
        bufs = self.generated[i]
        if self.rows is not None or end > bufs[0].shape[2]:  # reorder into, or grow into, new buffers
            room = end if self.rows is not None else 2 * end  # beams reorder most steps: no room kept for them
            bufs = self.generated[i] = tuple(_grown(old, held, room, self.rows) for old in bufs)
        for buf, new in zip(bufs, (k, v)):
            buf[:, :, end - new.shape[2] : end] = new.detach()
        kg, vg = (buf[:, :, :end] for buf in bufs)
        if self.joint:
            return attend_all(q, kg, vg, bias)
        return attend_shared_prompt(q, *self.prompt[i], kg, vg, bias)

    def advance(self, T: int) -> None:
        """Called once every layer has taken its ``T`` new positions."""
        self.length += T
        self.pending = self.rows = None


# room a KV cache's generated positions start with (then doubled as needed)
GROW_MIN = 16


def _grown(old: torch.Tensor, n: int, capacity: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A (rows, nh, capacity, hs) buffer holding ``old``'s first ``n`` positions (its rows
    selected by ``rows``, if given)."""
    buf = old.new_empty((old.shape[0] if rows is None else rows.shape[0], old.shape[1], capacity, old.shape[3]))
    if rows is None:
        buf[:, :, :n] = old[:, :, :n]
    else:
        torch.index_select(old[:, :, :n], 0, rows, out=buf[:, :, :n])
    return buf


def attend_all(q, k, v, bias) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs) + bias) v: the queries ``q`` (R, nh, T, hs) over all positions
    ``k``, ``v`` (R, nh, L, hs); ``bias`` broadcasts to (R, nh, T, L)."""
    att = torch.softmax(q @ k.transpose(-1, -2) * (1.0 / q.shape[-1] ** 0.5) + bias, dim=-1)
    return att @ v


def attend_shared_prompt(q, kp, vp, kg, vg, bias) -> torch.Tensor:
    """Attention of the queries ``q`` (R, nh, T, hs) of R = B x beam rows (input-major) over a
    prompt cache kept once per input, ``kp``/``vp`` (B, nh, P, hs), and each row's generated
    keys and values ``kg``/``vg`` (R, nh, G, hs); ``bias`` (R|1, 1, T, P + G) is additive. The
    prompt is read once per input: its beams are extra query rows of one product."""
    R, nh, T, hs = q.shape
    B, P = kp.shape[0], kp.shape[2]
    beam = R // B

    def by_input(x):  # (R, nh, T, m) -> (B, nh, beam * T, m)
        return x.reshape(B, beam, nh, T, -1).transpose(1, 2).reshape(B, nh, beam * T, -1)

    def by_row(x):  # inverse of by_input
        return x.reshape(B, nh, beam, T, -1).transpose(1, 2).reshape(R, nh, T, -1)

    scores = torch.cat([by_row(by_input(q) @ kp.transpose(-1, -2)), q @ kg.transpose(-1, -2)], dim=-1)
    att = torch.softmax(scores * (1.0 / hs ** 0.5) + bias, dim=-1)
    return by_row(by_input(att[..., :P]) @ vp) + att[..., P:] @ vg


def _linear(name: str, fin: int, fout: int, lora: LoRAConfig | None) -> LoRALinear:
    if lora is None or lora.r == 0 or not any(matches_target(name, t) for t in lora.target_modules):
        return LoRALinear(fin, fout)
    if name.endswith("attn.c_attn") and lora.enable_lora is not None:
        return LoRAMergedLinear(fin, fout, lora.r, lora.alpha, lora.dropout, lora.enable_lora)
    return LoRALinear(fin, fout, lora.r, lora.alpha, lora.dropout)


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, lora: LoRAConfig | None, prefix: str):
        super().__init__()
        E = cfg.n_embd
        self.n_head, self.attn_pdrop = cfg.n_head, cfg.attn_pdrop
        self.c_attn = _linear(prefix + "attn.c_attn", E, 3 * E, lora)
        self.c_proj = _linear(prefix + "attn.c_proj", E, E, lora)
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x, past, bias, unpad=None):
        qkv = self.c_attn(x)
        if unpad is not None:  # packed (N, 3E) -> padded (B, T, 3E); pads read an appended zero row
            token_index, pad_index, B, T = unpad
            qkv = torch.cat([qkv, qkv.new_zeros(1, qkv.shape[-1])]).index_select(0, pad_index).view(B, T, -1)
        B, T, E = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(E, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, E // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        p = self.attn_pdrop if self.training else 0.0
        if isinstance(past, tuple) and not isinstance(past[0], torch.Tensor):  # a cache object: (cache, layer)
            y = past[0].attend(past[1], q, k, v, bias)
            return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, E))), None
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if T == 1 and not p and bias is not None:  # one new token against a cache: two small matmuls beat SDPA here
            att = torch.softmax(q @ k.transpose(-1, -2) * (1.0 / (E // self.n_head) ** 0.5) + bias, dim=-1)
            y = att @ v
        elif bias is None:  # no past, no padding: plain causal attention
            y = attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = attention(q, k, v, attn_mask=bias, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, E)
        if unpad is not None:  # back to the real tokens only
            y = y.reshape(B * T, E).index_select(0, token_index)
        # the training path on real tokens keeps no cache and returns no views of k, v (FSDP2 warns of
        # a wrapped block's view outputs: "can cause backward to fail or produce wrong gradients")
        return self.resid_dropout(self.c_proj(y)), None if unpad is not None else (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config, lora: LoRAConfig | None, prefix: str):
        super().__init__()
        E = cfg.n_embd
        self.c_fc = _linear(prefix + "mlp.c_fc", E, 4 * E, lora)
        self.c_proj = _linear(prefix + "mlp.c_proj", 4 * E, E, lora)
        self.dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x):
        if self.c_fc.decode_weight is not None:  # inference: GELU fused into the product
            return self.c_proj(linear_decode(x, self.c_fc.decode_weight, self.c_fc.bias, gelu=True))
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, lora: LoRAConfig | None, prefix: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg, lora, prefix)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, lora, prefix)

    def forward(self, x, past, bias, unpad=None):
        a, present = self.attn(self.ln_1(x), past, bias, unpad)
        x = x + a
        return x + self.mlp(self.ln_2(x)), present


class GPT2LMModel(nn.Module):
    """GPT-2 with a tied LM head and optional LoRA layers (see module docstring)."""

    peft_module_prefix = "transformer."  # module names of transformers' GPT2LMHeadModel (peft adapters)
    # the LM head reads wte (tied), its LoRA update included: a peft adapter that adapts or saves
    # wte means another head (peft keeps the head on the base table), lora_core.formats.adapter_io
    tied_embedding, tied_head_adds_lora = "wte", True

    def __init__(self, cfg: GPT2Config, lora: LoRAConfig | None = None):
        super().__init__()
        self.config, self.lora_config = cfg, lora
        wte_lora = lora is not None and lora.r and "wte" in lora.target_modules
        self.wte = LoRAEmbedding(cfg.vocab_size, cfg.n_embd, lora.r, lora.alpha) if wte_lora \
            else LoRAEmbedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)
        self.h = nn.ModuleList(Block(cfg, lora, f"h.{i}.") for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.decode_head = None
        self.grad_checkpoint = False  # set_grad_checkpoint: recompute each block in the backward pass

    def decoding(self, rows: int = 80):
        """Weights prepared for no-grad inference inside the block: each linear layer and the
        LM head use a copy of their weight with the LoRA update added, pre-packed for oneDNN on
        CPU (``pack_weight``). The parameters are untouched; do not change them in the block.
        ``rows`` is the expected number of rows per forward (a layout hint)."""
        return decoding_weights(self, pack_weight, torch.no_grad, rows)

    def head_weight(self) -> torch.Tensor:
        """The tied LM head's (vocab, n_embd) matrix, ``wte``'s with its LoRA update added (what
        :meth:`lm_logits` multiplies by)."""
        return self.wte.merged_weight()

    def hidden(self, input_ids, past: Past | None = None, attention_mask=None,
               position_ids=None) -> tuple[torch.Tensor, Past]:
        """Final hidden states (B, T, E) and the new KV cache: per layer (k, v), (B, nh, T_all, hs),
        or ``past`` itself, advanced in place, when it is a ``KVCache``."""
        dev = self.wte.weight.device  # inputs follow the model (CPU or a GPU after model.to(...))
        input_ids = _ids(input_ids, self.config.vocab_size).to(dev)
        B, T = input_ids.shape
        cache = past if isinstance(past, KVCache) else None
        t_past = 0 if past is None else cache.length if cache else past[0][0].shape[2]
        check_length(self.config, t_past + T)
        mask = None if attention_mask is None else _np(attention_mask)
        if position_ids is None:
            position_ids = positions(mask, B, T, t_past)
        bias = None if mask is None and t_past == 0 else torch.from_numpy(attention_bias(mask, T, t_past)).to(dev)
        x = self.drop(self.wte(input_ids) + self.wpe(_tensor(position_ids).to(dev)))
        present = []
        for i, block in enumerate(self.h):
            x, kv = block(x, None if past is None else (cache, i) if cache else past[i], bias)
            present.append(kv)
        if cache:
            cache.advance(T)
            present = cache
        return self.ln_f(x), present

    def hidden_unpadded(self, input_ids, token_index, pad_index) -> torch.Tensor:
        """Final hidden states (N, E) of the real tokens of a right-padded batch (no cache,
        positions 0..len-1 per row): the position-wise layers run on the N real tokens only
        and attention on the padded (B, T) layout; indices as ``lora_core.data.batching.collate``
        makes them."""
        dev = self.wte.weight.device
        ids = _ids(input_ids, self.config.vocab_size).to(dev)
        B, T = ids.shape
        check_length(self.config, T)
        tok, pad = _tensor(token_index).to(dev), _tensor(pad_index).to(dev)
        x = self.drop(self.wte(ids.reshape(-1).index_select(0, tok)) + self.wpe(tok % T))
        recompute = self.grad_checkpoint and self.training and torch.is_grad_enabled()
        for block in self.h:
            unpad = (tok, pad, B, T)
            x = checkpointed(block, x, None, None, unpad) if recompute else block(x, None, None, unpad)[0]
        return self.ln_f(x)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Tied LM head: ``h @ wte^T`` (LoRA on wte included when unmerged)."""
        if self.decode_head is not None:
            return linear_decode(h, self.decode_head, None)
        w = self.wte.weight
        if self.wte.r and not self.wte.merged:
            w = w + self.wte.delta_weight()
        return h @ w.t()

    def forward(self, input_ids, past=None, attention_mask=None, position_ids=None):
        h, present = self.hidden(input_ids, past, attention_mask, position_ids)
        return self.lm_logits(h), present

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, np.ndarray]) -> None:
        """Copy numpy tensors into every parameter (strict: names and shapes must match)."""
        params = dict(self.named_parameters())
        check_tensors("tensors", tensors, {n: tuple(p.shape) for n, p in params.items()})
        for n, p in params.items():
            p.copy_(torch.from_numpy(np.ascontiguousarray(tensors[n], dtype=np.float32)))

    @torch.no_grad()
    def load_partial(self, tensors: dict[str, np.ndarray]) -> None:
        """Copy a subset (an adapter); every name must exist with its shape."""
        params = dict(self.named_parameters())
        check_tensors("tensors", tensors, {n: tuple(p.shape) for n, p in params.items() if n in tensors})
        for n, v in tensors.items():
            params[n].copy_(torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)))

    def state_numpy(self) -> dict[str, np.ndarray]:
        """numpy copies of every parameter, canonical names."""
        return {n: p.detach().cpu().numpy().copy() for n, p in self.named_parameters()}


def checkpointed(block, x: torch.Tensor, *args) -> torch.Tensor:
    """``block(x, *args)`` (its first output when it returns a tuple: GPT-2's and Llama's
    blocks return their KV pair too) on the real tokens ``x`` (N, E) without keeping its activations:
    ``torch.utils.checkpoint`` recomputes them in the backward pass (it restores the RNG, so
    framework dropout repeats; numpy parity masks are replayed by ``BlockMasks``)."""
    return checkpointed_to(lambda h, *a: first(block(h, *a)), block, x, *args)


def checkpointed_to(fn, block, x: torch.Tensor, *args):
    """``fn(x, *args)`` (a tensor or a tuple of them), part of ``block``'s forward, without
    keeping its activations: :func:`checkpointed` for a part of a block."""
    masks = BlockMasks(block.modules())  # per layer: the first pass records

    def run(h):
        sources = masks.start()
        try:
            return fn(h, *args)
        finally:
            masks.stop(sources)

    return checkpoint(run, x, use_reentrant=False)


def first(out):
    """A block's hidden states: its output, or the first of its outputs."""
    return out[0] if isinstance(out, tuple) else out


def set_grad_checkpoint(model, enabled: bool = True) -> None:
    """Activation checkpointing per transformer block in training (the same loss and gradients
    as the plain step, less memory, one more forward pass per block). Sets ``grad_checkpoint``
    on ``model`` and on each of its modules that has one (DistilBERT's encoder)."""
    for m in [model, *model.modules()]:
        if m is model or hasattr(m, "grad_checkpoint"):
            m.grad_checkpoint = bool(enabled)


def _np(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, dtype=np.int64))


def _ids(x, vocab_size: int):
    """Token ids as a tensor: host data (numpy, lists) checked against the vocabulary first
    (``check_token_ids``: ValueError naming the id); a tensor as it is (its lookup raises)."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(check_token_ids(x, vocab_size, "input ids"))
