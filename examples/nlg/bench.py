"""Speed and memory benchmark: our torch and jittor backends against HF ``transformers`` + ``peft``.

For each model shape and system: training throughput (examples/s and real, non-pad tokens/s
over batches of 8 E2E training examples, dynamic padding), peak RSS, and beam-search seconds
per example on unique E2E test MRs (beam 10, at most 64 new tokens, no-repeat 4-grams,
length penalty 0.9, stop ids 50256 and 628). Every (shape, system, task) runs in its own
subprocess, so its peak RSS (``ru_maxrss``) is that system's own; the systems are
interleaved within each repeat (the order rotates per repeat); the table gives medians over
repeats, ratios and the issue's targets. Command (the README's table)::

    python -m examples.nlg.bench --data-dir ../shared/data --json bench.json
    # smoke run: --shapes tiny --steps 2 --warmup 1 --repeats 1 --beam-examples 2

Systems (same random weights, same examples in the same order, same thread count):
- ``ours-torch`` / ``ours-jittor``: ``backends.{torch,jittor}``, LoRA r=4, alpha 32 on q and v.
- ``hf-peft``: ``transformers.GPT2LMHeadModel`` (default attention implementation) with
  ``peft`` LoRA r=4, alpha 32 on the whole ``c_attn`` (peft adapts q, k and v: it cannot
  slice a fused projection), ``torch.optim.AdamW``, cross-entropy over all logits with labels
  -100 outside the completion and an attention mask for the right padding; beam search with
  ``generate`` (left padding + attention mask, ``early_stopping=False``).
- ``hf-peft-bf16`` (not in the default set): ``hf-peft`` under bf16 ``torch.autocast``.
All train with the E2E recipe's label smoothing 0.1 and weight decay 0.01, no dropout.
``--device`` (default ``cpu``) and ``--precision`` (default ``fp32``; bf16/fp16 autocast, fp16
with dynamic loss scaling; the jittor backend refuses 16-bit, see ``backends/jittor/precision.py``)
apply to every system; on a GPU the workers also report the framework's peak GPU memory.
On a GPU (``--device cuda``) the table adds each system's peak GPU memory
(``torch.cuda.max_memory_allocated``), names the GPU, driver and CUDA version, and checks
issue 8's targets instead of the CPU's: on ``gpt2-medium``, training tokens/s ours-torch /
hf-peft >= 2.0 at ``--batch`` 8 (>= 1.5 at larger batches) and beam s/example <= 0.5; peak
GPU memory ours-torch / hf-peft <= 1.0. ``--compile BACKEND`` runs ours-torch's training step
through ``torch.compile`` (``inductor``; ``cudagraphs`` also records CUDA graphs), compiled over
the timed batches once before timing. ``--decode-step`` chooses ours-torch's beam decode step;
each beam run reports ``beams_sha256``, a digest of the token ids it decoded, so that two runs'
outputs (captured and eager decode steps, say) can be compared.
Tokens/s counts the same real tokens for every system (``collate``'s ``n_tokens``), so its
ratios are those of examples/s. ``tiny`` is the ``tiny`` preset with GPT-2's vocabulary and
1024 positions (E2E ids need them). ``demo`` is the embedded demo's model (``demo`` preset: 3
layers, width 128, its 512-token BPE) on the demo's toy data set, made as the demo makes it. Threads: ``torch.set_num_threads`` and
``OMP_NUM_THREADS`` (jittor's kernels and oneDNN use OpenMP) are ``--threads`` everywhere.

Beam length: with random weights and the paper's settings, the tiny shape's outputs end after
one token (the prompt's final eos makes eos the first choice) while the gpt2 shape's run all
64; each system's stopping rule, not its speed, would then decide the time. By default eos
is therefore banned before 64 new tokens (``min_length`` / ``min_new_tokens``) and every
system decodes the full 64 steps: the worst case, the same work for all.
``--beam-min-new 0`` runs the paper's settings exactly.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from lora_core.device import DEVICE_CHOICES, parse_device
from lora_core.generate.static_cache import DECODE_STEPS
from lora_core.train.precision import PRECISIONS

from ..bench_worker import (
    check_compile_backend,
    check_outputs,
    environment,
    environment_line,
    run_as_worker,
    spawn,
    write_output,
)
from ..run_options import doc_summary
from .bench_systems import BATCH, SHAPES, beam_contexts, gen_length, make_system, shape_config, stop_ids, train_examples

SYSTEMS = ("ours-torch", "ours-jittor", "hf-peft")  # the default set
ALL_SYSTEMS = (*SYSTEMS, "hf-peft-bf16")  # hf-peft-bf16: HF+PEFT under bf16 autocast, whatever --precision says
# (label, metric, numerator, denominator, "ge"/"le", bound, shapes it applies to; None = all)
TARGETS = [
    ("train tok/s  ours-torch / hf-peft", "train_tok_s", "ours-torch", "hf-peft", "ge", 1.5, ("gpt2",)),
    ("train tok/s  ours-jittor / ours-torch", "train_tok_s", "ours-jittor", "ours-torch", "ge", 0.9, None),
    ("peak RSS     ours-torch / hf-peft", "train_rss_mb", "ours-torch", "hf-peft", "le", 1.0, None),
    ("peak RSS     ours-jittor / hf-peft", "train_rss_mb", "ours-jittor", "hf-peft", "le", 1.0, None),
    ("beam s/ex    ours-torch / hf-peft", "beam_s_ex", "ours-torch", "hf-peft", "le", 0.5, ("gpt2", "tiny")),
    ("beam s/ex    ours-jittor / ours-torch", "beam_s_ex", "ours-jittor", "ours-torch", "le", 1.1, None),
]
# on a GPU (issue 8: GPT-2 Medium, the same precision for both); "train": 2.0 at batch <= 8, 1.5 above
GPU_TARGETS = [
    ("train tok/s  ours-torch / hf-peft", "train_tok_s", "ours-torch", "hf-peft", "ge", "train", ("gpt2-medium",)),
    ("peak GPU MB  ours-torch / hf-peft", "train_gpu_mb", "ours-torch", "hf-peft", "le", 1.0, None),
    ("beam s/ex    ours-torch / hf-peft", "beam_s_ex", "ours-torch", "hf-peft", "le", 0.5, ("gpt2-medium",)),
    ("train tok/s  ours-jittor / ours-torch", "train_tok_s", "ours-jittor", "ours-torch", "ge", 0.9, None),
    ("beam s/ex    ours-jittor / ours-torch", "beam_s_ex", "ours-jittor", "ours-torch", "le", 1.1, None),
]


def targets(device: str, batch: int) -> list[tuple]:
    """The CPU targets, or on a GPU the GPU ones with the training bound of ``batch``."""
    if device == "cpu":
        return TARGETS
    return [t[:5] + ((2.0 if batch <= 8 else 1.5) if t[5] == "train" else t[5], t[6]) for t in GPU_TARGETS]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- worker


def _max_rss_mb(reset: bool = False) -> float:
    """Peak RSS so far (``ru_maxrss``); ``reset`` then restarts the mark (Linux ``clear_refs`` 5,
    which ``ru_maxrss`` follows), so that a later read covers one phase."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if reset:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
    return peak


