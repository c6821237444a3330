"""What ours-torch's per-layer heap trim (``lora_core.train.heap``) costs in step time: one
process, one model (random weights of a bench shape, LoRA r=8 on q,k,v,o), training steps that
alternate trimming on and off, each timed; prints both lists and the ratio of the medians.
Alternating in one process keeps the VM's drift out of the ratio (separate bench runs on this
machine drift by up to 30%); if anything it understates the cost, since a step without the trim
starts from a heap the previous step trimmed.

    python -m examples.lm.heap_trim_ab --batch 4 --block 512 --steps 6 [--gc] [--shape llama-bench]
    python -m examples.lm.heap_trim_ab --ab gc --batch 4 --block 512 --steps 6

``--ab gc`` alternates activation checkpointing on and off instead, each step with the default
trim policy (``LORA_MALLOC_TRIM`` as set; by default the GC steps trim, the plain ones do not):
GC's time over the plain step's, measured in one process. ``--ab stride --strides 1,2`` alternates
the layers between trim points (``LORA_MALLOC_TRIM_EVERY``), every step trimming. Each step's
minor page faults are printed too: the pages the trim handed back and the step touched again,
the trim's cost (about 3.5 us each on this VM).

Measured (AMD EPYC, 1 thread, 4a04648, llama-bench, LoRA): 4 x 512 tokens 15.16 vs 13.97 s
(1.085x), 2 x 256 tokens (2 x (128 + 128)) 3.63 vs 3.10 s (1.17x).
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import numpy as np


def lora_training(shape: str, batch: int, block: int, gc: bool):
    """The torch backend, a model of ``shape`` (random weights, LoRA r=8 on q,k,v,o, activation
    checkpointing if ``gc``), its AdamW and one packed batch of ``batch`` rows of ``block`` tokens
    (two documents each), on one thread: the set-up of these step probes (``malloc_probe`` too)."""
    import torch

    import backends.torch as bk
    import lora_core as lc
    from lora_core.data.batching import collate
    from lora_core.models.llama import init_llama_weights, llama_config
    from lora_core.train.optim import AdamWConfig

    torch.set_num_threads(1)
    cfg = llama_config(shape)
    model = bk.LlamaForCausalLM(cfg)
    model.load_weights(init_llama_weights(cfg, 0))
    bk.inject_lora(model, lc.LoRATargetConfig(r=8, alpha=16, dropout=0.0, seed=1,
                                               target_modules=("q_proj", "k_proj", "v_proj", "o_proj")))  # fmt: skip
    bk.set_grad_checkpoint(model, gc)
    opt = bk.AdamW(bk.trainable_parameters(model), AdamWConfig())
    rng = np.random.default_rng(0)
    half = block // 2
    rows = [(rng.integers(1, cfg.vocab_size, half).tolist(), rng.integers(1, cfg.vocab_size, block - half).tolist())
            for _ in range(batch)]  # fmt: skip
    return bk, model, opt, collate(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-bench")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--steps", type=int, default=6, help="timed steps, alternating trim on / off")
    p.add_argument("--gc", action="store_true", help="activation checkpointing")
    p.add_argument("--ab", choices=("trim", "gc", "stride"), default="trim",
                   help="what alternates: the heap trim (default), activation checkpointing (default trim policy) "
                        "or the trim's stride in layers (--strides)")
    p.add_argument("--strides", default="1,2", help="--ab stride: the two LORA_MALLOC_TRIM_EVERY values (default 1,2)")
    a = p.parse_args(argv)
    from lora_core.train import heap

    if heap._libc() is None or not (heap.available() or heap.mode() == "off"):
        p.error("no glibc malloc_trim in this process (none under tcmalloc, which needs none): nothing to compare")
    strides = a.strides.split(",")
    if a.ab == "stride":
        try:
            if len(strides) != 2:
                raise ValueError("expected two values, e.g. 1,2")
            for x in strides:
                heap.parse_stride(x, "a stride")
        except ValueError as e:
            p.error(f"--strides {a.strides!r}: {e}")
    bk, model, opt, batch = lora_training(a.shape, a.batch, a.block, a.gc)
    names = {"trim": ("trim", "no trim"), "gc": ("GC", "plain"), "stride": tuple(f"every {x}" for x in strides)}[a.ab]
    mode = heap.mode()

    def arm(on: bool) -> None:
        if a.ab == "trim":
            os.environ["LORA_MALLOC_TRIM"] = "1" if on else "0"  # read at each step (heap.wanted)
        elif a.ab == "stride":
            os.environ["LORA_MALLOC_TRIM"] = "1"
            os.environ["LORA_MALLOC_TRIM_EVERY"] = strides[0 if on else 1]  # read at each step (heap.trim_points)
        else:
            bk.set_grad_checkpoint(model, on)

    for on in (True, False):  # a warm-up step of each
        arm(on)
        bk.train_step(model, opt, [batch], 1e-4)
    times, faults = {n: [] for n in names}, {n: [] for n in names}
    for i in range(a.steps):
        on = i % 2 == 0
        arm(on)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        bk.train_step(model, opt, [batch], 1e-4)
        times[names[0 if on else 1]].append(time.perf_counter() - t)
        faults[names[0 if on else 1]].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    for k, v in times.items():
        print(f"{k:8s} " + " ".join(f"{x:.2f}" for x in v) + f"  median {np.median(v):.2f} s, "
              f"page faults per step {np.median(faults[k]):.0f}")  # fmt: skip
    what = {"trim": "GC" if a.gc else "no GC", "gc": f"LORA_MALLOC_TRIM mode {mode}",
            "stride": "GC" if a.gc else "no GC"}[a.ab]  # fmt: skip
    print(f"{names[0]} / {names[1]}: {np.median(times[names[0]]) / np.median(times[names[1]]):.3f}x  "
          f"({a.shape}, {a.batch} x {a.block} tokens, {what})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
