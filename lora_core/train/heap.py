"""Returning freed heap memory to the OS between the layers of a training step (glibc's
``malloc_trim``), for a framework that allocates CPU tensors with ``malloc`` (PyTorch).

glibc keeps what a process frees in its heap for reuse: blocks below its mmap threshold
(which rises to 32 MB after the first large free) come from a heap whose free pages stay
resident, so a training step's peak holds, beside its live tensors, the freed intermediates of
earlier layers that the next allocations did not fit into (the planner's ``heap`` terms,
docs/planning.md). ``malloc_trim(0)`` hands every free page of the heap back
(``madvise(MADV_DONTNEED)`` on the free chunks, the top released), at the cost of a page fault
when a later allocation touches it again. The torch backend calls it at each Llama decoder
layer's input, in the forward pass and in the backward one: measured at Llama-3.2-1B widths
(16 layers, batch 1 x 256), the peak private memory of LoRA 5778 -> 5568 MB and of QLoRA
2670 -> 2359 MB (docs/llama.md). It costs step time, the page faults of the returned pages
touched again: a LoRA step on llama-bench took 1.085x as long at 4 x 512 tokens and 1.17x at
2 x 256 (``python -m examples.lm.heap_trim_ab``, trimming alternated within one process). Set
``LORA_MALLOC_TRIM=0`` for the speed (and the memory) without it.

Elsewhere (no glibc, e.g. macOS or musl) ``trim`` does nothing and says so.
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

_LIBC: list = []


def _libc():
    if not _LIBC:
        lib = None
        if os.environ.get("LORA_MALLOC_TRIM", "1") != "0":
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            except OSError:
                lib = None
            if lib is not None and not hasattr(lib, "malloc_trim"):
                lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def available() -> bool:
    """Whether ``trim`` returns memory here (glibc, and not turned off by ``LORA_MALLOC_TRIM=0``)."""
    return _libc() is not None


def trim() -> bool:
    """Give the heap's free pages back to the OS (``malloc_trim(0)``); True if any were."""
    lib = _libc()
    return bool(lib.malloc_trim(0)) if lib is not None else False