def run_train(spec: dict) -> dict:
    data_dir, steps, warmup, bs = Path(spec["data_dir"]), spec["steps"], spec["warmup"], spec["batch"]
    pairs = train_examples(data_dir, bs * (warmup + steps), spec["shape"])
    system = make_system(spec["system"], shape_config(spec["shape"]), True, stop_ids(spec["shape"]),
                         spec["device"], spec["precision"], compile=spec["compile"])
    batches = [pairs[i : i + bs] for i in range(0, len(pairs), bs)]
    prepared = [system.prepare(b) for b in batches]
    gc.collect()
    system.reset_peak_gpu()  # the phase's peak: training (with its compilation and warm-up), not the build
    compile_s = 0.0
    if system.compiled_graphs() is not None:  # compile every length bucket of the timed batches first
        t0 = time.perf_counter()
        for batch in prepared[warmup:]:
            system.train_step(batch)
        compile_s = time.perf_counter() - t0
        log(f"{spec['shape']} {spec['system']} compiled {system.compiled_graphs()} graph(s) in {compile_s:.1f} s")
    times, losses, before = [], [], 0.0
    for i, batch in enumerate(prepared):
        if i == warmup:
            before = _max_rss_mb(reset=True)  # build + warm-up
        t0 = time.perf_counter()
        losses.append(system.train_step(batch))
        times.append(time.perf_counter() - t0)
        log(f"{spec['shape']} {spec['system']} train step {i + 1}/{len(prepared)}: {times[-1]:.3f} s")
    timed = sum(times[warmup:])
    n_tokens = sum(sum(len(c) + len(t) - 1 for c, t in b) for b in batches[warmup:])
    return {"train_ex_s": bs * steps / timed, "train_tok_s": n_tokens / timed, "step_s": times,
            "seq_len": [max(len(c) + len(t) - 1 for c, t in b) for b in batches], "loss": losses,
            "train_rss_mb": max(before, _max_rss_mb()), "train_phase_rss_mb": _max_rss_mb(),
            "build_warmup_rss_mb": before, "train_gpu_mb": system.peak_gpu_mb(),
            "compiled_graphs": system.compiled_graphs(), "compile_s": compile_s, **_gpu_info(spec["device"])}  # fmt: skip


