"""Where a training step's time goes, ours against transformers + peft: the profile behind the
speed targets (docs/llama.md), as one command.

Both systems are built in one process on the methods bench's weights, LoRA values and batch (as
``examples.lm.speed_ab`` builds them); after an untimed round, each round runs one plain step of
each system (timed, the order reversed every other round) and one step of each under
``torch.profiler`` (``record_shapes``, ``with_flops``). The profiled steps' self CPU time is split
by operator into

- ``gemm``: the matrix products (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, ...), with the
  FLOPs the profiler counts for them (2 per multiply-add, from the recorded shapes);
- ``attention``: PyTorch's scaled-dot-product attention kernels, forward and backward;
- ``other``: everything else (norms, RoPE, SwiGLU, residuals, the loss, the optimizer, copies,
  autograd's own work).

The split is taken per profiled step and applied to the median plain step (the profiler's own
overhead stretches small operators more than large ones; both are printed), and the bound
follows from it: for ours to reach ``--target`` times the other system's tokens/s with its GEMMs
taking what they take, everything else must fit in ``other_step / target - ours_gemm``; and at
``--peak-fraction`` of the GEMM peak measured at the model's own sizes (``examples.lm.bench``'s
``gemm_peak``), the whole step's FLOPs leave ``flops / (fraction x peak) - ours_gemm`` for the rest.

    python -m examples.lm.step_profile --method lora --rounds 5 --json profile.json

One thread by default (the bench's setting). Speed figures on a shared 2-core VM spread by up to
30% within minutes; the split within one step is steadier than the step itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ..bench_worker import environment_line, write_output
from ..nlg.bench import code_version
from .bench import gemm_peak, train_flops_per_token, write_inputs
from .bench_shapes import describe
from .bench_shapes import targets as targets_of
from .bench_systems import make_system
from .speed_ab import add_run_options, check_run_options, start_run

SYSTEMS = ("ours-torch", "hf-peft")
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation"})
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention")
PARTS = ("gemm", "attention", "other")


def part_of(op: str) -> str:
    """The part (``PARTS``) an operator's self time counts to."""
    if op in GEMM_OPS:
        return "gemm"
    if any(m in op for m in ATTENTION_MARKS):
        return "attention"
    return "other"


def split_events(events) -> dict:
    """Self CPU seconds of each part, the GEMMs' FLOPs and calls, from profiler events (objects
    with ``key``/``name``, ``self_cpu_time_total`` in microseconds and ``flops``)."""
    out = {p: 0.0 for p in PARTS} | {"gemm_flops": 0.0, "gemm_calls": 0}
    for e in events:
        name = getattr(e, "key", None) or e.name
        part = part_of(name)
        out[part] += e.self_cpu_time_total / 1e6
        if part == "gemm":
            out["gemm_flops"] += float(e.flops or 0)
            out["gemm_calls"] += int(getattr(e, "count", 1))
    out["total"] = sum(out[p] for p in PARTS)
    return out


def bound(step: dict, target: float, flops_step: float, peak_gflops: float, fraction: float) -> dict:
    """The arithmetic of the module docstring, from the per-system figures of ``summarise``:
    ``step[name] = {"step_s", "gemm_s", "attention_s", "other_s"}``, ours first."""
    (ours, a), (other, b) = list(step.items())[:2]
    need = b["step_s"] / target  # ours' step at ``target`` x the other's tokens/s
    peak_step = flops_step / (fraction * peak_gflops * 1e9)
    rest = a["attention_s"] + a["other_s"]
    return {"target": target, "vs": other, "step_needed_s": need, "rest_allowed_s": need - a["gemm_s"],
            "rest_s": rest, "attention_s": a["attention_s"], "reachable_same_gemms": need - a["gemm_s"] >= rest,
            "peak_fraction": fraction, "peak_step_s": peak_step, "peak_rest_allowed_s": peak_step - a["gemm_s"],
            "reachable_at_peak_fraction": peak_step - a["gemm_s"] >= rest}  # fmt: skip


def summarise(plain: dict[str, list[float]], profiled: dict[str, list[dict]], tokens: int) -> dict:
    """Per system: the median plain step, the median profiled step's parts (seconds and
    fractions), and the parts scaled to the plain step (``*_s``)."""
    out = {}
    for n, times in plain.items():
        med = statistics.median(times)
        prof = profiled[n]
        frac = {p: statistics.median(s[p] / s["total"] for s in prof) for p in PARTS}
        gemm_s = statistics.median(s["gemm"] for s in prof)
        gflops = statistics.median(s["gemm_flops"] for s in prof) / 1e9
        out[n] = {"step_s": med, "tok_s": tokens / med, "profiled_step_s": statistics.median(s["total"] for s in prof),
                  "fractions": frac, "gemm_gflop": gflops, "gemm_calls": prof[0]["gemm_calls"],
                  "gemm_gflops_per_s": gflops / gemm_s if gemm_s else None,
                  **{f"{p}_s": frac[p] * med for p in PARTS}}  # fmt: skip
    return out


