"""Returning freed heap memory to the OS between the layers of a training step (glibc's
``malloc_trim``), for a framework that allocates CPU tensors with ``malloc`` (PyTorch).

glibc keeps what a process frees in its heap for reuse: blocks below its mmap threshold
(which rises to 32 MB after the first large free) come from a heap whose free pages stay
resident, so a training step's peak holds, beside its live tensors, the freed intermediates of
earlier layers that the next allocations did not fit into (the planner's ``heap`` terms,
docs/planning.md). ``malloc_trim(0)`` hands every free page of the heap back
(``madvise(MADV_DONTNEED)`` on the free chunks, the top released), at the cost of a page fault
when a later allocation touches it again. The torch backend calls it at Llama decoder layers'
inputs, in the forward pass and in the backward one: measured at Llama-3.2-1B widths
(16 layers, batch 1 x 256), trimming at every layer took the peak private memory of LoRA
5778 -> 5568 MB and of QLoRA 2670 -> 2359 MB (docs/llama.md). It costs step time: the page
faults of the returned pages touched again (a LoRA+GC step on llama-bench, 2 x 256 tokens:
~250 k minor faults against ~3 k untrimmed, about 3.5 us each on this VM, plus 15 calls of
~8 ms), so a LoRA step on llama-bench took 1.085x as long at 4 x 512 tokens and 1.17x at
2 x 256 (``python -m examples.lm.heap_trim_ab``, trimming alternated within one process).
By default it trims at every second layer (:func:`trim_points`; ``LORA_MALLOC_TRIM_EVERY=1``
for every layer, the default before): on llama-bench at 2 x 256 tokens the same peaks within
1.2% (LoRA+GC, QLoRA, QLoRA+GC) with 20-32% fewer faults and ~10% less time (ours / HF tokens/s
in one process: LoRA+GC 0.851 -> 0.954, QLoRA 0.861 -> 0.946); at Llama-3.2-1B widths (16
layers, 1 x 256) QLoRA 2356 vs 2357 MB private, QLoRA+GC 2005 vs 1994; LoRA+GC at 4 x 512
698 vs 669 MB anonymous in one run each, within the 18-32 MB between repeats of one setting
there (docs/llama.md; ``python -m examples.lm.heap_trim_ab --ab stride`` times the two).

So by default (``LORA_MALLOC_TRIM=auto``, or unset) a run trims only where memory is what its
method is for: with activation checkpointing or a 4-bit base (:func:`wanted`); plain LoRA and
full fine-tuning keep the speed. ``LORA_MALLOC_TRIM=1`` trims every training step,
``LORA_MALLOC_TRIM=0`` none.

Elsewhere (no glibc, e.g. macOS or musl) ``trim`` does nothing and says so, and so does a
process that runs under tcmalloc (``lora_core.train.allocator``: the commands' torch Llama runs
where it is installed), whose freed spans glibc's trim cannot reach and which keeps no scattered
heap to return between layers: there a step's peak is lower than glibc's trimmed one, with no
page faults.

One place holds freed memory under either allocator: the start of a ZeRO-3 step, where FSDP2
gathers the root unit (embeddings, final norm, head) into blocks the previous step's freed
activations do not fit. There :func:`release` (glibc's trim, or tcmalloc's
``MallocExtension_ReleaseFreeMemory``) runs before each forward pass unless
``LORA_MALLOC_TRIM=0`` (:func:`releases_before_gather`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# The torch LM loss keeps no (N, V) tensor for the backward pass (backends/torch/train.py,
# ``_HeadNLL``) when its float32 logits take at least this much: glibc's mmap ceiling, below
# which the three (N, V) tensors the plain path keeps come from (and stay in) the heap; smaller
# heads keep the plain path (log-softmax's own kernels, the bits of earlier versions)
HEAD_FUSED_MIN_BYTES = 32 << 20
# ... and takes them in pieces of rows: the fewest rows whose float32 logits reach this many bytes,
# glibc's mmap ceiling, so that glibc maps every whole piece and returns it when it is freed (at
# Llama 3's 128256-token vocabulary and 4 x 512 tokens the whole (N, V) logits are 1 GB, a piece 66
# rows, 33.9 MB). Before 7b0a1cb a piece was the most rows within it, 65 rows, 33.3 MB: just below
# the ceiling, from glibc's heap, where freed pieces stayed (Llama-3.2-1B, 2 layers, 1 x 256,
# LoRA+GC: peak anonymous 382 -> 326 MB; tcmalloc, the commands' default, keeps either the same)
HEAD_PIECE_BYTES = 32 << 20
HEAD_PIECE_RULES = ("reach", "within")  # the fewest rows reaching it (today's), the most within it (before)
HEAD_PIECE_RULE = "reach"  # the rule this code runs (a bench JSON records it; the planner plans with it)
# The devices where activations are taken in such pieces (the frozen head's logits here, a frozen
# MLP's recomputation in ``lora_core.train.recompute``): the CPU, whose allocators keep what a
# whole-batch tensor grew the heap by. On a GPU the caching allocator reuses its blocks, and a
# piece of 65 rows is a GEMM too thin for its tiles: on an H200 (e8ad55d, Llama-3.2-1B widths,
# 4 x 512 tokens) the LoRA step in 32 pieces ran at 0.69x transformers + peft's tokens/s in
# float32, 0.89x in bf16; there a frozen MLP's recomputation is one piece.
PIECE_DEVICES = ("cpu",)
# ... and the frozen head's logits pieces of whole 64-row tiles of at most this many bytes of
# float32 logits (GEMMs of 512 x 2048 x 128256 at Llama 3's widths, 4 per 4 x 512 batch): at
# a8d4e9a the whole batch's loss under autocast held 2.5 GB at once there (bf16 logits, their
# float32 copy and bf16 gradient, 1 GB each per float32 (N, V), and the head's bf16 weight)
GPU_HEAD_PIECE_BYTES = 256 << 20
ROW_MULTIPLE = 64  # pieces of whole 64-row panels (GEMM tiles)
# The frozen head's product is taken as two: the first ``vocab // HEAD_COLUMN_MULTIPLE *
# HEAD_COLUMN_MULTIPLE`` rows of the (V, E) head weight (a view: no copy), then the few left. At
# GPT-2's 50257-token vocabulary, torch 2.13's CPU GEMM (MKL, AVX-512, one thread, 167 x 768 x V)
# ran at 46-49 GFLOP/s where V is not a multiple of 8 (50257, 50258, 50260; 32001, 8001) and at
# 54-63 where it is (50256, 50264, 32000, 8000): the forward product of a 512-row batch's pieces
# 0.89 -> 0.68 s (the input gradient's product, (rows, V) x (V, E), did not depend on it).
# Jittor's CPU matmul did not (50256 vs 50257 within 1%). Vocabularies that are multiples of it
# (Llama's 32000, 128256; Qwen2's 151936) are one product as before.
HEAD_COLUMN_MULTIPLE = 16


def panel_rows(limit_bytes: int, row_bytes: int) -> int:
    """The most rows of ``row_bytes`` each that fit ``limit_bytes``, in whole ``ROW_MULTIPLE``-row
    panels, at least one panel."""
    return max(ROW_MULTIPLE, limit_bytes // row_bytes // ROW_MULTIPLE * ROW_MULTIPLE)


def head_piece_rows(
    tokens: int, vocab: int, device: str = "cpu", piece_bytes: int | None = None, rule: str = HEAD_PIECE_RULE
) -> int:
    """Loss positions per piece of the frozen-head loss, at most ``tokens``: the fewest rows whose
    float32 logits reach ``HEAD_PIECE_BYTES`` (66 at a 128256-token vocabulary, 1049 at 8000;
    ``rule="within"``: the most rows within it, at least one, as before 7b0a1cb: 65 and 1048); on
    a ``device`` not in ``PIECE_DEVICES`` (a GPU: ``"cuda"``) ``GPU_HEAD_PIECE_BYTES`` in whole
    64-row tiles (at least one): 512 at 128256, 1280 at GPT-2's 50257. ``piece_bytes``: that
    many bytes in place of the device's (the planner's record of a run made with other pieces)."""
    if tokens < 1 or vocab < 1:
        raise ValueError(f"head_piece_rows needs positive sizes, got tokens={tokens}, vocab={vocab}")
    if rule not in HEAD_PIECE_RULES:
        raise ValueError(f"head_piece_rows: rule {rule!r} is not one of {HEAD_PIECE_RULES}")
    if device in PIECE_DEVICES:
        limit = piece_bytes or HEAD_PIECE_BYTES
        rows = -(-limit // (4 * vocab)) if rule == "reach" else max(1, limit // (4 * vocab))
    else:
        rows = panel_rows(piece_bytes or GPU_HEAD_PIECE_BYTES, 4 * vocab)
    return min(tokens, rows)


def head_column_split(vocab: int) -> int:
    """Columns of the frozen head's first product (``HEAD_COLUMN_MULTIPLE``): ``vocab`` rounded
    down to a multiple of it, or ``vocab`` itself when it is one or is smaller than one."""
    if vocab < 1:
        raise ValueError(f"head_column_split needs a positive vocabulary, got {vocab}")
    split = vocab // HEAD_COLUMN_MULTIPLE * HEAD_COLUMN_MULTIPLE
    return split or vocab


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            lib = None
        _LIBC.append(lib if lib is not None and hasattr(lib, "malloc_trim") else None)
    return _LIBC[0]


TRIM_MODES = ("auto", "on", "off")  # the modes (the planner's ``heap_trim``, ``lora-plan --heap-trim``)
MODES = {"auto": "auto", "": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}  # LORA_MALLOC_TRIM's values


def mode() -> str:
    """``auto``, ``on`` or ``off``, from ``LORA_MALLOC_TRIM`` (unset or ``auto``; ``1``/``on``;
    ``0``/``off``); another value is refused naming the variable."""
    v = os.environ.get("LORA_MALLOC_TRIM", "auto").strip().lower()
    if v not in MODES:
        raise ValueError(f"LORA_MALLOC_TRIM={v!r}: expected auto, 1 (on) or 0 (off)")
    return MODES[v]


def trims(mode_: str, grad_checkpoint: bool, quantized: bool) -> bool:
    """The rule: ``on`` always, ``off`` never, ``auto`` with activation checkpointing or a
    4-bit base, the methods chosen for their memory (the planner applies it too)."""
    _check_mode(mode_)
    return mode_ == "on" or (mode_ == "auto" and (grad_checkpoint or quantized))


def _check_mode(mode_: str) -> None:
    if mode_ not in TRIM_MODES:
        raise ValueError(f"heap trim mode {mode_!r}: expected one of {TRIM_MODES}")


def run_trims(kind: str, trim_kinds, mode_: str, grad_checkpoint: bool, quantized: bool) -> bool:
    """Whether a run of a ``kind`` model (llama, gpt2) trims at each layer: its system trims
    that kind (``trim_kinds``) and :func:`trims` says so for the run's mode and method."""
    return kind in trim_kinds and trims(mode_, grad_checkpoint, quantized)


