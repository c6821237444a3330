"""The methods table of ``examples.lm.bench --methods``: per fine-tuning method and system the
tokens/s, the time per 100 updates, the share of the GEMM peak by the method's FLOP count, the
peak memory (RSS, private, anonymous), its reduction against full fine-tuning on the same system,
and the peak split into weights, gradients, optimizer state and activations; and a PNG of it.

FLOPs per trained token, counted as the studies do (M: the forward products of every
projection and the LM head, A: attention's QK^T and AV, L: the LoRA products):

    full fine-tuning   3 M + 3 A          (forward, input gradients, weight gradients)
    LoRA, QLoRA        2 M + 3 A + 3 L    (frozen weights: no weight gradient)

Activation checkpointing adds a forward pass per layer that this count leaves out (it is
overhead, not useful work); QLoRA's dequantization is not counted either.

The split of the peak (``parts``, MB): ``weights``, ``gradients`` and ``optimizer`` are the bytes
of the tensors that hold them (every parameter and buffer as stored, the trainable parameters'
gradients, AdamW's moments), measured in the worker after the timed steps; ``activations``
is the rest of the growth: peak private memory minus the private memory before the model was
built minus those three (activations, temporaries of the backward pass, and what the
allocator keeps).

ZeRO rows (``-z2``, ``-z3``: ``--ranks`` processes, each on the bench's batch): tokens/s over
all ranks' rows, its share of the peak of as many cores, memory per rank (the rank with the
largest peak), the time of a step the slowest rank's.

``python -m examples.lm.methods_table A.json B.json ... --plot PNG`` merges runs of one workload
into one table (a later file's row replaces an earlier one's of the same method and system: a
re-run). The files' ``settings`` that define a row's workload must be equal (``WORKLOAD``: the
shape, its ``layers`` and ``vocab`` overrides, ``batch``, ``block`` and ``threads``; a key a file
lacks reads as None, the bench's default), else it refuses, in one line naming both files and
the keys, and exits 2. The other settings may differ between the files, each row planned with
its own file's: the code version, ``systems``, ``methods``, ``steps``, ``new_tokens``,
``repeats``, ``compile``, the ZeRO rows' ``ranks`` and ``hf_zero_engine``, the heap's
``malloc_trim``, ``allocator`` and ``head_pieces``. Each row's ``%peak`` is against its own
file's GEMM peak (``gemm.peak_gflops``: the files may come from different machines); where the
files of the table's rows measured different peaks, a line under the table lists them. Rows of
``lora_core.plan.validate.SUPERSEDED`` are left out, each named with its reason on stderr.

The planner column: ``predicted MB`` is ``lora_core.plan.bench_plan`` for the row's method,
system and shape (the memory planner, docs/planning.md), ``error %`` its difference from the
measured peak anonymous memory (the run's own: not the pages of the memory-mapped checkpoint).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import NamedTuple

from lora_core.plan.memory import bench_ranked

PARTS = ("weights", "gradients", "optimizer", "activations")
# the bench settings that define a row's workload: files that differ in one are not merged
WORKLOAD = ("shape", "layers", "vocab", "batch", "block", "threads")


def method_flops(flops: dict, method: str) -> float:
    """FLOPs per trained token of ``method`` (module docstring); ``flops`` as the bench's
    ``train_flops_per_token``."""
    if method.startswith("full"):
        return 3 * flops["matmul"] + 3 * flops["attention"]
    return flops["train_step"]


def split_key(key: str) -> tuple[str, str]:
    system, _, method = key.partition(" ")
    return system, method or "lora"


def predicted(settings: dict | None, system: str, method: str, measured: float | None, malloc: str | None = None) -> tuple:
    """The planner's peak (MB) for a row and its error (%) against ``measured``; ``settings``:
    the bench's ``shape``, ``layers``, ``vocab``, ``batch``, ``block`` (None: no prediction), and
    the frozen head's piece rule (``head_pieces``; none recorded: "within", a run before 7b0a1cb);
    ``malloc``: the allocator the row ran under (``tcmalloc``; else glibc's, as before 98c5579)."""
    from lora_core.plan import SYSTEMS, bench_plan

    if not settings or system not in SYSTEMS:
        return None, None
    try:
        p = bench_plan(settings["shape"], settings.get("layers"), settings["batch"], settings["block"], system, method,
                       settings.get("vocab"), ranks=settings.get("ranks") or 2, zero_engine=engine(settings, system),
                       heap_trim=settings.get("malloc_trim") or "off",
                       allocator=malloc or "glibc", head_pieces=settings.get("head_pieces", "within")).peak  # fmt: skip
    except ValueError:  # a method the system refuses (jittor's ZeRO-3): no plan, as no measurement
        return None, None
    return p, (None if not measured else 100 * (p - measured) / measured)


def engine(settings: dict, system: str) -> str | None:
    """The ZeRO engine of a bench row when the bench chose it (hf-peft's ``--hf-zero-engine``)."""
    return settings.get("hf_zero_engine") if system == "hf-peft" else None


def rows(med: dict, flops: dict, peak_gflops: float, settings: dict | None = None) -> list[dict]:
    """One dict per (method, system) with the table's figures, in method order; with the
    bench's ``settings`` (shape, layers, batch, block), the planner's prediction too."""
    from .bench_systems import METHODS

    out = []
    for key, m in med.items():
        system, method = split_key(key)
        tok_s = m.get("train_tok_s")
        gflops = None if tok_s is None else method_flops(flops, method) * tok_s / 1e9
        # a ZeRO row's tokens are every rank's, each rank on its own core: the peak of that many
        cores = ((settings or {}).get("ranks") or 2) if bench_ranked(method) else 1
        full = med.get(f"{system} full")
        base = full.get("train_peak_private_mb") if full else None
        private = m.get("train_peak_private_mb")
        pred, err = predicted(settings, system, method, m.get("train_peak_anon_mb"), m.get("allocator"))
        out.append({"method": method, "system": system, "tok_s": tok_s, "gflops": gflops,
                    "peak_fraction": None if gflops is None else gflops / (cores * peak_gflops),
                    "s_per_100": None if not tok_s else 100 * m["median_step_s"],
                    "rss_mb": m.get("train_peak_rss_mb"), "private_mb": private, "anon_mb": m.get("train_peak_anon_mb"),
                    "vs_full": None if not (base and private) else private / base,
                    "parts_mb": m.get("parts_mb") or {}, "predicted_mb": pred, "error_pct": err})  # fmt: skip
    return sorted(out, key=lambda r: (METHODS.index(r["method"]), r["system"]))


def table_lines(rows_: list[dict], fmt) -> list[str]:
    head = (f"{'method':11s} {'system':12s} {'tok/s':>7s} {'s/100 upd':>9s} {'%peak':>6s} {'RSS MB':>7s} {'priv MB':>7s} "
            f"{'anon MB':>7s} {'vs full':>7s} {'weights':>7s} {'grads':>7s} {'optim':>7s} {'act+etc':>7s} "
            f"{'pred MB':>7s} {'err %':>6s}")
    lines = [head]
    for r in rows_:
        frac = None if r["peak_fraction"] is None else 100 * r["peak_fraction"]
        lines.append(f"{r['method']:11s} {r['system']:12s} {fmt(r['tok_s'], '.1f'):>7s} {fmt(r['s_per_100'], '.1f'):>9s} "
                     f"{fmt(frac, '.1f'):>6s} {fmt(r['rss_mb'], '.0f'):>7s} {fmt(r['private_mb'], '.0f'):>7s} "
                     f"{fmt(r['anon_mb'], '.0f'):>7s} {fmt(r['vs_full'], '.2f'):>7s} "
                     + " ".join(f"{fmt(r['parts_mb'].get(p), '.0f'):>7s}" for p in PARTS)
                     + f" {fmt(r.get('predicted_mb'), '.0f'):>7s} {fmt(r.get('error_pct'), '+.1f'):>6s}")  # fmt: skip
    return lines


def plot(rows_: list[dict], path: Path, title: str) -> None:
    """Two panels: tokens/s per (method, system), and the peak private memory split into its parts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']}\n{r['system'].replace('ours-', '')}" for r in rows_]
    x = range(len(rows_))
    wide = len(rows_) > 18  # the study's 13 methods x 3 systems: narrower bars, labels turned
    fig, (a, b) = plt.subplots(2, 1, figsize=(min(24.0, max(6.0, (0.45 if wide else 0.9) * len(rows_) + 2)), 8 if wide else 7),
                               sharex=True)  # fmt: skip
    a.bar(x, [r["tok_s"] or 0 for r in rows_], color="#4c72b0")
    a.set_ylabel("tokens / s")
    a.set_title(title, fontsize=9)
    bottom = [0.0] * len(rows_)
    colors = {"weights": "#8c8c8c", "gradients": "#dd8452", "optimizer": "#c44e52", "activations": "#55a868"}
    for part in PARTS:
        vals = [max(r["parts_mb"].get(part) or 0.0, 0.0) for r in rows_]
        b.bar(x, vals, bottom=bottom, label=part if part != "activations" else "activations and the rest",
              color=colors[part])
        bottom = [u + v for u, v in zip(bottom, vals)]
    b.set_ylabel("peak private memory above the baseline, MB")
    b.legend(fontsize=8)
    b.set_xticks(list(x), [lb.replace("\n", " ") for lb in labels] if wide else labels, fontsize=7,
                 rotation=90 if wide else 0)  # fmt: skip
    fig.tight_layout()
    try:
        write_atomically(Path(path), lambda f: fig.savefig(f, dpi=120, format="png"))
    finally:
        plt.close(fig)


def write_atomically(path: Path, write) -> None:
    """``write(f)`` into a file beside ``path``, renamed over it: a failed write never leaves half a
    file there. It gets the mode a new file gets (0666 less the umask), or the replaced file's."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)  # 4-bit codes, an 8-bit absmax per 64, an fp32 absmax per 256 absmax


def qlora_weight_lines(rows_: list[dict], cfg, r: int, targets: tuple[str, ...], fmt) -> list[str]:
    """The 4-bit weights' memory against its formula: every projection at ``NF4_BITS`` = 4.127
    bits per weight (double quantization), what stays unquantized (embeddings, norms, the LM head)
    at 32 bits, and the LoRA pair at 32 bits; one line per QLoRA row with the measured bytes."""
    from lora_core.plan.memory import arch_of

    a = arch_of(cfg)  # the planner's reduction of the model: per-layer projections and the rest
    quant = a.layers * sum(i * o for i, o in a.proj.values())
    other = a.other_params + a.layers * a.layer_small
    dims = {t: a.proj[t if t in a.proj else t.rsplit(".", 1)[-1]] for t in targets}  # GPT-2's attn.c_attn is c_attn
    lora = a.layers * sum(r * (i + o) for i, o in dims.values())
    formula = (quant * NF4_BITS / 8 + 4 * (other + lora)) / 2**20
    out = []
    for row in rows_:
        w = row["parts_mb"].get("weights")
        if row["method"] == "qlora" and w:
            out.append(f"qlora weights {row['system']}: {fmt(w, '.1f')} MB measured, formula {formula:.1f} MB "
                       f"({quant / 1e6:.1f} M quantized x {NF4_BITS:.3f} bits + {(other + lora) / 1e6:.2f} M x 32 "
                       f"bits): {100 * (w / formula - 1):+.1f}%")
    return out


class MergeError(ValueError):
    """A bench JSON :func:`merged` cannot take: unreadable, not a methods bench, or of another workload."""


class Merged(NamedTuple):
    first: dict  # the first file's JSON (its settings title the plot)
    rows: list[dict]  # the table's rows, in method order
    peaks: dict[str, float]  # GEMM peak (GFLOP/s) of each file with a row in the table, by file name
    dropped: list[tuple[str, str, str]]  # (file name, "system method", why) of each row left out as superseded


def load(path: Path) -> dict:
    """A bench ``--json`` file with what :func:`merged` reads, else :class:`MergeError` naming it."""
    import json

    try:
        d = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise MergeError(f"{path}: cannot read a bench JSON: {getattr(e, 'strerror', None) or e}") from None
    try:
        ok = (isinstance(d["settings"], dict) and isinstance(d["summary"]["medians"], dict)
              and float(d["gemm"]["peak_gflops"]) > 0 and isinstance(d["flops_per_token"], dict))  # fmt: skip
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise MergeError(f"{path}: not an examples.lm.bench --json file (settings, summary.medians, gemm.peak_gflops, "
                         "flops_per_token)")  # fmt: skip
    return d


def workload_difference(a: dict, b: dict) -> list[str]:
    """The :data:`WORKLOAD` settings in which ``b`` differs from ``a``, as ``key (b's vs a's)``."""
    return [f"{k} ({b.get(k)!r} vs {a.get(k)!r})" for k in WORKLOAD if a.get(k) != b.get(k)]


def merged(paths: list[Path]) -> Merged:
    """The methods rows of several bench JSONs of one workload (``--json``) as one table: a later
    file's row replaces an earlier one's of the same method and system (a re-run), rows of
    ``lora_core.plan.validate.SUPERSEDED`` and rows without a measurement are left out. Each row's
    FLOP share is of its own file's GEMM peak. :class:`MergeError` for a file that cannot be
    read or whose :data:`WORKLOAD` settings differ from the first file's."""
    from lora_core.plan.validate import SUPERSEDED

    first = first_path = None
    by_key, dropped = {}, []
    for path in paths:
        d = load(path)
        if first is None:
            first, first_path = d, path
        elif diff := workload_difference(first["settings"], d["settings"]):
            raise MergeError(f"{path}: settings differ from {first_path}'s in {', '.join(diff)}: rows of different "
                             "workloads, not merged")  # fmt: skip
        name = Path(path).name
        try:
            got = rows(d["summary"]["medians"], d["flops_per_token"], float(d["gemm"]["peak_gflops"]), d["settings"])
        except (KeyError, TypeError, AttributeError) as e:
            raise MergeError(f"{path}: a row of summary.medians or the settings lacks {e}") from None
        for r in got:
            key = f"{r['system']} {r['method']}"
            why = SUPERSEDED.get((name, key if r["method"] != "lora" else r["system"]))
            if why is not None:
                dropped.append((name, key, why))
            elif r["tok_s"] is not None:
                by_key[key] = dict(r, file=name, peak_gflops=float(d["gemm"]["peak_gflops"]))
    full = {r["system"]: r["private_mb"] for r in by_key.values() if r["method"] == "full"}
    out = [dict(r, vs_full=(r["private_mb"] / full[r["system"]] if full.get(r["system"]) else None)) for r in by_key.values()]
    from .bench_systems import METHODS

    peaks = {}
    for r in out:
        peaks.setdefault(r["file"], r["peak_gflops"])
    return Merged(first, sorted(out, key=lambda r: (METHODS.index(r["method"]), r["system"])),
                  {n: peaks[n] for n in (Path(p).name for p in paths) if n in peaks}, dropped)  # fmt: skip


def peak_lines(peaks: dict[str, float]) -> list[str]:
    """The table's footer: where its rows' files measured different GEMM peaks, each file's."""
    if len(set(peaks.values())) < 2:
        return []
    each = ", ".join(f"{name} {g:.1f}" for name, g in peaks.items())
    return [f"%peak: each row of its own file's fp32 GEMM peak, which differ: {each} GFLOP/s"]


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.lm.methods_table A.json B.json ... [--plot PNG]``: :func:`merged`'s table
    (one line on stderr and exit status 2 for files it cannot merge, 1 for a PNG it cannot write)."""
    import argparse

    from ..nlg.bench import _fmt

    p = argparse.ArgumentParser(prog="python -m examples.lm.methods_table", description=main.__doc__)
    p.add_argument("paths", nargs="+", type=Path, help="examples.lm.bench --json files of one workload, re-runs last")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the merged table here")
    args = p.parse_args(argv)
    if args.plot is not None and not args.plot.parent.is_dir():
        print(f"{p.prog}: error: {args.plot}: its folder does not exist", file=sys.stderr)
        return 2
    try:
        m = merged(args.paths)
    except MergeError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    for name, key, why in m.dropped:
        print(f"{p.prog}: note: {name} {key} left out, superseded: {why}", file=sys.stderr)
    print("\n".join(table_lines(m.rows, _fmt) + peak_lines(m.peaks)))
    if args.plot:
        s = m.first["settings"]
        try:
            plot(m.rows, args.plot, f"{s['shape']}, batch {s['batch']} x {s['block']} per process, {s['threads']} "
                 f"thread(s); {', '.join(p.stem for p in args.paths)}")  # fmt: skip
        except OSError as e:
            print(f"{p.prog}: error: {args.plot}: cannot write the PNG: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
