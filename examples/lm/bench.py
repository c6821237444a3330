"""Speed and memory of causal-LM LoRA training and greedy decoding on a Llama or GPT-2 shape:
ours-torch, ours-jittor and transformers + peft, on the same random weights and the same batches.

Command (``docs/bench/lm_llama-bench_<hash>.txt``)::

    python -m examples.lm.bench --steps 3 --new-tokens 32 --json out.json
    # smoke run: --shape tiny-llama --steps 1 --new-tokens 4 --block 16
    # GPT-2 (lora_core.models.gpt2.PRESETS): --shape gpt2 (LoRA on attn.c_attn, attn.c_proj)

The parent draws the base weights once (``init_llama_weights`` / ``init_gpt2_weights``, seed 0)
and writes them as a transformers checkpoint folder (``config.json`` from
``LlamaConfig.to_hf_dict`` or GPT-2's, ``model.safetensors``; ``bench_shapes``) in a temporary
folder, with two LoRA files of ours' seeded initial values (``init_lora_arrays``: ``lora_A``
kaiming-uniform, ``lora_B`` zeros for training; ``lora_B`` normal(0, 0.02) for decoding, so
that the adapter changes the tokens whose equality is checked). Every system loads those
files: ours with ``bk.from_pretrained`` + ``inject_lora`` (r 8, alpha 16 on q, k, v, o; GPT-2:
``attn.c_attn`` whole and ``attn.c_proj``) + ``load_partial``; ``hf-peft`` with
``AutoModelForCausalLM.from_pretrained(dtype=float32)`` + ``peft.get_peft_model`` (the same r,
alpha, targets, dropout 0) with the values copied in. Each (system, task) runs in its own
process (``examples.bench_worker.spawn``) with ``--threads`` threads; repeats rotate the order.

Training: ``--batch`` rows of ``--block`` tokens (packed random blocks from a seeded numpy
RNG, no padding; every token is a loss position), AdamW (ours' defaults, lr 2e-4), one
untimed warm-up update, then ``--steps`` timed updates; tokens/s is batch x block over the
median step time. FLOPs per trained token, from ``count_flops_per_token(cfg, block)`` (forward:
``matmul`` M = every projection and the LM head, ``attention`` A = QK^T and AV) and the LoRA
products L = 2 r (in + out) per adapted projection::

    forward F = M + A + L
    backward: the frozen weights need only the input gradient (1 x M, no weight gradient);
    attention's two products have two activation inputs (2 x A); LoRA's A, B and input (2 x L)
    LoRA step = 2 M + 3 A + 3 L   (~ 2 F; full fine-tuning would be 3 F)

GFLOP/s is that count x tokens/s; ``%peak`` divides it by the CPU's measured fp32 GEMM peak:
the parent times ``torch.matmul`` (rows = batch x block) x (in, out) for each of the model's
projection and LM-head shapes with the same thread count, and takes the fastest.

Memory, each worker's own: ``peak RSS`` is ``VmHWM`` (/proc/self/status) at the end of the
worker (load, warm-up and all timed steps); ``anon MB``, the run's own memory, is the largest
``Anonymous`` of /proc/self/smaps_rollup sampled every 20 ms by a thread: memory the process
allocated, not the pages of a memory-mapped checkpoint (transformers keeps a safetensors base
mapped; ours-torch's Llama loader does too), which RSS counts and the page cache shares;
``Private_Clean + Private_Dirty`` (private file pages included) is sampled too and kept in
the JSON as ``peak_private_mb``. The JSON also keeps both at the baseline (the worker started,
before the system's own libraries are imported: the backend, or transformers + peft, and no model:
``baseline_*``), once the model is built (``loaded_*``, with the peak of loading) and
the anonymous peak so far after each update (``peak_anon_after_step_mb``: when the peak is
reached). ``--layers`` and ``--vocab`` override the preset's.

Decoding: ``--batch`` prompts of 32 random tokens, greedy for ``--new-tokens`` tokens with a
KV cache and the LoRA unmerged (ours: ``beam_search`` beam 1, no stop ids; HF: ``generate``
(do_sample False, no eos), after a 2-token warm-up; ``same`` says whether a system's tokens
equal hf-peft's (or the first system's without it).

Data-parallel and ZeRO rows (methods ``-dp``: DDP without sharding, ``-z2``, ``-z3``:
``bench_systems``): one job of ``--ranks`` processes,
started with ``torchrun`` (ours-torch, hf-peft) or ``mpirun`` (ours-jittor); rank r trains on
rows [r x batch, (r + 1) x batch) of the rows one process gets at ``--batch ranks x batch`` (so
its loss curve is that run's), writes its result to a file, and the parent merges them
(``merge_ranks``: memory per rank, the slowest step, tokens/s of all ranks' rows).

The methods table's planner column (``lora_core.plan.bench_plan``) and 4-bit weights formula
line (``methods_table.qlora_weight_lines``) cover both families.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from lora_core.train import allocator
from lora_core.train.allocator import worker_env
from lora_core.train.heap import HEAD_PIECE_RULE
from lora_core.train.heap import every as heap_every
from lora_core.train.heap import mode as heap_mode

from ..bench_worker import (
    check_compile_backend,
    check_outputs,
    environment,
    environment_line,
    launcher,
    run_as_worker,
    spawn,
    write_output,
)
from ..nlg.bench import _fmt, _names, code_version, log
from ..run_options import doc_summary
from .bench_shapes import (
    SHAPES,
    check_sizes,
    describe,
    flops_per_token,
    gemm_shapes,
    is_gpt2,
    projections,
    shape_config,
    weight_bytes,
    write_checkpoint,
)
from .bench_shapes import targets as targets_of
from .bench_systems import (
    ALPHA,
    HF_ZERO_ENGINES,
    METHODS,
    SEED,
    R,
    bench_ranked,
    lora_arrays,
    make_system,
    token_rows,
)
from .methods_table import PARTS, method_flops, plot, qlora_weight_lines, rows, table_lines

SYSTEMS = ("ours-torch", "ours-jittor", "hf-peft")
PROMPT_LEN, DECODE_B_STD = 32, 0.02


# ----------------------------------------------------------------------------- worker


class MemorySampler:
    """Largest ``Private_Clean + Private_Dirty`` and ``Anonymous`` (MB) of this process, read
    from /proc/self/smaps_rollup every ``interval`` s by a daemon thread until ``stop``."""

    def __init__(self, interval: float = 0.02):
        self.private = self.anon = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def sample(self) -> None:
        kb = _proc_kb("/proc/self/smaps_rollup")
        self.private = max(self.private, (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) / 1024)
        self.anon = max(self.anon, kb.get("Anonymous", 0) / 1024)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sample()

    @staticmethod
    def now() -> dict[str, float]:
        """Private (``Private_Clean + Private_Dirty``) and anonymous MB at this moment."""
        kb = _proc_kb("/proc/self/smaps_rollup")
        return {"private_mb": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) / 1024,
                "anon_mb": kb.get("Anonymous", 0) / 1024}  # fmt: skip

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.sample()
        status = _proc_kb("/proc/self/status")
        return {"peak_rss_mb": status.get("VmHWM", 0) / 1024, "peak_private_mb": self.private,
                "peak_anon_mb": self.anon, "rss_end_mb": status.get("VmRSS", 0) / 1024}  # fmt: skip


def _proc_kb(path: str) -> dict[str, int]:
    """``Key: N kB`` lines of a /proc file (empty where it cannot be read)."""
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0])
    except OSError:
        pass
    return out


def run_train(spec: dict, mem: MemorySampler) -> dict:
    from lora_core.train.distributed import discover_world

    compile_ = spec.get("compile") if spec["system"] == "ours-torch" else None
    warm = 2 if compile_ else 1  # a compiled step compiles again on its second call (the RoPE table appears)
    cfg, n = _shape(spec), spec["steps"] + warm
    world = discover_world()  # a ZeRO row's job: rank r trains on rows [r x batch, (r + 1) x batch) of each step
    b = spec["batch"]
    rows = token_rows(cfg.vocab_size, (n, world.size * b, spec["block"] + 1), SEED + 1)[:, world.rank * b : (world.rank + 1) * b]
    baseline = mem.now()  # before the system: its libraries (imported by make_system) and model count above it
    method = spec.get("method", "lora")
    system = make_system(spec["system"], Path(spec["ckpt"]), Path(spec["lora_train"]), True, method, targets_of(cfg),
                         spec.get("hf_zero_engine") or "fsdp2")  # fmt: skip
    mem.sample()
    loaded = {**mem.now(), "peak_private_mb": mem.private, "peak_anon_mb": mem.anon}  # the model built
    if compile_:
        system.bk.set_compile(system.model, True, compile_)
    batches = [system.prepare(r) for r in rows]
    times, losses, step_anon, faults = [], [], [], []
    for i, batch in enumerate(batches):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        losses.append(system.train_step(batch))
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)  # pages touched afresh
        mem.sample()
        step_anon.append(mem.anon)  # the peak so far: when it is reached
        log(f"{spec['system']} train step {i + 1}/{n} ({'warm-up' if i < warm else 'timed'}): {times[-1]:.3f} s")
    step_s = statistics.median(times[warm:])
    parts = {k: v / 2**20 for k, v in system.memory_parts().items()}
    peaks = mem.stop()
    # the rest of the peak above the baseline: activations, and the system's libraries imported by
    # make_system (the table's "act+etc": ~70 MB ours-torch, ~160 MB transformers + peft at tiny sizes)
    parts["activations"] = peaks["peak_private_mb"] - baseline["private_mb"] - sum(parts.values())
    return {"train_tok_s": world.size * b * spec["block"] / step_s, "step_s": times, "median_step_s": step_s,
            "warmup_steps": warm,
            "loss": losses, **{"train_" + k: v for k, v in peaks.items()}, "method": method,
            "baseline_private_mb": baseline["private_mb"], "baseline_anon_mb": baseline["anon_mb"],
            **{"loaded_" + k: v for k, v in loaded.items()}, "peak_anon_after_step_mb": step_anon, "parts_mb": parts,
            "minor_faults": faults,
            "attn_implementation": getattr(system, "attn_implementation", None)}  # fmt: skip


def run_decode(spec: dict, mem: MemorySampler) -> dict:
    cfg = _shape(spec)
    prompts = token_rows(cfg.vocab_size, (spec["batch"], PROMPT_LEN), SEED + 2)
    system = make_system(spec["system"], Path(spec["ckpt"]), Path(spec["lora_decode"]), False, "lora", targets_of(cfg))
    t0 = time.perf_counter()
    system.greedy(prompts, 2)  # warm-up (kernels, caches), excluded
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = system.greedy(prompts, spec["new_tokens"])
    elapsed = time.perf_counter() - t0
    log(f"{spec['system']} greedy {spec['batch']} x {spec['new_tokens']} tokens: {elapsed:.2f} s")
    return {"decode_s": elapsed, "decode_ms_tok": 1e3 * elapsed / spec["new_tokens"], "decode_warmup_s": warm,
            "tokens": tokens, **{"decode_" + k: v for k, v in mem.stop().items()}}  # fmt: skip


def run_worker(spec: dict) -> dict:
    mem = MemorySampler()
    if spec["system"] != "ours-jittor":
        import torch

        torch.set_num_threads(spec["threads"])
    out = (run_train if spec["task"] == "train" else run_decode)(spec, mem)
    out[spec["task"] + "_loadavg_end"] = os.getloadavg()[0]
    out["allocator"] = allocator.active()  # glibc's malloc or tcmalloc (lora_core.train.allocator)
    if spec.get("rank_dir"):  # one process of a ZeRO row's job: the parent merges the ranks' files
        from lora_core.train.distributed import discover_world

        rank = discover_world().rank
        path = Path(spec["rank_dir"], f"rank-{rank}.json")
        path.write_text(json.dumps(out))
        # printed: a short line, not the result: the ranks share the launcher's stdout, and two
        # long lines written at once interleave (a pipe keeps writes atomic up to 4 kB only)
        return {"rank": rank, "result": str(path)}
    return out


MEMORY_KEYS = ("train_peak_rss_mb", "train_peak_private_mb", "train_peak_anon_mb", "train_rss_end_mb")


def merge_ranks(per_rank: list[dict], ranks: int) -> dict:
    """One row from the results of a data-parallel or ZeRO job's ranks: the memory of the rank with the largest
    peak anonymous memory (peak per rank: its peaks, baseline, split), each step's time the
    slowest rank's (the ranks wait for each other in the collectives), the loss of a step the
    sum of the ranks' shares, tokens/s over all ranks' rows; ``per_rank``: each rank's peaks."""
    top = max(per_rank, key=lambda r: r["train_peak_anon_mb"])
    times = [max(ts) for ts in zip(*(r["step_s"] for r in per_rank))]
    step_s = statistics.median(times[top["warmup_steps"] :])
    out = dict(top, step_s=times, median_step_s=step_s, loss=[sum(x) for x in zip(*(r["loss"] for r in per_rank))])
    out["train_tok_s"] = top["train_tok_s"] * top["median_step_s"] / step_s  # the job's tokens, the slowest step
    out["ranks"] = ranks
    out["per_rank"] = [{k: r.get(k) for k in MEMORY_KEYS} for r in per_rank]
    return out