def _gpu_info(device: str) -> dict:
    """The GPU's name and the CUDA version torch was built with (empty on the CPU)."""
    if device == "cpu":
        return {}
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"gpu_name": torch.cuda.get_device_name(torch.device(device)), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda}


def gpu_driver() -> str | None:
    """The NVIDIA driver version (``nvidia-smi``), or None without one."""
    cmd = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def run_beam(spec: dict) -> dict:
    contexts = beam_contexts(Path(spec["data_dir"]), spec["beam_examples"], spec["shape"])
    system = make_system(spec["system"], shape_config(spec["shape"]), False, stop_ids(spec["shape"]),
                         spec["device"], spec["precision"], spec["decode_step"])
    bs = spec["beam_batch"]
    system.reset_peak_gpu()  # the phase's peak: decoding (with its warm-up), not the build
    t0 = time.perf_counter()
    system.beam(contexts[:bs], bs, 4, 4)  # warm-up (kernels, caches), excluded
    warm = time.perf_counter() - t0
    log(f"{spec['shape']} {spec['system']} beam warm-up {warm:.2f} s")
    t0 = time.perf_counter()
    outs = system.beam(contexts, bs, 64, spec["beam_min_new"])
    elapsed = time.perf_counter() - t0
    lengths = [gen_length(o, stop_ids(spec["shape"])) for o in outs]
    log(f"{spec['shape']} {spec['system']} beam {len(contexts)} examples: {elapsed:.2f} s")
    digest = hashlib.sha256(json.dumps([[int(t) for t in o] for o in outs]).encode()).hexdigest()
    return {"beam_s_ex": elapsed / len(contexts), "beam_batch": bs, "beam_warmup_s": warm,
            "gen_len": float(np.mean(lengths)), "gen_lengths": lengths, "beams_sha256": digest,
            "beam_rss_mb": _max_rss_mb(), "beam_gpu_mb": system.peak_gpu_mb()}  # fmt: skip


def run_worker(spec: dict) -> dict:
    if spec["system"] != "ours-jittor":
        import torch

        torch.set_num_threads(spec["threads"])
    fn = run_train if spec["task"] == "train" else run_beam
    out = fn(spec)
    out["loadavg_end"] = os.getloadavg()[0]
    return out


# ----------------------------------------------------------------------------- driver


def run_all(args) -> dict:
    """Every (shape, repeat, system, task) in its own process; systems rotate per repeat."""
    raw = {}
    for shape in args.shapes:
        raw[shape] = {s: [] for s in args.systems}
        for rep in range(args.repeats):
            order = args.systems[rep % len(args.systems) :] + args.systems[: rep % len(args.systems)]
            for system in order:
                result = {"loadavg_start": os.getloadavg()[0]}
                for task in ("train", "beam"):
                    spec = {"task": task, "system": system, "shape": shape, "data_dir": str(args.data_dir),
                            "steps": args.steps, "warmup": args.warmup, "beam_examples": args.beam_examples,
                            "beam_batch": args.beam_batch[system], "beam_min_new": args.beam_min_new,
                            "threads": args.threads, "device": args.device, "precision": args.precision,
                            "decode_step": args.decode_step, "batch": args.batch, "compile": args.compile}  # fmt: skip
                    log(f"{shape} repeat {rep + 1}/{args.repeats} {system} {task}")
                    out = spawn("examples.nlg.bench", spec, spec["threads"])
                    result.update({f"{task}_{k}" if k in ("error", "wall_s", "loadavg_end") else k: v
                                   for k, v in out.items()})  # fmt: skip
                raw[shape][system].append(result)
    return raw


