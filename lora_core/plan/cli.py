"""``lora-plan``: the memory planner on the console (``lora_core.plan.memory``).

Usage::

    lora-plan --model llama-3.2-3b --method lora --targets q_proj,k_proj,v_proj,o_proj --r 8 \
        --precision bf16 --gc --zero 0 --ranks 1 --batch 4 --seq 512 --system gpu
    python -m lora_core.plan --model path/to/config.json --method full --zero 3 --ranks 8

``--model``: a ``config.json`` (or its folder) of GPT-2 or the Llama family (llama, mistral,
qwen2), or a preset name of ``lora_core.models.llama.PRESETS`` / ``lora_core.PRESETS``.

``--zero-engine`` takes only an engine the system's runs shard ZeRO on (``System.engines``)
and only with ``--zero 2`` or ``3``; the plan's header names the engine of a ZeRO plan.
``--heap-trim on|off`` and ``--allocator glibc|tcmalloc`` where the planner models no effect of
them (a system that never trims its heap or chooses its malloc, a GPT-2 model for the trim, a
run under tcmalloc for the trim) are planned as without them, with a one-line note on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys

from ..models.gpt2 import GPT2Config
from ..train.allocator import MODES as ALLOCATOR_MODES
from ..train.allocator import wanted as under_tcmalloc
from ..train.heap import TRIM_MODES
from .memory import METHODS, PRECISIONS, STAGES, SYSTEMS, ZERO_ENGINES, PlanConfig, fmt_plan, plan, resolve_model

# LoRA's adapted projections when --targets is not given: the studies' q, k, v, o for the Llama
# family; GPT-2's fused qkv product (the paper adapts its q and v slices)
DEFAULT_TARGETS = {"llama": ("q_proj", "k_proj", "v_proj", "o_proj"), "gpt2": ("c_attn",)}
DEFAULT_R = 8
class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in ``--help``, except where there is none (a required option, a None whose help
    says what it stands for)."""

    def _get_help_string(self, action):
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lora-plan", description="Predict a fine-tuning run's per-rank peak memory.",
                                formatter_class=_Defaults)
    p.add_argument("--model", required=True, help="config.json (or its folder) or a preset name")
    p.add_argument("--method", default="lora", choices=METHODS, help="what trains")
    p.add_argument("--targets", default=None,
                   help="comma-separated adapted projections of LoRA and QLoRA (None: "
                        f"{','.join(DEFAULT_TARGETS['llama'])} for the Llama family, {','.join(DEFAULT_TARGETS['gpt2'])} "
                        "for GPT-2)")
    p.add_argument("--r", type=int, default=None, help=f"LoRA rank (None: {DEFAULT_R})")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="bf16: activations in bf16; a system that runs its forward under autocast ("
                        + ", ".join(k for k, v in SYSTEMS.items() if v.autocast) + ") keeps every weight fp32 "
                        "(bf16 copies per product), the others (" + ", ".join(k for k, v in SYSTEMS.items() if not v.autocast)
                        + ") hold the frozen weights in bf16")
    p.add_argument("--gc", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--zero", type=int, default=0, help=f"ZeRO stage, one of {STAGES}")
    p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--batch", type=int, default=2, help="micro-batch (rows per rank)")
    p.add_argument("--seq", type=int, default=256, help="tokens per row")
    p.add_argument("--system", default="ours-torch", choices=sorted(SYSTEMS),
                   help="what runs it (ours-torch, ours-jittor, hf-peft: the CPU; *-cuda, gpu: a GPU)")
    p.add_argument("--zero-engine", default=None, choices=ZERO_ENGINES,
                   help="what shards a ZeRO run (--zero 2|3), one the system runs: "
                        + "; ".join(f"{s}: {'|'.join(v.engines)}" for s, v in SYSTEMS.items()) + " (None: the first)")
    p.add_argument("--overhead-mb", type=float, default=None, help="replace the system's measured baseline (MB)")
    p.add_argument("--heap-trim", default="auto", choices=TRIM_MODES,
                   help="the run's LORA_MALLOC_TRIM mode (ours-torch's Llama: glibc's heap returned at each layer; "
                        "auto: with --gc or a 4-bit base)")
    p.add_argument("--allocator", default="auto", choices=ALLOCATOR_MODES,
                   help="the run's LORA_ALLOCATOR mode (lora_core.train.allocator; auto: ours-torch's Llama runs "
                        "under tcmalloc, as the commands run them where it is installed)")
    return p


def option_notes(args: argparse.Namespace, family: str) -> list[str]:
    """One line per option given that the planner models no effect of for this run:
    ``--heap-trim on|off`` where nothing is trimmed (a system without ``trim_kinds``, a model
    kind it does not trim, a run under tcmalloc), ``--allocator glibc|tcmalloc`` for a system
    without constants for tcmalloc (``System.tcmalloc``: only ours-torch chooses its malloc);
    and ``--heap-trim off`` at ZeRO-3 on ours-torch, whose run then skips a release the plan
    assumes (docs/planning.md)."""
    sysm, notes = SYSTEMS[args.system], []
    if args.heap_trim != "auto":
        why = ""
        if not sysm.trim_kinds:
            why = f"{args.system}'s runs never trim the heap (LORA_MALLOC_TRIM is read by ours-torch's Llama steps)"
        elif family not in sysm.trim_kinds:
            why = f"{args.system} trims the heap in {', '.join(sysm.trim_kinds)} layers only, not {family}'s"
        elif sysm.tcmalloc and under_tcmalloc(args.allocator, args.system, family):
            why = (f"under tcmalloc (--allocator {args.allocator}" + (f": {args.system}'s {family} runs" if args.allocator == "auto" else "")
                   + ") nothing is trimmed; --allocator glibc plans a trimmed run")  # fmt: skip
        # ours-torch's ZeRO-3 step returns the allocator's free memory before FSDP2 gathers the root
        # unit unless LORA_MALLOC_TRIM=0 (lora_core.train.heap.releases_before_gather): not modelled
        release = args.heap_trim == "off" and args.zero == 3 and bool(sysm.trim_kinds)
        unplanned = ("at ZeRO-3 the run skips the release of freed memory before FSDP2's root gather, which can "
                     "hold 30-60 MB more than planned (not modelled)")  # fmt: skip
        if why:
            notes.append(f"--heap-trim {args.heap_trim} does not change the plan: {why}" + (f"; {unplanned}" if release else ""))
        elif release:
            notes.append(f"--heap-trim off: {unplanned}")
    if args.allocator != "auto" and not sysm.tcmalloc:
        notes.append(f"--allocator {args.allocator} does not change the plan: {args.system}'s runs do not choose "
                     "their malloc (LORA_ALLOCATOR is read by ours-torch's CPU runs)")  # fmt: skip
    return notes


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.method == "full" and (args.targets is not None or args.r is not None):
        p.error("--targets and --r choose LoRA's adapters; --method full trains every weight (leave them out)")
    if args.overhead_mb is not None and not (math.isfinite(args.overhead_mb) and args.overhead_mb >= 0):
        p.error(f"--overhead-mb must be a number >= 0, got {args.overhead_mb}")
    engines = SYSTEMS[args.system].engines
    if args.zero_engine is not None and args.zero not in (2, 3):
        p.error(f"--zero-engine {args.zero_engine} shards a ZeRO run: it needs --zero 2 or 3, not --zero {args.zero}")
    if args.zero_engine is not None and args.zero_engine not in engines:
        p.error(f"--zero-engine {args.zero_engine}: {args.system} runs ZeRO on {' or '.join(engines)} only")
    try:
        cfg, name = resolve_model(args.model)
        family = "gpt2" if isinstance(cfg, GPT2Config) else "llama"
        targets = DEFAULT_TARGETS[family] if args.targets is None else tuple(t for t in args.targets.split(",") if t)
        c = PlanConfig(method=args.method, targets=targets, r=DEFAULT_R if args.r is None else args.r,
                       precision=args.precision, gc=args.gc, zero=args.zero, ranks=args.ranks, batch=args.batch,
                       seq=args.seq, system=args.system, overhead_mb=args.overhead_mb, heap_trim=args.heap_trim,
                       allocator=args.allocator, zero_engine=args.zero_engine)  # fmt: skip
        result = plan(cfg, c)
    except (ValueError, OSError) as e:
        p.error(str(e))
    for note in option_notes(args, family):
        print(f"{p.prog}: note: {note}", file=sys.stderr)
    print(fmt_plan(result, c, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