def _shape(spec: dict):
    return shape_config(spec["shape"], spec.get("layers"), spec.get("vocab"))


# ----------------------------------------------------------------------------- parent


def write_inputs(cfg, folder: Path) -> dict[str, str]:
    """The checkpoint folder and the two LoRA files every system loads."""
    from safetensors.numpy import save_file

    ckpt = folder / "ckpt"
    write_checkpoint(cfg, ckpt, SEED)
    save_file(lora_arrays(cfg), str(folder / "lora_train.safetensors"))
    save_file(lora_arrays(cfg, DECODE_B_STD), str(folder / "lora_decode.safetensors"))
    return {"ckpt": str(ckpt), "lora_train": str(folder / "lora_train.safetensors"),
            "lora_decode": str(folder / "lora_decode.safetensors")}  # fmt: skip


def train_flops_per_token(cfg, block: int) -> dict[str, float]:
    """Forward ``matmul``, ``attention``, ``lora`` and the LoRA step's total (module docstring)."""
    from lora_core.lora.targeting import matches_target

    f = flops_per_token(cfg, block)
    adapted = [d for m, d in projections(cfg).items() if matches_target(m, targets_of(cfg))]
    lora = sum(2 * R * (fin + fout) for fin, fout in adapted)
    return {**f, "lora": float(lora), "forward": f["matmul"] + f["attention"] + lora,
            "train_step": 2 * f["matmul"] + 3 * f["attention"] + 3 * lora}  # fmt: skip