def wanted(grad_checkpoint: bool, quantized: bool) -> bool:
    """Whether a training step trims here: :func:`trims` with ``LORA_MALLOC_TRIM``'s mode."""
    return trims(mode(), grad_checkpoint, quantized)


EVERY = 2  # trim at every EVERY-th layer (LORA_MALLOC_TRIM_EVERY overrides; 1: every layer, the default up to 890acb3)


def parse_stride(value: str, where: str) -> int:
    """A trim stride given as text (layers between trims, a positive integer); another value is
    refused naming ``where`` (the variable or option it came from)."""
    v = value.strip()
    if not (v.isascii() and v.isdecimal()) or int(v) < 1:  # ASCII digits: str.isdigit takes '²', int() not
        raise ValueError(f"{where}={value!r}: expected a positive integer (layers between trims)")
    return int(v)


def every() -> int:
    """The stride of the trim points in layers: ``LORA_MALLOC_TRIM_EVERY`` (a positive integer)
    or :data:`EVERY`; another value is refused naming the variable."""
    v = os.environ.get("LORA_MALLOC_TRIM_EVERY", "").strip()
    return parse_stride(v, "LORA_MALLOC_TRIM_EVERY") if v else EVERY


def trim_points(layers: int, stride: int | None = None) -> list[tuple[bool, bool]]:
    """Per decoder layer, whether the heap is trimmed where the forward pass enters it and where
    the backward pass leaves it: at every ``stride``-th layer (layers stride-1, 2 stride-1, ...),
    both ways, and where the forward pass enters the last layer, after which the head and the
    first (last layer's) backward come: the step's peak (docs/llama.md, where the trim's cost is
    measured)."""
    stride = every() if stride is None else stride
    if stride < 1:
        raise ValueError(f"trim stride {stride}: expected a positive number of layers")
    return [(i % stride == stride - 1 or i == layers - 1, i % stride == stride - 1) for i in range(layers)]


