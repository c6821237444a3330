"""Training speed of two or three systems in one process, their steps alternating: ours against
transformers + peft with the machine's drift shared by both.

The methods bench (``examples.lm.bench``) runs each system in its own process, one after the
other, which its memory figures need; its speed ratios then carry whatever the machine did in
between. On this project's 2-core VM one system's steps spread by up to 30% within minutes
(docs/llama.md), more than the few percent the speed targets are about. Here every system is
built in one process on the same random weights, LoRA values and batch (the bench's inputs),
and each round runs one training step of each, the order reversed every other round; the
ratio of two systems is taken per round (their steps seconds apart) and summarised by its
median with a bootstrap interval.

    python -m examples.lm.speed_ab --method lora --rounds 20
    python -m examples.lm.speed_ab --method full --rounds 12 --systems ours-torch,hf-peft,ours-jittor

Speed only: the processes' memory is shared, so memory stays the bench's. Each system's first
loss is printed: the same weights and tokens give the same number in every system.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..bench_worker import check_outputs, environment, environment_line, write_output
from ..nlg.bench import code_version
from .bench import write_inputs
from .bench_shapes import SHAPES, check_sizes, describe, shape_config
from .bench_shapes import targets as targets_of
from .bench_systems import METHODS, SEED, bench_ranked, make_system, token_rows

SYSTEMS = ("ours-torch", "ours-jittor", "hf-peft")
ONE_PROCESS = tuple(m for m in METHODS if not bench_ranked(m))  # no -dp or ZeRO rows: those need several processes


def bootstrap_median(x: list[float], level: float = 0.9, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval (``level``) of the median of ``x``."""
    a = np.asarray(x, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(a), size=(draws, len(a)))
    meds = np.median(a[idx], axis=1)
    lo = (1.0 - level) / 2.0
    return float(np.quantile(meds, lo)), float(np.quantile(meds, 1.0 - lo))


def summarise(times: dict[str, list[float]], tokens: int, level: float = 0.9) -> dict:
    """Median step time and tokens/s of each system, and for each system after the first the
    per-round tokens/s ratio first / it (its time over the first's) with its median and a
    bootstrap interval of that median."""
    names = list(times)
    out = {"systems": {}, "ratios": {}}
    for n in names:
        med = statistics.median(times[n])
        out["systems"][n] = {"median_step_s": med, "tok_s": tokens / med, "min_step_s": min(times[n]),
                             "max_step_s": max(times[n])}  # fmt: skip
    first = names[0]
    for n in names[1:]:
        per_round = [b / a for a, b in zip(times[first], times[n])]  # tokens/s of first over n's
        lo, hi = bootstrap_median(per_round, level)
        out["ratios"][f"{first} / {n}"] = {"per_round": per_round, "median": statistics.median(per_round),
                                           "interval": [lo, hi], "level": level}  # fmt: skip
    return out


def add_run_options(p: argparse.ArgumentParser, rounds: int, rounds_help: str) -> None:
    """The options of a one-process comparison (this command's and ``examples.lm.step_profile``'s):
    the bench's shape, batch, method, rounds and threads."""
    p.add_argument("--shape", default="llama-bench", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--method", default="lora", help="a one-process method of the bench: " + ", ".join(ONE_PROCESS))
    p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    p.add_argument("--threads", type=int, default=1)


def check_run_options(p: argparse.ArgumentParser, a) -> None:
    if a.method not in ONE_PROCESS:
        p.error(f"--method {a.method!r}: one of {', '.join(ONE_PROCESS)} (ZeRO rows need several processes: examples.lm.bench)")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    wrong = check_sizes(a, a.block, batch=a.batch, block=a.block, threads=a.threads) or check_outputs(
        json=Path(a.json) if a.json else None)
    if wrong:
        p.error(wrong)


def start_run(a):
    """The process's thread count set (before torch runs anything), then the run's environment,
    model config, tokens per step and token rows (the bench's seed)."""
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import torch

    torch.set_num_threads(a.threads)
    cfg = shape_config(a.shape, a.layers, a.vocab)
    return environment(), cfg, a.batch * a.block, token_rows(cfg.vocab_size, (a.batch, a.block + 1), SEED + 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, rounds=20, rounds_help="timed rounds (one step of each system), after one untimed round")
    p.add_argument("--systems", default="ours-torch,hf-peft", help="comma-separated, the first is the one compared with the others")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: every system's forward under torch.autocast (the GPU bench's setting; on a CPU a "
                        "proxy of the host work of its steps at small widths)")
    p.add_argument("--json", default=None, help="write the settings, every step's time and the summary here")
    a = p.parse_args(argv)
    names = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or len(names) < 2 or len(set(names)) != len(names):
        p.error(f"--systems {a.systems!r}: two or three different systems of {', '.join(SYSTEMS)}")
    if a.precision == "bf16" and "ours-jittor" in names:
        p.error("--precision bf16: the jittor backend trains in fp32 only (backends/jittor/precision.py); drop ours-jittor from "
                "--systems or run fp32")  # fmt: skip
    check_run_options(p, a)
    env, cfg, tokens, rows = start_run(a)
    with tempfile.TemporaryDirectory(prefix="speed_ab_") as tmp:
        files = write_inputs(cfg, Path(tmp))
        systems, batches, loss0 = {}, {}, {}
        for n in names:
            systems[n] = make_system(n, Path(files["ckpt"]), Path(files["lora_train"]), True, a.method, targets_of(cfg),
                                     precision=a.precision)
            batches[n] = systems[n].prepare(rows)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds + 1):  # round 0: warm-up, untimed
            for n in names if r % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                loss = systems[n].train_step(batches[n])
                dt = time.perf_counter() - t0
                if r == 0:
                    loss0[n] = loss
                else:
                    times[n].append(dt)
            if r:
                print(f"round {r}/{a.rounds}: " + "  ".join(f"{n} {times[n][-1]:.3f} s" for n in names), flush=True)
    summary = summarise(times, tokens)
    print(f"\n{a.method} on {a.shape} ({describe(cfg)}), batch {a.batch} x {a.block} tokens, {a.precision}, "
          f"{a.rounds} rounds, {a.threads} thread(s); code {code_version()}")  # fmt: skip
    print(environment_line(env))
    print("first loss: " + ", ".join(f"{n} {loss0[n]:.6f}" for n in names))
    for n, s in summary["systems"].items():
        print(f"{n:12s} median step {s['median_step_s']:.3f} s ({s['min_step_s']:.3f}-{s['max_step_s']:.3f}), {s['tok_s']:.1f} tok/s")
    for k, r in summary["ratios"].items():
        lo, hi = r["interval"]
        print(f"tokens/s {k}: median of per-round ratios {r['median']:.3f}, {int(100 * r['level'])}% interval {lo:.3f}-{hi:.3f}")
    if a.json:
        out = {"settings": vars(a), "environment": env, "code": code_version(), "loss0": loss0, "times": times, "summary": summary}
        write_output(Path(a.json), json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