def gemm_peak(cfg, rows: int, threads: int) -> dict:
    """GFLOP/s of ``torch.matmul((rows, in), (in, out))`` at each of the model's GEMM shapes
    (best of repeated runs, at least 0.2 s per shape); ``peak``: the fastest shape."""
    import torch

    torch.set_num_threads(threads)
    by_shape = {}
    for fin, fout in gemm_shapes(cfg):
        a, w = torch.randn(rows, fin), torch.randn(fin, fout)
        torch.matmul(a, w)
        best, spent = float("inf"), 0.0
        while spent < 0.2 or best == float("inf"):
            t0 = time.perf_counter()
            torch.matmul(a, w)
            dt = time.perf_counter() - t0
            best, spent = min(best, dt), spent + dt
        by_shape[f"{fin}x{fout}"] = 2 * rows * fin * fout / best / 1e9
    top = max(by_shape, key=by_shape.get)
    return {"rows": rows, "threads": threads, "gflops_by_shape": by_shape, "peak_gflops": by_shape[top], "peak_shape": top}  # fmt: skip


def decode_floor(cfg, new_tokens: int, threads: int) -> dict:
    """The decoding floor of the memory system: each greedy step (the prompt's and every new
    token's) reads every weight once (float32), so a step cannot take less than the weights'
    bytes over the read bandwidth, measured here as ``torch.sum`` of a 512 MB float32 tensor
    (best of 3) with the same thread count. Greedy at batch 2 does ~2 multiply-adds per weight
    read: far below the GEMM peak, the product kernels stream the weights."""
    import torch

    torch.set_num_threads(threads)
    big = torch.ones(128 * 2**20)
    big.sum()
    best = min(_timed(big.sum) for _ in range(3))
    bandwidth = big.numel() * 4 / best
    weights = weight_bytes(cfg)  # every weight but the lookup tables, the head once
    steps = new_tokens  # the prompt's pass and new_tokens - 1 cached steps
    return {"read_gb_s": bandwidth / 1e9, "weight_mb": weights / 2**20, "steps": steps,
            "floor_s": steps * weights / bandwidth}  # fmt: skip


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0