def _profiled_step(system, batch) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        system.train_step(batch)
    return split_events(prof.key_averages())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, rounds=5, rounds_help="rounds after one untimed round: a plain and a profiled step of each")
    p.add_argument("--systems", default="ours-torch,hf-peft", help="two of " + ", ".join(SYSTEMS) + ", ours first")
    p.add_argument("--target", type=float, default=1.1, help="the tokens/s ratio over the second system to test (1.1)")
    p.add_argument("--peak-fraction", type=float, default=0.9, help="the fraction of the GEMM peak to test (0.9)")
    p.add_argument("--json", default=None, help="write the settings, every step's figures and the summary here")
    a = p.parse_args(argv)
    names = [s.strip() for s in a.systems.split(",") if s.strip()]
    if len(names) != 2 or len(set(names)) != 2 or any(n not in SYSTEMS for n in names):
        p.error(f"--systems {a.systems!r}: two different systems of {', '.join(SYSTEMS)}")
    if not names[0].startswith("ours"):
        p.error(f"--systems {a.systems!r}: ours first (the system whose step is profiled against the second)")
    check_run_options(p, a)
    if a.target <= 0 or not 0 < a.peak_fraction <= 1:
        p.error("--target must be positive and --peak-fraction in (0, 1]")

    env, cfg, tokens, rows = start_run(a)
    plain: dict[str, list[float]] = {n: [] for n in names}
    profiled: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="step_profile_") as tmp:
        files = write_inputs(cfg, Path(tmp))
        systems = {n: make_system(n, Path(files["ckpt"]), Path(files["lora_train"]), True, a.method, targets_of(cfg))
                   for n in names}  # fmt: skip
        batches = {n: systems[n].prepare(rows) for n in names}
        for n in names:  # untimed
            systems[n].train_step(batches[n])
        for r in range(a.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                systems[n].train_step(batches[n])
                plain[n].append(time.perf_counter() - t0)
                profiled[n].append(_profiled_step(systems[n], batches[n]))
            print(f"round {r + 1}/{a.rounds}: " + "  ".join(
                f"{n} {plain[n][-1]:.3f} s (profiled {profiled[n][-1]['total']:.3f} s, GEMMs "
                f"{profiled[n][-1]['gemm'] / profiled[n][-1]['total']:.0%})" for n in names), flush=True)  # fmt: skip
        del systems, batches
    peak = gemm_peak(cfg, tokens, a.threads)
    flops = train_flops_per_token(cfg, a.block)
    # the step's useful FLOPs (the bench's count; GC's recomputed forward not counted): full
    # fine-tuning adds the weight gradients LoRA skips and has no LoRA products
    full = a.method.startswith("full")
    flops_step = tokens * (flops["train_step"] + (flops["matmul"] - 3 * flops["lora"] if full else 0.0))
    summary = summarise(plain, profiled, tokens)
    b = bound(summary, a.target, flops_step, peak["peak_gflops"], a.peak_fraction)

    print(f"\n{a.method} on {a.shape} ({describe(cfg)}), batch {a.batch} x {a.block} tokens, {a.rounds} rounds, "
          f"{a.threads} thread(s); code {code_version()}")  # fmt: skip
    print(environment_line(env))
    print(f"GEMM peak at the model's sizes {peak['peak_gflops']:.1f} GFLOP/s ({peak['peak_shape']}); "
          f"the step's FLOPs {flops_step / 1e9:.1f} G")  # fmt: skip
    print(f"{'system':12s} {'step s':>7s} {'tok/s':>7s} {'profiled':>8s} {'GEMMs s':>8s} {'GEMM %':>6s} {'GFLOP/s':>7s} "
          f"{'% peak':>6s} {'attn s':>7s} {'other s':>7s} {'GEMM GFLOP':>10s} {'calls':>5s}")  # fmt: skip
    for n, s in summary.items():
        rate = s["gemm_gflops_per_s"] or 0.0
        print(f"{n:12s} {s['step_s']:7.3f} {s['tok_s']:7.1f} {s['profiled_step_s']:8.3f} {s['gemm_s']:8.3f} "
              f"{s['fractions']['gemm']:6.1%} {rate:7.1f} {rate / peak['peak_gflops']:6.1%} {s['attention_s']:7.3f} "
              f"{s['other_s']:7.3f} {s['gemm_gflop']:10.1f} {s['gemm_calls']:5d}")  # fmt: skip
    ours, other = names
    print(f"\n{ours} at {a.target:g}x {other}'s tokens/s: a step of at most {b['step_needed_s']:.3f} s; its GEMMs "
          f"take {summary[ours]['gemm_s']:.3f} s, leaving {b['rest_allowed_s']:.3f} s for attention and the rest, "
          f"which take {b['rest_s']:.3f} s (attention alone {b['attention_s']:.3f} s): "
          f"{'reachable' if b['reachable_same_gemms'] else 'not reachable'} with these GEMMs")  # fmt: skip
    print(f"{ours} at {a.peak_fraction:.0%} of the GEMM peak: a step of at most {b['peak_step_s']:.3f} s, leaving "
          f"{b['peak_rest_allowed_s']:.3f} s beside its GEMMs for {b['rest_s']:.3f} s of work: "
          f"{'reachable' if b['reachable_at_peak_fraction'] else 'not reachable'}")  # fmt: skip
    if a.json:
        out = {"settings": vars(a), "environment": env, "code": code_version(), "gemm": peak, "flops_step": flops_step,
               "plain": plain, "profiled": profiled, "summary": summary, "bound": b}  # fmt: skip
        write_output(Path(a.json), json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
