"""The options the train commands share (``examples.nlg.train``, ``examples.cls.train``,
``examples.lm.train``): how long and how to train, where, resuming, and a QLoRA base
(``--quantize nf4``), with how they change a recipe's ``TrainConfig``.

Each command adds its own options (data, base, recipe) and then ``add_run_options``; after
parsing, ``apply_run_options`` turns ``--method``, ``--max-steps``, ``--precision`` and
``--zero`` into the run's ``TrainConfig`` and refuses quantization options that do not fit it.
``--device``, ``--grad-checkpoint`` and the 4-bit base's settings change no update rule: they
are not part of ``TrainConfig`` (the base's quantization goes into the run's base note, which a
resume must match)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from lora_core.device import DEVICE_CHOICES
from lora_core.train.precision import PRECISIONS
from lora_core.train.recipes import TrainConfig
from lora_core.train.run_dir import checkpoint_of

COMPUTE_DTYPES = ("float32", "bfloat16")


def doc_summary(doc: str) -> str:
    """A command's ``--help`` description: the first paragraph of its module docstring as one
    line, its closing ``::`` (the usage block that follows in the source) made a full stop."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return first[:-2] + "." if first.endswith("::") else first


def output_file(name: str, path: Path | None) -> None:
    """Refuse, before any work, an output file option (``--json``) that names a folder, or
    whose folder cannot be made because a file stands where a folder of its path must be."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{name} {path}: is a folder; give a file name")
    no_file_above(name, path)


def no_file_above(name: str, path: Path) -> None:
    """Refuse an output path (``--out-dir``, ``--json``) below a file (``afile/sub``), before any work."""
    for parent in Path(path).parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{name} {path}: {parent} is a file, not a folder")


def positive(name: str, value: int | None) -> None:
    """Refuse an option that must be a positive int (``--batch-size 0``, ``-2``), naming it."""
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def add_run_options(parser: argparse.ArgumentParser, *, set_help: str, grad_checkpoint: bool = True,
                    quantize: bool = False, exclusive_resume: bool = True) -> None:
    """Add the shared options to ``parser``.

    Args:
        set_help: what ``--set KEY=VALUE`` overrides (the keys differ per command). ``--set``
            takes several pairs and may be repeated (``args.overrides``: one flat list).
        grad_checkpoint: add ``--grad-checkpoint``.
        quantize: add ``--quantize nf4``, ``--no-double-quant`` and ``--compute-dtype``.
        exclusive_resume: ``--resume`` and ``--resume-from`` exclude each other (otherwise
            both may be given: ``--resume-from`` implies ``--resume``).
    """
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help=set_help)
    parser.add_argument("--max-steps", type=int, help="total optimizer updates (the schedule ends there)")
    parser.add_argument("--method", choices=("lora", "full"),
                        help="lora: train the recipe's LoRA adapter; full: every weight (default: the recipe's)")
    parser.add_argument("--zero", type=int, choices=(0, 2, 3),
                        help="ZeRO stage over the processes: 0 (DDP), 2 (gradients and optimizer state sharded), "
                             "3 (parameters too; torch)")  # fmt: skip
    parser.add_argument("--device", default="auto", help=f"{DEVICE_CHOICES} (auto: the GPU when the backend has one)")
    parser.add_argument("--precision", choices=PRECISIONS, help="forward-pass precision (default: the recipe's, fp32)")
    if grad_checkpoint:
        parser.add_argument("--grad-checkpoint", action="store_true",
                            help="recompute each block in the backward pass (less memory, the same results)")
    if quantize:
        add_quantize_options(parser)
    resume = parser.add_mutually_exclusive_group() if exclusive_resume else parser
    resume.add_argument("--resume", action="store_true", help="continue the run in --out-dir from OUT/latest")
    resume.add_argument("--resume-from", type=Path, metavar="CKPT",
                        help="continue the run in --out-dir from this OUT/ckpt-N (the intact one --resume names "
                             "when the latest checkpoint is damaged)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--dist-timeout", type=float, default=300.0,
                        help="seconds to wait for the other processes (jobs of several processes)")
    parser.add_argument("--stop-after", type=int, help=argparse.SUPPRESS)  # test hook: SIGKILL after update N


def add_quantize_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--quantize nf4``, ``--no-double-quant`` and ``--compute-dtype`` (a QLoRA base; the
    commands that load a base and an adapter take them too, to use the base it was trained on)."""
    parser.add_argument("--quantize", choices=("nf4",),
                        help="QLoRA: the frozen base's projections stored as NF4 and dequantized per product "
                             "(a checkpoint is quantized while it loads)")
    parser.add_argument("--no-double-quant", action="store_true",
                        help="--quantize: keep the block scales in float32 (default: 8-bit, QLoRA's double "
                             "quantization)")
    parser.add_argument("--compute-dtype", choices=COMPUTE_DTYPES,
                        help="--quantize: dtype of the 4-bit products (default float32)")