def run_all(args, files: dict[str, str]) -> dict[str, list[dict]]:
    """Every (repeat, system, task) in its own process; the system order rotates per repeat."""
    raw = {row_key(s, m): [] for s in args.systems for m in args.methods}
    kind = "gpt2" if is_gpt2(_shape(vars(args))) else "llama"
    for rep in range(args.repeats):
        order = args.systems[rep % len(args.systems) :] + args.systems[: rep % len(args.systems)]
        for system in order:
            for method in args.methods:
                result = {}
                for task in ("train", "decode") if method == "lora" else ("train",):
                    spec = {"task": task, "system": system, "method": method, "shape": args.shape,
                            "layers": args.layers, "vocab": args.vocab, "batch": args.batch, "block": args.block, "steps": args.steps,
                            "new_tokens": args.new_tokens, "threads": args.threads, "compile": args.compile,
                            "hf_zero_engine": args.hf_zero_engine,
                            **files}  # fmt: skip
                    log(f"repeat {rep + 1}/{args.repeats} {system} {method} {task}")
                    env = worker_env(os.environ, system, kind)
                    out = (spawn_ranks(spec, args.threads, args.ranks, env) if bench_ranked(method)
                           else spawn("examples.lm.bench", spec, args.threads, env=env))  # fmt: skip
                    result.update({f"{task}_{k}" if k in ("error", "wall_s") else k: v for k, v in out.items()})
                raw[row_key(system, method)].append(result)
    return raw


