"""Beam search's decode step on a preallocated cache, captured once per shape (CUDA graphs).

Used by ``backends.torch.generate.beam_search(..., decode_step="captured")`` (the default on
a GPU). The layout is ``lora_core.generate.static_cache``'s: the prompt's keys and values once per
input, padded to a multiple of 32 positions, and the generated positions per beam in
buffers of ``max_new_tokens`` slots, reordered in place and written at the step's slot.
Every tensor a step reads or writes then keeps its shape and address for the whole batch,
and for every batch of the same shape. On CUDA, :class:`StaticDecoder` records the step
(embedding, every layer, the head) once per shape as a ``torch.cuda.CUDAGraph``
(:class:`CUDAGraphRecorder`) and replays it (GPT-2 and the Llama family): one launch per step instead of some 15 per
layer. On a CPU, where there is nothing to capture, the same step runs op by op (the tests
run it there against the growing cache, and drive the record/replay logic with a stand-in
recorder of the same contract).
For inference: no gradient flows through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from lora_core.generate.beam import compose_rows
from lora_core.generate.masks import MASK_VALUE
from lora_core.generate.static_cache import check_room, kv_layout, prompt_capacity, prompt_layout

from .gpt2 import attend_shared_prompt
from .precision import DTYPES


class StaticKVCache:
    """The buffers of one shape (``B`` inputs x ``repeats`` beams, ``capacity`` prompt slots,
    ``slots`` generated slots) and the step's fixed inputs; ``load`` fills them for a batch."""

    def __init__(self, model, B: int, repeats: int, capacity: int, slots: int):
        p = next(model.parameters())
        (layers, nh, hs), R = kv_layout(model.config), B * repeats
        zeros = lambda *shape: torch.zeros(shape, dtype=p.dtype, device=p.device)  # noqa: E731
        self.repeats, self.capacity, self.slots = repeats, capacity, slots
        self.prompt = [(zeros(B, nh, capacity, hs), zeros(B, nh, capacity, hs)) for _ in range(layers)]
        self.generated = [(zeros(R, nh, slots, hs), zeros(R, nh, slots, hs)) for _ in range(layers)]
        self.prompt_bias = zeros(R, 1, 1, capacity)
        self.slot_index = torch.arange(slots, device=p.device)
        self.first = torch.zeros((R, 1), dtype=torch.int64, device=p.device)  # position of generated slot 0
        self.tokens = torch.zeros((R, 1), dtype=torch.int64, device=p.device)
        self.rows = torch.arange(R, device=p.device)  # reorder applied at the start of the step
        self.step_index = torch.zeros(1, dtype=torch.int64, device=p.device)
        self.P, self.s, self.pending = 0, 0, None

    def load(self, past, mask: np.ndarray) -> None:
        """A new batch: its prompt cache ``past`` (per layer (k, v), (B, nh, P, hs)) and mask (B, P)."""
        P = past[0][0].shape[2]
        with torch.no_grad():
            for (kp, vp), (k, v) in zip(self.prompt, past):
                kp.zero_()
                vp.zero_()
                kp[:, :, :P] = k
                vp[:, :, :P] = v
            for kg, vg in self.generated:  # stale values are masked, but must stay finite
                kg.zero_()
                vg.zero_()
            bias, first = prompt_layout(mask, self.repeats, self.capacity)
            self.prompt_bias.copy_(torch.from_numpy(bias))
            self.first.copy_(torch.from_numpy(first))
        self.P, self.s, self.pending = P, 0, None

    def reorder(self, rows: np.ndarray) -> None:
        """Row ``j`` continues old row ``rows[j]`` (applied in place by the next step)."""
        self.pending = compose_rows(self.pending, rows, self.repeats)

    def set_inputs(self, tokens: np.ndarray, cfg) -> None:
        check_room(self.P, self.s, cfg)
        if self.s >= self.slots:
            raise ValueError(f"beam search: step {self.s} past the cache's {self.slots} generated slots")
        rows = np.arange(len(tokens)) if self.pending is None else self.pending
        self.tokens.copy_(torch.from_numpy(np.asarray(tokens, dtype=np.int64).reshape(-1, 1)))
        self.rows.copy_(torch.from_numpy(rows))
        self.step_index.fill_(self.s)

    def advance(self) -> None:
        self.s, self.pending = self.s + 1, None

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias) -> torch.Tensor:
        """Layer ``i`` inside the step: reorder the generated rows in place, write the new key
        and value at the step's slot, attend over the prompt (once per input) and the slots
        written so far (``bias`` is unused: the masks are the cache's)."""
        kg, vg = self.generated[i]
        for buf, new in ((kg, k), (vg, v)):
            buf.copy_(buf.index_select(0, self.rows))
            buf.index_copy_(2, self.step_index, new.to(buf.dtype))
        gen_bias = (self.slot_index > self.step_index).to(self.prompt_bias.dtype) * MASK_VALUE  # 0 on written slots
        bias = torch.cat([self.prompt_bias, gen_bias.expand(q.shape[0], 1, 1, self.slots)], dim=-1)
        return attend_shared_prompt(q, *self.prompt[i], kg, vg, bias)