def code_version() -> str:
    """``git describe`` of the code measured (``-dirty`` if the tree has edits), or ``unknown``."""
    root = Path(__file__).resolve().parents[2]
    cmd = ["git", "-C", str(root), "describe", "--always", "--dirty"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def medians(runs: list[dict]) -> dict:
    keys = ("train_ex_s", "train_tok_s", "train_rss_mb", "train_phase_rss_mb", "beam_s_ex", "gen_len", "beam_rss_mb",
            "train_gpu_mb", "beam_gpu_mb")  # fmt: skip
    got = {k: [r[k] for r in runs if r.get(k) is not None] for k in keys}  # (no GPU figures on a CPU)
    return {k: statistics.median(v) if v else None for k, v in got.items()}


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def summarise(raw: dict, args) -> tuple[str, dict]:
    """The table (medians over repeats, target ratios) and its numbers."""
    lines, summary = [], {}
    gpu = args.device != "cpu"
    for shape, by_system in raw.items():
        cfg = shape_config(shape)
        med = {s: medians(runs) for s, runs in by_system.items()}
        summary[shape] = {"medians": med, "targets": []}
        lines += [f"\nshape {shape} (n_embd {cfg.n_embd}, n_layer {cfg.n_layer}, vocab {cfg.vocab_size}); "
                  f"batch {args.batch}, {args.steps} timed steps after {args.warmup} warm-up, {args.repeats} repeat(s), "
                  f"{args.threads} thread(s); beam {args.beam_examples} MRs; device {args.device}, "
                  f"precision {args.precision}, ours-torch compile {args.compile}",  # fmt: skip
                  f"{'system':12s} {'train ex/s':>10s} {'tok/s':>8s} {'peak RSS MB':>11s} {'train-phase':>11s} "
                  f"{'beam s/ex':>9s} {'beam bs':>7s} {'gen len':>7s} {'beam RSS MB':>11s}"
                  + (f" {'train GPU MB':>12s} {'beam GPU MB':>11s}" if gpu else "") + "  errors"]  # fmt: skip
        if gpu:
            info = next((r for runs in by_system.values() for r in runs if "gpu_name" in r), {})
            lines.append(f"GPU {info.get('gpu_name', '?')}, driver {getattr(args, 'driver', None) or '?'}, "
                         f"torch {info.get('torch', '?')} (CUDA {info.get('torch_cuda', '?')})")  # fmt: skip
        for s, m in med.items():
            errors = sorted({r[k] for r in by_system[s] for k in ("train_error", "beam_error") if k in r})
            lines.append(f"{s:12s} {_fmt(m['train_ex_s']):>10s} {_fmt(m['train_tok_s'], '.1f'):>8s} "
                         f"{_fmt(m['train_rss_mb'], '.0f'):>11s} {_fmt(m['train_phase_rss_mb'], '.0f'):>11s} "
                         f"{_fmt(m['beam_s_ex'], '.3f'):>9s} {args.beam_batch[s]:>7d} {_fmt(m['gen_len'], '.1f'):>7s} "
                         f"{_fmt(m['beam_rss_mb'], '.0f'):>11s}"
                         + (f" {_fmt(m['train_gpu_mb'], '.0f'):>12s} {_fmt(m['beam_gpu_mb'], '.0f'):>11s}" if gpu else "")
                         + f"  {'; '.join(errors)}")  # fmt: skip
        loads = [r[k] for runs in by_system.values() for r in runs
                 for k in ("loadavg_start", "train_loadavg_end", "beam_loadavg_end") if k in r]  # fmt: skip
        lines.append(f"(1-min load average of the machine around the runs: median {statistics.median(loads):.1f}, "
                     f"range {min(loads):.1f}-{max(loads):.1f}, on {os.cpu_count()} CPUs)")  # fmt: skip
        lines.append(f"{'target':40s} {'ratio':>7s} {'bound':>8s}  result")
        for label, key, num, den, op, bound, shapes in targets(args.device, args.batch):
            if num not in med or den not in med:
                continue
            a, b = med[num][key], med[den][key]
            ratio = a / b if a is not None and b else None
            if ratio is None:
                verdict = "n/a"
            elif shapes is not None and shape not in shapes:
                verdict = "info (target is for " + ",".join(shapes) + ")"
            else:
                verdict = "PASS" if (ratio >= bound if op == "ge" else ratio <= bound) else "FAIL"
            lines.append(
                f"{label:40s} {_fmt(ratio, '.3f'):>7s} {('>= ' if op == 'ge' else '<= ') + str(bound):>8s}  {verdict}"
            )
            summary[shape]["targets"].append({"target": label, "ratio": ratio, "op": op, "bound": bound,
                                              "result": verdict})  # fmt: skip
    return "\n".join(lines), summary


def _beam_batch(text: str, systems: list[str]) -> dict[str, int]:
    """``8`` (every system) or ``ours-torch=8,ours-jittor=4,hf-peft=8`` (others default to 8)."""
    def size(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"--beam-batch: {value!r} is not a batch size (an int >= 1)")
        return n

    if "=" not in text:
        return {s: size(text) for s in systems}
    out = {s: 8 for s in systems}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in ALL_SYSTEMS:
            raise argparse.ArgumentTypeError(f"--beam-batch: unknown system {name!r}; choose from {ALL_SYSTEMS}")
        out[name] = size(value)
    return out


def _names(text: str, valid: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{flag}: unknown {bad or names}; choose from {valid}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # a second run of the same row would be folded into the first's repeats
        raise argparse.ArgumentTypeError(f"{flag}: {twice} named twice")
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return run_as_worker(run_worker, argv[1])
    p = argparse.ArgumentParser(prog="python -m examples.nlg.bench", description=doc_summary(__doc__))
    p.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parents[3] / "shared" / "data",
                   help="folder with e2e/{train,test}.txt and gpt2-vocab/ (default: ../shared/data beside the project)")
    p.add_argument("--shapes", default="gpt2,tiny,demo", help="comma-separated of gpt2, tiny, demo, gpt2-medium, gpt2-large (for a GPU); default gpt2,tiny,demo")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed training steps first")
    p.add_argument("--repeats", type=int, default=3, help="runs per system (medians reported)")
    p.add_argument("--beam-examples", type=int, default=8, help="unique E2E test MRs to beam-decode")
    p.add_argument("--beam-batch", default="8", help="inputs per beam batch: N, or SYSTEM=N,... (default 8)")
    p.add_argument("--beam-min-new", type=int, default=64,
                   help="eos banned before this many new tokens (default 64: every output runs the full 64 "
                        "tokens; 0 = the paper's setting, see the module docstring)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1,
                   help="threads for every system (torch and OpenMP; default 1, as the issue's reference figures)")  # fmt: skip
    p.add_argument("--device", default="cpu", help=f"{DEVICE_CHOICES} for every system (default cpu)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="every system's precision")
    p.add_argument("--decode-step", choices=DECODE_STEPS, default="auto",
                   help="ours-torch's beam decode step (auto: captured on a GPU, eager on the CPU; "
                        "ours-jittor always runs its own)")  # fmt: skip
    p.add_argument("--batch", type=int, default=BATCH, help=f"training batch (default {BATCH}, the paper's)")
    p.add_argument("--compile", default="off",
                   help="ours-torch's training step through torch.compile with this dynamo backend (inductor for "
                        "real runs, aot_eager compiles fast), after one untimed pass over the timed batches "
                        "(every length bucket compiled); off (default): eager")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write every raw number here")
    args = p.parse_args(argv)
    try:
        args.shapes = _names(args.shapes, SHAPES, "--shapes")
        args.systems = _names(args.systems, ALL_SYSTEMS, "--systems")
        parse_device(args.device, "--device")
        args.beam_batch = _beam_batch(args.beam_batch, args.systems)
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(str(e))
    if min(args.steps, args.repeats, args.beam_examples, args.threads, args.batch) < 1 or args.warmup < 0:
        p.error("--steps, --repeats, --beam-examples, --threads and --batch must be >= 1, --warmup >= 0")
    wrong = check_compile_backend(args.compile) or check_outputs(json=args.json)
    if wrong:
        p.error(wrong.replace("choose from ", "choose from off, "))
    args.driver = gpu_driver() if args.device != "cpu" else None
    args.data_dir = args.data_dir.resolve()
    for need in ("e2e/train.txt", "e2e/test.txt", "gpt2-vocab"):
        if not (args.data_dir / need).exists():
            p.error(f"--data-dir {args.data_dir}: {need} is missing")
    t0, version, env = time.perf_counter(), code_version(), environment()
    raw = run_all(args)
    table, summary = summarise(raw, args)
    print(environment_line(env))
    print(table.lstrip("\n"))
    print(
        f"\n(code {version}; total {time.perf_counter() - t0:.0f} s; command: python -m examples.nlg.bench {' '.join(argv)})"
    )
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
        settings["code"] = version
        write_output(args.json, json.dumps({"settings": settings, "environment": env, "raw": raw, "summary": summary},
                                           indent=1))
    errors = any(k.endswith("_error") for by in raw.values() for runs in by.values() for r in runs for k in r)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