def spawn_ranks(spec: dict, threads: int, ranks: int, env: dict | None = None) -> dict:
    """A data-parallel or ZeRO row: ``ranks`` workers in one job (``torchrun`` for ours-torch and hf-peft,
    ``mpirun`` for ours-jittor), each writing its result to a file; merged by :func:`merge_ranks`,
    or the launcher's error when a rank wrote none."""
    engine = "mpi" if spec["system"] == "ours-jittor" else "torch"
    with tempfile.TemporaryDirectory(prefix="lm_bench_ranks_") as d:
        try:
            launch = launcher(engine, ranks)
        except RuntimeError as e:
            return {"error": str(e), "wall_s": 0.0}
        out = spawn("examples.lm.bench", dict(spec, rank_dir=d), threads, launch, env)
        per_rank = [json.loads(p.read_text()) for p in sorted(Path(d).glob("rank-*.json"))]
    # the results are the ranks' files; what they print shares the launcher's stdout, where a log
    # line of one rank can run into the other's last line: "printed no result" after a clean exit
    # with every file written is not an error
    clean = "error" not in out or out["error"] == "worker printed no result"
    if not clean or len(per_rank) != ranks:
        return {"error": out.get("error") or f"{len(per_rank)} of {ranks} ranks gave a result", "wall_s": out["wall_s"]}
    return dict(merge_ranks(per_rank, ranks), wall_s=out["wall_s"])


def row_key(system: str, method: str) -> str:
    """A row of the raw results: the system's name for LoRA (the decoding rows too), else
    ``"system method"``."""
    return system if method == "lora" else f"{system} {method}"


# ----------------------------------------------------------------------------- table

KEYS = ("train_tok_s", "median_step_s", "train_peak_rss_mb", "train_peak_private_mb", "train_peak_anon_mb",
        "decode_s", "decode_ms_tok", "decode_peak_rss_mb", "decode_peak_private_mb", "decode_peak_anon_mb")  # fmt: skip
RATIOS = (("tok/s", "train_tok_s"), ("peak RSS", "train_peak_rss_mb"), ("peak anon", "train_peak_anon_mb"),
          ("decode s", "decode_s"), ("decode RSS", "decode_peak_rss_mb"))  # fmt: skip


def medians(runs: list[dict]) -> dict:
    got = {k: [r[k] for r in runs if r.get(k) is not None] for k in KEYS}
    return {k: statistics.median(v) if v else None for k, v in got.items()}


