"""Llama-family fine-tuning methods on a CUDA GPU: ours-torch against transformers + peft (+
bitsandbytes for QLoRA), tokens/s, peak GPU memory and the planner's prediction, from the same
weights and LoRA values (``examples.lm.bench``'s checkpoint and LoRA file).

Each row (system x method of ``examples.lm.bench_systems.METHODS`` without ZeRO) runs in this
process, one after the other: the model is built on the GPU (``--precision bf16``: forward passes
under ``torch.autocast``, weights, gradients and AdamW moments float32, in both systems), one
untimed warm-up update, then ``--steps`` timed ones (each ends with the loss read back, so the
GPU has finished). Memory: ``torch.cuda.max_memory_allocated`` from the row's start (the previous
row's tensors freed and the allocator's cache emptied first): ``peak_alloc_mb``, its
``peak_reserved_mb`` (the caching allocator's blocks) and ``device_used_mb`` (the whole device's
use after the steps, CUDA context included: ``mem_get_info``). ``plan_mb``: ``lora_core.plan``
for the row (system ``ours-torch-cuda`` or ``hf-peft-cuda``; on the CPU ``ours-torch`` or
``hf-peft``), its peak without the framework overhead (what ``max_memory_allocated`` sees) in
``plan_alloc_mb``, and ``plan_error`` against ``peak_alloc_mb``. Parity: the first update's loss
of each system (the same weights and batch: equal up to bf16 rounding) and, ``--check-logits``,
the float32 logits of ours and transformers' model on one batch, LoRA and QLoRA (max |diff| /
max |ref|). ``--decode N``: greedy decoding of N tokens on the device, ours against ``generate``
(time and whether the tokens are the same).

    python -m examples.lm.gpu_bench --shape llama-3.2-1b --batch 4 --block 512 \\
        --methods full,lora,lora-gc,qlora,qlora-gc --json gpu-llama.json

On a machine without CUDA ``--device cpu`` runs the same rows (the tests do, on a tiny shape)."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ..bench_worker import check_compile_backend, check_outputs, environment, write_output
from ..nlg.bench import _names, code_version
from ..run_options import doc_summary
from .bench import PROMPT_LEN, write_inputs
from .bench_shapes import SHAPES, check_sizes, shape_config
from .bench_shapes import targets as targets_of
from .bench_systems import SEED, bnb_dequantize_exact, make_system, token_rows

METHODS = ("full", "full-gc", "lora", "lora-gc", "qlora", "qlora-gc")
SYSTEMS = ("ours-torch", "hf-peft")


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _mb(x: float) -> float:
    return round(x / 2**20, 1)


def run_row(system: str, method: str, cfg, files: dict, args) -> dict:
    """One row: build, one warm-up update (two for a compiled ours-torch), ``args.steps`` timed
    ones; figures of the module docstring."""
    import torch

    cuda = args.device.startswith("cuda")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated() if cuda else 0
    compiled = bool(args.compile) and system == "ours-torch"  # its step through torch.compile (set_compile)
    warm = 2 if compiled else 1  # a compiled step compiles again on its second call (the RoPE table appears)
    rows = token_rows(cfg.vocab_size, (args.steps + warm, args.batch, args.block + 1), SEED + 1)
    t0 = time.perf_counter()
    sysm = make_system(system, Path(files["ckpt"]), Path(files["lora_train"]), True, method, targets_of(cfg),
                       device=args.device, precision=args.precision)  # fmt: skip
    load_s = time.perf_counter() - t0
    loaded = _mb(torch.cuda.max_memory_allocated() - start) if cuda else None
    if compiled:
        sysm.bk.set_compile(sysm.model, True, args.compile)
    batches = [sysm.prepare(r) for r in rows]
    times, losses = [], []
    for batch in batches:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(sysm.train_step(batch))  # the loss read back: the step has finished
        times.append(time.perf_counter() - t0)
    if args.profile:  # one more update under torch.profiler: where a row's time goes, per op
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            sysm.train_step(batches[-1])
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        args.profile.mkdir(parents=True, exist_ok=True)
        (args.profile / f"{system}_{method}.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))
    step_s = statistics.median(times[warm:])
    out = {"system": system, "method": method, "train_tok_s": args.batch * args.block / step_s, "median_step_s": step_s,
           "step_s": times, "warmup_steps": warm, "loss": losses, "load_s": load_s, "loaded_alloc_mb": loaded}  # fmt: skip
    if cuda:
        free, total = torch.cuda.mem_get_info()
        out.update(peak_alloc_mb=_mb(torch.cuda.max_memory_allocated() - start),
                   peak_reserved_mb=_mb(torch.cuda.max_memory_reserved()), device_used_mb=_mb(total - free))
    out["parts_mb"] = {k: _mb(v) for k, v in sysm.memory_parts().items()}
    del sysm, batches
    return out


def add_plan(row: dict, args) -> None:
    """``plan_mb`` (the planner's peak for the row: its system's ``-cuda`` twin on a GPU) and
    ``plan_alloc_mb`` (the same without its framework overhead: what ``max_memory_allocated`` counts)."""
    from lora_core.plan import bench_plan

    system = row["system"] + ("-cuda" if args.device.startswith("cuda") else "")
    p = bench_plan(args.shape, args.layers, args.batch, args.block, system, row["method"], args.vocab,
                   precision=args.precision)  # fmt: skip
    row["plan_mb"], row["plan_alloc_mb"] = round(p.peak, 1), round(p.peak - p.overhead, 1)
    if row.get("peak_alloc_mb"):
        row["plan_error"] = round(row["plan_alloc_mb"] / row["peak_alloc_mb"] - 1, 4)


def check_logits(cfg, files: dict, args) -> dict:
    """Float32 logits of ours-torch and transformers' model on one batch, on the device, max
    |diff| / max |ref|: LoRA (``logits_rel_err``) and QLoRA (``qlora_logits_rel_err``: ours'
    NF4 base against bitsandbytes' ``Linear4bit``, each quantizing the same checkpoint), both
    with the decode LoRA file (``lora_B`` drawn nonzero, so the adapters count)."""
    import torch

    rows = token_rows(cfg.vocab_size, (2, min(args.block, 128)), SEED + 3)
    ids = torch.from_numpy(rows).to(args.device)
    out = {"rows": list(rows.shape)}
    if not args.device.startswith("cuda"):  # bitsandbytes' own CPU kernel, wrong at some widths
        out["bnb_dequantize_exact"] = all(bnb_dequantize_exact(w) for w in {cfg.hidden_size, cfg.intermediate_size})
    for method, key in (("lora", "logits_rel_err"), ("qlora", "qlora_logits_rel_err")):
        ours, hf = (make_system(name, Path(files["ckpt"]), Path(files["lora_decode"]), False, method, targets_of(cfg),
                                device=args.device) for name in ("ours-torch", "hf-peft"))  # fmt: skip
        with torch.no_grad():
            ours.model.eval()
            hf.model.eval()
            a = ours.model(ids)
            a = (a[0] if isinstance(a, tuple) else a).float()  # (logits, cache)
            b = hf.model(input_ids=ids).logits.float()
        out[key] = float((a - b).abs().max() / b.abs().max())
        del ours, hf
    return out


def decode(cfg, files: dict, args) -> dict:
    """Greedy decoding on the device, float32, LoRA (the decode file): ``args.decode`` new tokens
    after ``PROMPT_LEN``-token prompts, ``args.batch`` of them, for each system (ours-torch:
    ``beam_search`` with one beam, its captured decode step on a GPU; transformers + peft:
    ``generate``); one untimed call of 2 tokens first (kernels, the captured step), then the
    timed one; ``same_tokens``: the systems' outputs equal."""
    import torch

    from .bench import PROMPT_LEN

    prompts = token_rows(cfg.vocab_size, (args.batch, PROMPT_LEN), SEED + 2)
    out, tokens = {"new_tokens": args.decode, "prompts": list(prompts.shape)}, {}
    for name in SYSTEMS:
        sysm = make_system(name, Path(files["ckpt"]), Path(files["lora_decode"]), False, "lora", targets_of(cfg),
                           device=args.device)  # fmt: skip
        sysm.greedy(prompts, 2)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens[name] = sysm.greedy(prompts, args.decode)  # token lists: read back, the device has finished
        out[f"{name}_s"] = time.perf_counter() - t0
        del sysm
        gc.collect()
    out["time_ratio"] = out["ours-torch_s"] / out["hf-peft_s"]  # time: below 1, ours is faster
    out["same_tokens"] = tokens["ours-torch"] == tokens["hf-peft"]
    return out


def env_info(device: str) -> dict:
    """The code version, the packages' versions and the CPU (``bench_worker.environment``), torch's
    CUDA build and the device (the GPU's name, memory and SMs)."""
    import torch

    info = {"code": code_version(), **environment(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": device}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_mb=_mb(p.total_memory), sm=p.multi_processor_count)
    for mod in ("transformers", "peft", "bitsandbytes"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info


def table(rows: list[dict]) -> str:
    lines = [f"{'system':11s} {'method':9s} {'tok/s':>9s} {'step s':>8s} {'peak MB':>9s} {'plan MB':>9s} "
             f"{'err':>7s} {'loss[0]':>9s}"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"{r['system']:11s} {r['method']:9s} ERROR {r['error'][:100]}")
            continue
        err = f"{100 * r['plan_error']:+.1f}%" if r.get("plan_error") is not None else "-"
        peak = f"{r['peak_alloc_mb']:.0f}" if r.get("peak_alloc_mb") else "-"
        plan = f"{r['plan_alloc_mb']:.0f}" if r.get("peak_alloc_mb") and r.get("plan_alloc_mb") else "-"  # a GPU's counter
        lines.append(f"{r['system']:11s} {r['method']:9s} {r['train_tok_s']:9.0f} {r['median_step_s']:8.4f} "
                     f"{peak:>9s} {plan:>9s} {err:>7s} {r['loss'][0]:9.5f}")  # fmt: skip
    by = {(r["system"], r["method"]): r for r in rows if "error" not in r}
    for m in sorted({r["method"] for r in rows}):
        o, h = by.get(("ours-torch", m)), by.get(("hf-peft", m))
        if o and h:  # throughput: above 1, ours is faster
            mem = f", peak memory {o['peak_alloc_mb'] / h['peak_alloc_mb']:.3f}x" if o.get("peak_alloc_mb") else ""
            lines.append(f"ours-torch / hf-peft {m}: tok/s {o['train_tok_s'] / h['train_tok_s']:.3f}x{mem}, "
                         f"first loss {o['loss'][0]:.6f} vs {h['loss'][0]:.6f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.lm.gpu_bench", description=doc_summary(__doc__))
    p.add_argument("--shape", default="llama-3.2-1b", choices=SHAPES)
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="timed updates after one warm-up")
    p.add_argument("--methods", default="full,lora,lora-gc,qlora,qlora-gc")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--check-logits", action="store_true", help="also compare ours' and transformers' fp32 logits (LoRA, QLoRA)")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="also profile one more update of each row (torch.profiler): DIR/SYSTEM_METHOD.txt, by op")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="also time greedy decoding of N new tokens (float32, LoRA), ours vs transformers' generate")
    p.add_argument("--compile", default=None, metavar="DYNAMO_BACKEND",
                   help="ours-torch's training step through torch.compile with this backend (inductor; "
                        "aot_eager compiles faster): two warm-up updates instead of one")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        methods, systems = _names(args.methods, METHODS, "--methods"), _names(args.systems, SYSTEMS, "--systems")
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.decode < 0:
        p.error(f"--decode must be >= 0 (0: no decoding), got {args.decode}")
    if args.decode and sorted(systems) != sorted(SYSTEMS):
        p.error(f"--decode {args.decode} compares {' and '.join(SYSTEMS)}: give both in --systems, or --decode 0")
    wrong = check_compile_backend(args.compile) or check_outputs(json=args.json)
    if wrong:
        p.error(wrong)
    wrong = check_sizes(args, max(args.block, PROMPT_LEN + args.decode if args.decode else 0), batch=args.batch,
                        block=args.block, steps=args.steps)  # fmt: skip
    if wrong:
        p.error(wrong)
    cfg = shape_config(args.shape, args.layers, args.vocab)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"settings": settings, "env": env_info(args.device), "rows": []}
    with tempfile.TemporaryDirectory(prefix="lm_gpu_bench_") as d:
        t0 = time.perf_counter()
        files = write_inputs(cfg, Path(d))
        log(f"checkpoint of {args.shape} written in {time.perf_counter() - t0:.1f} s")
        if args.check_logits:
            result["logits"] = check_logits(cfg, files, args)
            log(f"logits ours vs transformers: {result['logits']}")
        if args.decode:
            result["decode"] = decode(cfg, files, args)
            log(f"greedy decoding: {result['decode']}")
        for method in methods:
            for system in systems:
                log(f"{system} {method}")
                try:
                    row = run_row(system, method, cfg, files, args)
                except Exception as e:  # a row that fails is reported, the others still run
                    row = {"system": system, "method": method, "error": f"{type(e).__name__}: {e}"}
                else:
                    add_plan(row, args)
                result["rows"].append(row)
                log(json.dumps({k: v for k, v in row.items() if k not in ("step_s", "loss")}))
                if args.json:  # each row as it comes: a crash later loses nothing before it
                    write_output(args.json, json.dumps(result, indent=1))
    text = table(result["rows"])
    if "decode" in result:
        d = result["decode"]
        text += (f"\ngreedy {d['prompts'][0]} x {d['new_tokens']} tokens: ours-torch {d['ours-torch_s']:.3f} s, "
                 f"hf-peft generate {d['hf-peft_s']:.3f} s, time ours / hf {d['time_ratio']:.3f}, same tokens {d['same_tokens']}")
    print(json.dumps(result["env"]))
    print(text)
    result["table"] = text
    if args.json:
        write_output(args.json, json.dumps(result, indent=1))
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