def available() -> bool:
    """Whether ``trim`` returns memory here: glibc's malloc serves this process (not tcmalloc,
    ``lora_core.train.allocator``, whose spans glibc's trim cannot reach and which needs none) and
    ``LORA_MALLOC_TRIM=0`` has not turned it off."""
    from .allocator import active

    return mode() != "off" and _libc() is not None and active() != "tcmalloc"


def trim() -> bool:
    """Give the heap's free pages back to the OS (``malloc_trim(0)``); True if any were."""
    return bool(_libc().malloc_trim(0)) if available() else False


def releases_before_gather(mode_: str, zero: int) -> bool:
    """Whether a ZeRO step returns the allocator's free memory before its forward pass (see
    :func:`release`): at stage 3 unless the mode is ``off``. FSDP2 gathers the root unit
    (embeddings, final norm, head) there, twice over for a moment (its all-gather output and the
    parameters copied out), in blocks of sizes the previous step's freed memory rarely fits. Measured
    (2 ranks, llama-bench 2 x 256, QLoRA+GC, rank 0): the step's own allocations peaked at 344 MB,
    at that gather, in every step; the anonymous memory after the first step at 573 MB under
    tcmalloc (479 in the first) and 585-595 under glibc (508), 540 and 515 with the release."""
    _check_mode(mode_)
    return zero == 3 and mode_ != "off"


def release() -> bool:
    """Return the free memory the allocator holds to the OS: glibc's ``malloc_trim(0)``, or
    under tcmalloc (``lora_core.train.allocator``) its ``MallocExtension_ReleaseFreeMemory``
    (every free span). False, doing nothing, where ``LORA_MALLOC_TRIM=0`` or neither is there."""
    from .allocator import active

    if active() != "tcmalloc":
        return trim()
    if mode() == "off":
        return False
    if not _TCMALLOC_RELEASE:
        _TCMALLOC_RELEASE.append(getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None))
    if _TCMALLOC_RELEASE[0] is None:
        return False
    _TCMALLOC_RELEASE[0]()
    return True


_TCMALLOC_RELEASE: list = []  # tcmalloc's MallocExtension_ReleaseFreeMemory, looked up once