def same_tokens(raw: dict) -> dict[str, bool | None]:
    """Per system: every run's greedy tokens equal the reference's (hf-peft's first run, or the
    first system's with tokens); None without tokens, and for every system where fewer than two
    systems decoded (nothing to compare a system with: the column says ``-``, not ``yes``)."""
    decoded = [s for s, runs in raw.items() if any("tokens" in r for r in runs)]
    if len(decoded) < 2:
        return {s: None for s in raw}
    ref_system = "hf-peft" if "hf-peft" in decoded else decoded[0]
    ref = next(r["tokens"] for r in raw[ref_system] if "tokens" in r)
    return {s: (all(r["tokens"] == ref for r in runs if "tokens" in r) if any("tokens" in r for r in runs) else None)
            for s, runs in raw.items()}  # fmt: skip


def summarise(raw: dict, args, flops: dict, peak: dict, env: dict, floor: dict | None = None) -> tuple[str, dict]:
    cfg = _shape(vars(args))
    all_med = {s: medians(runs) for s, runs in raw.items()}
    for s, m in all_med.items():
        m["parts_mb"] = {k: statistics.median(r["parts_mb"][k] for r in raw[s] if "parts_mb" in r)
                         for k in PARTS} if any("parts_mb" in r for r in raw[s]) else {}  # fmt: skip
        m["allocator"] = next((r["allocator"] for r in raw[s] if "allocator" in r), None)  # the planner's too
    med = {s: m for s, m in all_med.items() if " " not in s}  # the LoRA rows (decoding too)
    same = same_tokens({s: raw[s] for s in med})
    for s, m in med.items():
        tok_s = m["train_tok_s"]
        m["decode_floor_fraction"] = (floor["floor_s"] / m["decode_s"]) if floor and m.get("decode_s") else None
        m["gflops"] = None if tok_s is None else flops["train_step"] * tok_s / 1e9
        m["peak_fraction"] = None if tok_s is None else m["gflops"] / peak["peak_gflops"]
        m["same_tokens"] = same[s]
        m["loss0"] = next((r["loss"][0] for r in raw[s] if "loss" in r), None)
    on = ",".join(t if is_gpt2(cfg) else t.removesuffix("_proj") for t in targets_of(cfg))
    lines = [f"shape {args.shape} ({describe(cfg)}); LoRA r {R} alpha {ALPHA:g} on {on}; "
             f"batch {args.batch} x block {args.block}; "
             f"{args.steps} timed step(s) after 1 warm-up{' (ours-torch compiled: 2)' if args.compile else ''}; "
             f"{args.repeats} repeat(s); {args.threads} thread(s); "
             f"{'ours-torch compiled (' + args.compile + '); ' if args.compile else ''}greedy "
             f"{args.batch} x {args.new_tokens} new tokens after a {PROMPT_LEN}-token prompt",
             environment_line(env),
             "malloc (lora_core.train.allocator, LORA_ALLOCATOR " + allocator.mode() + "): " + ", ".join(
                 f"{k} {v}" for k, v in dict.fromkeys(  # per system, as its workers reported
                     (k.partition(" ")[0], m["allocator"]) for k, m in all_med.items() if m.get("allocator")).keys()),
             f"FLOPs per trained token {flops['train_step'] / 1e6:.1f} M (2 matmul {flops['matmul'] / 1e6:.1f} M + 3 "
             f"attention {flops['attention'] / 1e6:.2f} M + 3 LoRA {flops['lora'] / 1e6:.2f} M; forward "
             f"{flops['forward'] / 1e6:.1f} M); fp32 GEMM peak {peak['peak_gflops']:.1f} GFLOP/s "
             f"(torch.matmul {peak['rows']} x {peak['peak_shape']}, {peak['threads']} thread(s))",
             *([f"decoding floor {floor['floor_s']:.3f} s: {floor['steps']} steps x {floor['weight_mb']:.0f} MB of "
                f"weights read at {floor['read_gb_s']:.1f} GB/s (torch.sum of 512 MB, {peak['threads']} thread(s))"]
               if floor else []),
             "",
             f"{'system':12s} {'tok/s':>8s} {'step s':>7s} {'GFLOP/s':>7s} {'%peak':>6s} {'RSS MB':>7s} {'anon MB':>7s} "
             f"{'loss0':>7s} {'decode s':>8s} {'ms/tok':>7s} {'x floor':>7s} {'dec RSS':>7s} {'same':>5s}  errors"]  # fmt: skip
    for s, m in med.items():
        errors = sorted({r[k] for r in raw[s] for k in ("train_error", "decode_error") if k in r})
        frac = None if m["peak_fraction"] is None else 100 * m["peak_fraction"]
        lines.append(f"{s:12s} {_fmt(m['train_tok_s'], '.1f'):>8s} {_fmt(m['median_step_s'], '.3f'):>7s} "
                     f"{_fmt(m['gflops'], '.1f'):>7s} {_fmt(frac, '.1f'):>6s} {_fmt(m['train_peak_rss_mb'], '.0f'):>7s} "
                     f"{_fmt(m['train_peak_anon_mb'], '.0f'):>7s} {_fmt(m['loss0'], '.4f'):>7s} "
                     f"{_fmt(m['decode_s'], '.3f'):>8s} {_fmt(m['decode_ms_tok'], '.1f'):>7s} "
                     f"{_fmt(None if not m['decode_floor_fraction'] else 1 / m['decode_floor_fraction'], '.2f'):>7s} "
                     f"{_fmt(m['decode_peak_rss_mb'], '.0f'):>7s} {'-' if same[s] is None else 'yes' if same[s] else 'NO':>5s}"
                     f"  {'; '.join(errors)}")  # fmt: skip
    pairs = [(a, "hf-peft") for a in ("ours-torch", "ours-jittor")] + [("ours-jittor", "ours-torch")]
    pairs = [(a, b) for a, b in pairs if a in med and b in med]
    ratios = {}
    if pairs:
        lines += ["", f"{'ratio':26s}" + "".join(f" {label:>12s}" for label, _ in RATIOS)]
    for a, b in pairs:
        row = {label: (med[a][k] / med[b][k] if med[a][k] is not None and med[b][k] else None) for label, k in RATIOS}
        ratios[f"{a} / {b}"] = row
        lines.append(f"{a + ' / ' + b:26s}" + "".join(f" {_fmt(x, '.3f'):>12s}" for x in row.values()))
    methods = rows(all_med, flops, peak["peak_gflops"], {**vars(args), "malloc_trim": heap_mode(), "head_pieces": HEAD_PIECE_RULE})
    if len(args.methods) > 1 or args.methods != ["lora"]:
        lines += ["", f"methods: FLOPs per token full {method_flops(flops, 'full') / 1e6:.1f} M, LoRA "
                  f"{method_flops(flops, 'lora') / 1e6:.1f} M (examples/lm/methods_table.py); peak memory split "
                  f"into its parts above the baseline before the model, MB"
                  + (f"; -dp and ZeRO rows: {args.ranks} processes of {args.batch} row(s) each, memory per rank"
                     if any(bench_ranked(m) for m in args.methods) else ""),
                  *table_lines(methods, _fmt), *method_errors(raw),
                  *qlora_weight_lines(methods, cfg, R, targets_of(cfg), _fmt)]  # fmt: skip
    return "\n".join(lines), {"medians": all_med, "ratios": ratios, "same_tokens": same, "methods": methods}