class StaticDecoder:
    """The decode steps of one ``beam_search`` call: a :class:`StaticKVCache` per shape, and on
    CUDA the step captured once per shape (``graphs``: the recordings by shape, ``caches``:
    the buffers of the shapes met). ``recorder``: how a step is captured (``record(fn, device) ->
    (replay, out)``, ``device``: the model's; default :class:`CUDAGraphRecorder` on CUDA, none
    on a CPU: each step runs op by op)."""

    def __init__(self, model, max_new_tokens: int, recorder=None):
        self.model, self.slots = model, max_new_tokens
        self.caches: dict[tuple[int, int], StaticKVCache] = {}
        self.graphs: dict[tuple[int, int], tuple[Callable[[], object], torch.Tensor]] = {}
        self._kept: dict[tuple[int, int], object] = {}  # per recording: the tensors it reads that the model may drop
        self.device = next(model.parameters()).device
        on_cuda = self.device.type == "cuda"
        self.recorder = recorder if recorder is not None else CUDAGraphRecorder() if on_cuda else None

    def start(self, past, repeats: int, mask: np.ndarray) -> StaticKVCache:
        """The cache for a batch's prompt (``past``: per layer (k, v) of the B prompts; ``mask``
        (B, P)), its buffers repeated beam-wise: the shape's buffers, reused when met before."""
        B, P = mask.shape
        key = (B * repeats, prompt_capacity(P))
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = StaticKVCache(self.model, B, repeats, key[1], self.slots)
        cache.load(past, mask)
        return cache

    def step(self, cache: StaticKVCache, tokens: np.ndarray) -> torch.Tensor:
        """Next-token logits (R, V), float32, after the rows' new ``tokens`` (R,). On CUDA the
        tensor is the captured graph's output, overwritten by the next step of that shape."""
        cache.set_inputs(tokens, self.model.config)
        if self.recorder is None:
            out = self._run(cache)
        else:
            key = (cache.rows.shape[0], cache.capacity)
            if key not in self.graphs:
                self.graphs[key] = self._capture(cache)
                # the RoPE table the recording reads stays alive while the graph may replay it (a
                # later shape can grow the model's table, which frees the old one's memory)
                self._kept[key] = getattr(self.model, "_rope", None)
            replay, out = self.graphs[key]
            replay()  # the step itself (the warm-ups and the recording changed nothing)
        cache.advance()
        return out

    @property
    def captures(self) -> int:
        """Steps recorded so far (one per shape)."""
        return len(self.graphs)

    def _autocast(self):
        precision = getattr(self.model, "precision", "fp32")
        if precision == "fp32":
            return contextlib.nullcontext()
        dev = next(self.model.parameters()).device.type  # no weight-cast cache: a graph replays its casts
        return torch.autocast(dev, dtype=DTYPES[precision], cache_enabled=False)

    @torch.no_grad()
    def _run(self, cache: StaticKVCache) -> torch.Tensor:
        pos = cache.first + cache.step_index  # each row's position: read on the device
        model = self.model
        with self._autocast():
            if hasattr(model, "wte"):  # GPT-2
                x = model.wte(cache.tokens) + model.wpe(pos)
                for i, block in enumerate(model.h):
                    x, _ = block(x, (cache, i), None)
                return model.lm_logits(model.ln_f(x)[:, -1]).float()
            # the Llama family: RoPE looked up at each row's position, the table sized for the
            # shape's last slot (grown, if at all, by the warm-up runs, before the recording)
            # (the capacity is rounded up: never past the model's positions, which no row reads)
            rope = model.rope(pos, min(cache.capacity + cache.slots, model.config.max_position_embeddings))
            x = model.model.embed_tokens(cache.tokens)
            for i, layer in enumerate(model.model.layers):
                x, _ = layer(x, rope, (cache, i), None)
            return model.lm_logits(model.model.norm(x)[:, -1]).float()

    def _capture(self, cache: StaticKVCache) -> tuple[Callable[[], object], torch.Tensor]:
        """Record the step for ``cache``'s shape: always at a batch's first step, where the
        recorder's warm-up runs change nothing (the generated slots are all zero, so the
        reorder moves zeros, and each run writes the same keys and values at slot 0)."""
        if cache.s != 0:
            raise RuntimeError(f"captured decode step: a shape first met at step {cache.s}, not 0")
        return self.recorder.record(lambda: self._run(cache), self.device)


class CUDAGraphRecorder:
    """Records a step as a ``torch.cuda.CUDAGraph``: two warm-up runs on a side stream (as
    capture needs), then the recording, which executes nothing. ``record(fn, device) ->
    (replay, out)``: each ``replay()`` runs the recorded kernels again and rewrites ``out`` in
    place. Everything happens with ``device`` (the model's GPU) current and on a stream made on
    it: a bare ``torch.cuda.Stream()`` or ``CUDAGraph()`` (and ``torch.cuda.graph``'s own
    capture stream) belongs to the current device, and a capture on another device's stream
    records none of the step's kernels (they run at once, and every replay would give back
    the first step's logits)."""

    warmups = 2

    def record(self, fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[Callable[[], object], torch.Tensor]:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(self.warmups):
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = fn()

        def replay() -> None:
            with torch.cuda.device(device):
                graph.replay()

        return replay, out