def apply_run_options(cfg: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    """``cfg`` with ``--method``, ``--max-steps``, ``--precision`` and ``--zero`` where given;
    the quantization options are checked against the result (``check_quantize``).

    Raises:
        ValueError: a bad value (``TrainConfig``'s message) or quantization options that do not fit.
    """
    given = {k: getattr(args, k) for k in ("method", "max_steps", "precision", "zero") if getattr(args, k) is not None}
    cfg = dataclasses.replace(cfg, **given) if given else cfg
    check_quantize(args, cfg.method)
    return cfg


def check_quantize(args: argparse.Namespace, method: str = "lora") -> None:
    """Refuse ``--quantize`` on a run without LoRA and the 4-bit options without ``--quantize``."""
    quantize = getattr(args, "quantize", None)
    if quantize is None:
        stray = [o for o, given in (("--no-double-quant", getattr(args, "no_double_quant", False)),
                                    ("--compute-dtype", getattr(args, "compute_dtype", None) is not None)) if given]
        if stray:
            verb = "apply" if len(stray) > 1 else "applies"
            raise ValueError(f"{' and '.join(stray)} {verb} to a 4-bit base only: add --quantize nf4")
    elif method == "full":
        raise ValueError(f"--quantize {quantize} with method full: a 4-bit base is frozen, QLoRA trains a LoRA "
                         f"adapter on it (use --method lora, or leave out --quantize)")


def write_base(args: argparse.Namespace, base_dir, write, *payload) -> None:
    """``write(base_dir, *payload)`` (rank 0: under ``comm.on_main``), unless the run resumes and
    ``OUT/base`` holds a whole save (``formats.checkpoint.saved_whole``): writing it again would
    leave it without its config for as long as the weights take to write. The trainer then checks
    the resumed run's configuration, seed included, against the saved one: a resume with another
    seed is refused and leaves the base as the run wrote it."""
    from lora_core.formats.checkpoint import saved_whole

    resuming = bool(getattr(args, "resume", False) or getattr(args, "resume_from", None) is not None)
    if not (resuming and saved_whole(base_dir)):
        write(base_dir, *payload)


def quantize_kwargs(args: argparse.Namespace) -> dict:
    """The backends' ``from_pretrained`` arguments of a 4-bit base (empty without ``--quantize``):
    ``double_quant`` False with ``--no-double-quant``, else None (not set: True where the base is
    quantized while it loads, a published 4-bit checkpoint's own otherwise; ``loaded_quant``)."""
    if getattr(args, "quantize", None) is None:
        return {}
    return {"quantize": args.quantize, "double_quant": False if args.no_double_quant else None,
            "compute_dtype": args.compute_dtype or "float32"}


def loaded_quant(base, quant: dict) -> dict:
    """The 4-bit settings of ``base`` as it loads: ``quant`` (``quantize_kwargs``) where given, its
    unset double quantization (None) that of ``base`` where it is a published bitsandbytes 4-bit
    checkpoint, else True; without ``quant``, such a checkpoint's own (it loads 4-bit without the
    options: NF4, its double quantization, the default compute dtype), else none (a
    full-precision base)."""
    from lora_core.formats.bnb4bit import quantization_config

    qc = None if base is None else quantization_config(base)
    saved = None if qc is None else bool(qc.get("bnb_4bit_use_double_quant", False))
    if quant:
        out = dict(quant)
        if out.get("double_quant", True) is None:
            out["double_quant"] = True if saved is None else saved
        return out
    if qc is None:
        return {}
    return {"quantize": "nf4", "double_quant": saved, "compute_dtype": "float32"}


def base_note(note: str, base, quant: dict) -> str:
    """``note`` of the base weights plus the 4-bit settings it loads with (``quantize=nf4
    double_quant=True compute_dtype=float32``; ``base``: its folder, which may be a bitsandbytes
    4-bit checkpoint; ``quant``: ``quantize_kwargs``; see ``loaded_quant``): a resume with other
    settings differs in the run's ``base`` and is refused, and an evaluation on another base warns
    (``base_mismatch``)."""
    extra = " ".join(f"{k}={v}" for k, v in loaded_quant(base, quant).items())
    return f"{note} {extra}" if extra else note


def with_quantize_note(note: str, args: argparse.Namespace, base=None) -> str:
    """:func:`base_note` with the command's quantization options."""
    return base_note(note, base, quantize_kwargs(args))


_QUANT_KEYS = ("quantize", "double_quant", "compute_dtype")


def base_mismatch(adapter: Path | None, quant: dict) -> str | None:
    """A warning where ``adapter`` was trained (by our train commands) on a base loaded other than
    as ``quant`` asks (``quantize_kwargs``: a QLoRA adapter on a float32 base, a LoRA one on a 4-bit
    base, other 4-bit settings), read off the base note in its ``adapter_config.json``
    (``with_quantize_note``); None where they agree or the adapter records nothing of ours."""
    if adapter is None or not (Path(adapter) / "adapter_config.json").is_file():
        return None
    try:
        d = json.loads((Path(adapter) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader names a damaged file
    note = d.get("base") or d.get("base_model_name_or_path") if isinstance(d, dict) else None
    if not isinstance(note, str):
        return None
    trained = [t for t in note.split() if t.partition("=")[0] in _QUANT_KEYS]
    if not trained and "lora_core_format" not in d:
        return None  # another tool's adapter: its base's precision is not recorded
    asked = [f"{k}={v}" for k, v in quant.items()]
    if trained == asked:
        return None
    return (f"warning: {adapter} was trained on {_base_kind(trained)}; it is loaded on {_base_kind(asked)} here, so "
            f"its results differ from the training run's (give the quantization options it was trained with)")


def _base_kind(fields: list[str]) -> str:
    return f"a 4-bit base ({' '.join(fields)})" if fields else "a full-precision base"


def resolve_base_adapter(base: Path, adapter: Path | None, quant: dict, warn: bool = True) -> tuple[Path, Path | None]:
    """The checkpoint folders the evaluate, generate and beam commands load: a run folder (or its
    ``latest`` file) means its latest checkpoint (a full fine-tuning run's is a base); where the
    adapter was trained on another base than ``quant`` loads, :func:`base_mismatch`'s warning goes
    to stderr (``warn``: False on all but one process of a job)."""
    base, adapter = checkpoint_of(base), None if adapter is None else checkpoint_of(adapter)
    warning = base_mismatch(adapter, loaded_quant(base, quant))
    if warning and warn:
        print(warning, file=sys.stderr)
    return base, adapter


__all__ = ["COMPUTE_DTYPES", "add_quantize_options", "add_run_options", "apply_run_options", "check_quantize",
           "quantize_kwargs", "loaded_quant", "base_note", "with_quantize_note", "base_mismatch", "doc_summary", "output_file", "positive",
           "resolve_base_adapter"]