def method_errors(raw: dict) -> list[str]:
    """``errors: METHOD SYSTEM: reason`` for each methods row whose worker failed (a refused
    method, such as jittor's ZeRO-3, or a crash): why a row of the table is empty."""
    out = []
    for key, runs in raw.items():
        reasons = sorted({r[k] for r in runs for k in ("train_error", "decode_error") if k in r})
        if reasons and " " in key:
            system, method = key.split(" ", 1)
            out.append(f"errors: {method} {system}: {'; '.join(reasons)}")
    return out


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return run_as_worker(run_worker, argv[1])
    p = argparse.ArgumentParser(prog="python -m examples.lm.bench", description=doc_summary(__doc__))
    p.add_argument("--shape", default="llama-bench", choices=SHAPES,
                   help="a preset of lora_core.models.llama or lora_core.models.gpt2")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size")
    p.add_argument("--batch", type=int, default=2, help="rows per training batch (and prompts decoded together)")
    p.add_argument("--block", type=int, default=256, help="tokens per training row (packed, no padding)")
    p.add_argument("--steps", type=int, default=5, help="timed training updates, after 1 warm-up (2 for ours-torch with --compile)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens decoded per prompt")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--threads", type=int, default=1, help="torch and OpenMP threads of every system and the GEMM peak")
    p.add_argument("--repeats", type=int, default=1, help="runs per system (medians reported)")
    p.add_argument("--compile", default=None, metavar="DYNAMO_BACKEND",
                   help="ours-torch's training step through torch.compile (set_compile) with this backend, e.g. "
                        "inductor; two untimed warm-up updates")  # fmt: skip
    p.add_argument("--methods", default="lora",
                   help=f"comma-separated fine-tuning methods of {','.join(METHODS)} (decoding runs with lora)")
    p.add_argument("--ranks", type=int, default=2,
                   help="processes of a data-parallel or ZeRO row (-dp, -z2, -z3 methods; torchrun or mpirun), "
                        "each on --batch rows")
    p.add_argument("--hf-zero-engine", default="fsdp2", choices=HF_ZERO_ENGINES,
                   help="what shards hf-peft's ZeRO rows: PyTorch FSDP2, or DeepSpeed (pip install deepspeed)")
    p.add_argument("--json", type=Path, default=None, help="write settings, raw runs and the summary here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the methods table here")
    args = p.parse_args(argv)
    try:  # the malloc variables, read by the workers and the summary: refused before any work
        allocator.mode(), heap_mode(), heap_every()
    except ValueError as e:
        p.error(str(e))
    try:
        args.systems = _names(args.systems, SYSTEMS, "--systems")
        args.methods = _names(args.methods, METHODS, "--methods")
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    wrong = check_sizes(args, None, batch=args.batch, block=args.block, steps=args.steps, new_tokens=args.new_tokens,
                        threads=args.threads, repeats=args.repeats)  # fmt: skip
    if wrong:
        p.error(wrong)
    if args.ranks < 2:
        p.error(f"--ranks must be >= 2 (the processes of a ZeRO row), got {args.ranks}")
    wrong = check_compile_backend(args.compile) or check_outputs(json=args.json, plot=args.plot)
    if wrong:
        p.error(wrong)
    if args.compile and "ours-torch" not in args.systems:
        p.error(f"--compile {args.compile} compiles ours-torch's step: add ours-torch to --systems, or drop --compile")
    if allocator.mode() == "tcmalloc" and "ours-torch" in args.systems and allocator.find_tcmalloc() is None:
        print(allocator.missing_warning(), file=sys.stderr, flush=True)  # its workers run under glibc's malloc
    cfg = _shape(vars(args))
    wrong = check_sizes(args, max(args.block, PROMPT_LEN + args.new_tokens))
    if wrong:
        p.error(f"--block / {PROMPT_LEN} + --new-tokens: {wrong}")
    t0, version, env = time.perf_counter(), code_version(), environment()
    flops = train_flops_per_token(cfg, args.block)
    peak = gemm_peak(cfg, args.batch * args.block, args.threads)
    floor = decode_floor(cfg, args.new_tokens, args.threads)
    with tempfile.TemporaryDirectory(prefix="lm_bench_") as d:
        raw = run_all(args, write_inputs(cfg, Path(d)))
    table, summary = summarise(raw, args, flops, peak, env, floor)
    print(table)
    print(
        f"\n(code {version}; total {time.perf_counter() - t0:.0f} s; command: python -m examples.lm.bench {' '.join(argv)})"
    )
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("json", "plot")}
        settings["code"] = version
        settings["malloc_trim"] = heap_mode()  # ours-torch's heap trim (lora_core.train.heap): the planner's too
        settings["allocator"] = allocator.mode()  # LORA_ALLOCATOR; each row's worker records what it ran (raw "allocator")
        settings["head_pieces"] = HEAD_PIECE_RULE  # the frozen head's piece rule (lora_core.train.heap.head_piece_rows)
        out = {"settings": settings, "environment": env, "flops_per_token": flops, "gemm": peak, "decode_floor": floor, "raw": raw,
               "summary": summary}  # fmt: skip
        write_output(args.json, json.dumps(out, indent=1))  # before the plot: a failing plot loses no result
    if args.plot:
        plot(summary["methods"], args.plot, f"{args.shape}, batch {args.batch} x {args.block}, {args.threads} thread(s), "
             f"code {version}")
    return 1 if any(k.endswith("_error") for runs in raw.values() for r in runs for k in r) else 0


if __name__ == "__main__":
    sys.exit(main())
