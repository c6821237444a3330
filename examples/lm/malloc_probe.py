"""What the C heap holds through ours-torch's training steps: one process, llama-bench's shape
(random weights, LoRA r=8 on q,k,v,o), a warm-up step, then two timed steps while a thread samples
every millisecond the process's anonymous memory and glibc's ``mallinfo2`` (heap size, bytes in
use, bytes free in it, bytes in mmapped chunks); prints each step's time and the sample at the
anonymous peak. Run it under another malloc to compare (``LD_PRELOAD=...``: glibc's counters then
read 0, the anonymous peak still counts)::

    python -m examples.lm.malloc_probe --gc --batch 4 --block 512
    LORA_MALLOC_TRIM=0 python -m examples.lm.malloc_probe --gc          # glibc untrimmed
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 python -m examples.lm.malloc_probe --gc

Measured with it (AMD EPYC, one thread, 0f29f96, 4 x 512, GC): glibc untrimmed, a heap of
844-1006 MB with at most 380 MB in use; the allocators compared in docs/llama.md ("The allocator").
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-bench")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--gc", action="store_true", help="activation checkpointing")
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    a = p.parse_args(argv)
    from lora_core.train import allocator

    from .heap_trim_ab import lora_training

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        p.error("glibc without mallinfo2 (2.33+)")
    libc.mallinfo2.restype = _MallInfo2
    bk, model, opt, batch = lora_training(a.shape, a.batch, a.block, a.gc)
    bk.train_step(model, opt, [batch], 1e-4)
    top: dict = {}
    in_use = [0.0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            m, mb = libc.mallinfo2(), anon_mb()
            in_use[0] = max(in_use[0], (m.uordblks + m.hblkhd) / 2**20)
            if mb > top.get("anon", 0):
                top.update(anon=mb, heap=m.arena / 2**20, used=m.uordblks / 2**20, free=m.fordblks / 2**20, mmapped=m.hblkhd / 2**20)
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    for _ in range(a.steps):
        t = time.perf_counter()
        bk.train_step(model, opt, [batch], 1e-4)
        print(f"step {time.perf_counter() - t:.2f} s")
    stop.set()
    th.join()
    print(f"malloc {allocator.active()}; at the anonymous peak {top['anon']:.0f} MB: glibc heap {top['heap']:.0f} MB "
          f"({top['used']:.0f} in use, {top['free']:.0f} free), mmapped chunks {top['mmapped']:.0f} MB; "
          f"largest heap in use + mmapped {in_use[0]:.0f} MB")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
