"""The files of a training run folder (``OUT``), shared by the trainer and the tools that
read runs: ``train_config.json``, ``log.jsonl``, ``ckpt-{step}/`` and ``latest``.

A checkpoint ``OUT/ckpt-{step}/`` holds the adapter, the optimizer moments
(``trainer_state.safetensors``) and ``trainer_state.json`` (position, schedule, RNG recipe).
It is written in a hidden temp folder renamed into place, then the ``OUT/latest`` pointer is
replaced atomically; temp leftovers of a killed run are ignored and removed. A checkpoint
damaged later (a cut copy, a full disk) is never skipped silently: ``resume_point`` reports
it with the newest earlier checkpoint that reads completely, to be resumed from explicitly.

The adapter's files are the task's business (``lora_core.train.tasks``): the functions here
take an ``adapter`` object with ``FILES`` (the names it writes), ``shapes()`` (name -> shape of every trained tensor),
``write(folder, tensors)`` and ``read(folder) -> tensors`` (strict: a mismatch with the model
raises ``ValueError``, a damaged file ``CheckpointError``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..formats.checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CheckpointError,
    atomic_write,
    check_tensors,
    read_json,
    read_tensors,
    umask_mode,
    write_json_atomic,
    write_safetensors_atomic,
)
from .precision import DynamicLossScale

__all__ = [
    "LOG_FILE",
    "CONFIG_FILE",
    "LATEST_FILE",
    "check_out_dir",
    "find_checkpoint",
    "resume_point",
    "read_log",
    "write_checkpoint",
    "read_checkpoint",
    "checkpoint_of",
    "remove_temp_files",
    "open_run_dir",
    "truncate_log",
]

LOG_FILE, CONFIG_FILE, LATEST_FILE = "log.jsonl", "train_config.json", "latest"
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"
FORMAT_VERSION = 1
STATE_FIELDS = ("step", "epoch", "batch_in_epoch", "examples_seen", "tokens_seen")
# ... and the fields written since, each with the value a checkpoint without it resumes with: the
# loss sum and update count since the last "train" log record (its avg_loss, exact across a resume)
STATE_SINCE = {"window_loss": 0.0, "window_steps": 0}


def fingerprint(pairs) -> str:
    h = hashlib.sha256()
    for c, t in pairs:
        h.update(np.asarray([len(c), len(t), *c, *t], dtype=np.int64).tobytes())
    return h.hexdigest()


def config_diff(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """Differences between two nested dicts, one ``key: saved X, now Y`` line each."""
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: saved {a!r}, now {b!r}")
    return out


def _step(path: Path) -> int | None:
    """N of a ``ckpt-N`` folder name, else None."""
    return int(path.name[5:]) if path.name.startswith("ckpt-") and path.name[5:].isdigit() else None


def _named_checkpoint(out_dir: Path) -> Path | None:
    """The folder ``OUT/latest`` names (not checked), else the highest ``ckpt-N`` folder."""
    latest = out_dir / LATEST_FILE
    if latest.is_file():
        name = latest.read_bytes().decode("utf-8", errors="replace").strip()
        if _step(Path(name)) is None or "/" in name:
            raise CheckpointError(f"{latest}: damaged pointer file (holds {name[:40]!r}, not a ckpt-N name)")
        return out_dir / name
    done = [p for p in out_dir.glob("ckpt-*") if _step(p) is not None and p.is_dir()]
    return max(done, key=_step) if done else None


def find_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``OUT/latest`` names; without that file, the highest ``ckpt-N`` (every
    such folder is complete: it appears by rename). Hidden temp folders are ignored.

    Raises:
        FileNotFoundError: the folder found is not a complete checkpoint (no trainer state).
        CheckpointError: ``OUT/latest`` does not hold a checkpoint name.
    """
    path = _named_checkpoint(Path(out_dir))
    if path is not None and not (path / STATE_JSON).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {STATE_JSON})")
    return path


def checkpoint_of(path: str | os.PathLike) -> Path:
    """The checkpoint folder a user means by ``path``: a run folder of the train commands (its
    ``latest`` checkpoint, :func:`find_checkpoint`), that ``latest`` file itself, or ``path`` as
    it is (a checkpoint or model folder)."""
    p = Path(path)
    if p.name == LATEST_FILE and p.is_file():
        p = p.parent
    if (p / LATEST_FILE).is_file():
        found = find_checkpoint(p)
        if found is None:
            raise FileNotFoundError(f"{p}: a run folder without a checkpoint")
        return found
    return p


def resume_point(
    out_dir: str | os.PathLike, adapter, resume_from: str | os.PathLike | None = None
) -> tuple[Path, tuple] | None:
    """Where a resumed run continues: ``(path, read_checkpoint(path, ...))`` for the checkpoint
    ``OUT/latest`` names (without it, the highest ``ckpt-N``), read completely; None when the
    run saved none.

    Args:
        resume_from: a ``ckpt-N`` folder of ``out_dir`` to continue from instead (the user's
            choice after a damaged latest one); ``OUT/latest`` is pointed at it.

    Raises:
        CheckpointError: that checkpoint is damaged (a file cut short, garbled or missing).
            The message names the file and the damage, and the newest earlier checkpoint
            that reads completely, with the option to resume from it (``--resume-from``);
            it is never picked silently.
    """
    out_dir, path = Path(out_dir), None
    if resume_from is not None:
        path = Path(resume_from)
        if _step(path) is None or not path.is_dir() or path.resolve().parent != out_dir.resolve():
            raise ValueError(f"--resume-from {path}: not a ckpt-N folder of the run {out_dir}")
        found = path, read_checkpoint(path, adapter)
        point_latest(out_dir, path)
        return found
    try:
        path = _named_checkpoint(out_dir)
        if path is None:
            return None
        if not path.is_dir():
            raise CheckpointError(f"{out_dir / LATEST_FILE} names {path.name}, which does not exist")
        return path, read_checkpoint(path, adapter)
    except CheckpointError as e:
        raise CheckpointError(_damage_report(out_dir, path, e, adapter)) from e


def _damage_report(out_dir: Path, bad: Path | None, err: Exception, adapter) -> str:
    """The error of a damaged latest checkpoint, naming the newest earlier one that reads completely."""
    limit = _step(bad) if bad is not None and _step(bad) is not None else float("inf")
    earlier = [p for p in out_dir.glob("ckpt-*") if p.is_dir() and _step(p) is not None and _step(p) < limit]
    head = f"cannot resume: the latest checkpoint is damaged: {err}"
    for p in sorted(earlier, key=_step, reverse=True):
        try:
            read_checkpoint(p, adapter)
        except (ValueError, OSError):  # CheckpointError is a ValueError
            continue
        return (
            f"{head}\nThe newest intact checkpoint is {p} (step {_step(p)}): resume from it explicitly "
            f"with --resume-from {p} (train(..., resume_from=...)); the updates after it are redone."
        )
    return f"{head}\nNo earlier checkpoint in {out_dir} reads completely: start the run again in a new folder."


def point_latest(out_dir: Path, path: Path) -> None:
    """Replace ``OUT/latest`` atomically by the name of the checkpoint ``path``."""
    atomic_write(out_dir / LATEST_FILE, lambda p: Path(p).write_text(path.name + "\n", encoding="utf-8"))


def read_log(path: str | os.PathLike) -> list[dict]:
    """Records of a ``log.jsonl``; a torn last line (a killed writer) is skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}, line {i + 1}: not JSON") from None
    return out


def remove_temp_files(out_dir: Path) -> None:
    """Delete the hidden temp files and folders a killed save left behind."""
    for junk in [*out_dir.glob(".ckpt-*.tmp"), *out_dir.glob(f".{LATEST_FILE}.*.tmp")]:
        shutil.rmtree(junk) if junk.is_dir() else junk.unlink()


def write_checkpoint(
    out_dir: Path, step: int, adapter, tensors: dict, optimizer_state: dict, meta: dict
) -> Path:
    """Write ``out_dir/ckpt-{step}`` atomically and point ``latest`` at it.

    ``adapter.write(folder, tensors)`` writes the adapter; ``meta`` goes into
    ``trainer_state.json`` (with the format version and the time)."""
    name = f"ckpt-{step}"
    final = out_dir / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir))
    os.chmod(tmp, umask_mode(folder=True))  # mkdtemp's 0700: the umask's mode, as mkdir gives
    adapter.write(tmp, tensors)
    write_safetensors_atomic(tmp / STATE_TENSORS, optimizer_state)
    write_json_atomic(tmp / STATE_JSON, {"format": FORMAT_VERSION, **meta, "time": time.time()})
    if final.exists():  # a save of this step from a run killed before it updated `latest`
        trash = Path(tempfile.mkdtemp(prefix=f".{name}.old.", suffix=".tmp", dir=out_dir))
        os.replace(final, trash / name)
        shutil.rmtree(trash)
    os.replace(tmp, final)
    point_latest(out_dir, final)
    return final


def read_checkpoint(path, adapter) -> tuple[dict, dict, dict]:
    """Adapter tensors, optimizer state and ``trainer_state.json`` of a checkpoint folder, every
    file read completely and checked; strict: ``adapter.read`` refuses an adapter of another
    model or LoRA config.

    Raises:
        CheckpointError: a file is missing, cut short, garbled or holds the wrong tensors.
        ValueError: the checkpoint belongs to another model or LoRA config.
    """
    path = Path(path)
    files = getattr(adapter, "FILES", (ADAPTER_CONFIG, ADAPTER_WEIGHTS))  # full fine-tuning: the whole model
    missing = [n for n in (*files, STATE_TENSORS, STATE_JSON) if not (path / n).is_file()]
    if missing:
        raise CheckpointError(f"{path}: incomplete checkpoint, missing {missing}")
    tensors = adapter.read(path)
    opt = read_tensors(path / STATE_TENSORS)
    expected = {f"{k}.{n}": shape for n, shape in adapter.shapes().items() for k in ("m", "v")}
    scalars = ["t", *(DynamicLossScale.KEYS if any(k in opt for k in DynamicLossScale.KEYS) else ())]  # fp16 runs
    check_tensors(path / STATE_TENSORS, opt, {**expected, **{k: (1,) for k in scalars}})  # scalars are saved 1-d
    for k in scalars:
        opt[k] = opt[k].reshape(())
    meta = read_json(path / STATE_JSON)
    bad = [k for k in STATE_FIELDS if type(meta.get(k)) is not int]
    if bad:
        raise CheckpointError(f"{path / STATE_JSON}: not a trainer state (no integer {bad})")
    odd = [k for k, v in STATE_SINCE.items() if k in meta and type(meta[k]) not in (type(v), int)]
    if odd:
        raise CheckpointError(f"{path / STATE_JSON}: not a trainer state ({odd} of the wrong type)")
    return tensors, opt, {**STATE_SINCE, **meta}


def _with_defaults(saved: dict, run: dict | None = None) -> dict:
    """A saved run config with the keys added since it was written at their defaults (a run
    folder of an older version resumes: it trained an LM, in fp32, ...); what it did not record
    and has no default (its validation set, recorded since 2026-11-28) taken as ``run``'s."""
    from .recipes import TrainConfig

    saved = dict(saved, task=saved.get("task", "lm"))
    if run is not None and "valid_data" not in saved and "valid_data" in run:
        saved["valid_data"] = run["valid_data"]
    if run is not None and isinstance(saved.get("model"), dict) and isinstance(run.get("model"), dict):
        # model config fields added since (LlamaConfig.layer_types, DistilBertConfig.label_names)
        saved["model"] = {**{k: v for k, v in run["model"].items() if k not in saved["model"]}, **saved["model"]}
    if isinstance(saved.get("train"), dict):
        merged = {**TrainConfig().to_dict(), **saved["train"]}
        saved["train"] = {k: v for k, v in merged.items() if k != "zero"}  # the ZeRO stage may change on resume
    return saved


def check_out_dir(out_dir: str | os.PathLike, resume: bool = False, option: str | None = "--out-dir") -> Path:
    """Refuse a run folder that cannot take this run, before any work: ``out_dir`` or one of
    its parents is a file, or (a new run, not ``resume``) it holds a previous run. Reads only.

    Args:
        out_dir: the run folder (it need not exist yet).
        resume: the run continues the one in ``out_dir``.
        option: the command-line option named in the message (None: the path alone).

    Raises:
        ValueError: a file stands where a folder must be (the message names it).
        FileExistsError: a new run in a folder holding a previous run.
    """
    out = Path(out_dir)
    where = f"{option} {out}" if option else str(out)
    for p in (out, *out.parents):
        if p.exists():  # False below a file (ENOTDIR): the loop reaches that file
            if not p.is_dir():
                raise ValueError(f"{where}: {'a file' if p == out else f'{p} is a file'}, not a folder")
            break
    if out.is_dir() and (out / LATEST_FILE).exists() and not (out / LATEST_FILE).is_file():
        raise ValueError(f"{where}: {out / LATEST_FILE} is not a file: the run's pointer to its latest checkpoint "
                         "is written there (remove it, or choose a new folder)")
    if not resume and out.is_dir():
        if (out / CONFIG_FILE).exists() or (out / LOG_FILE).exists() or _named_checkpoint(out) is not None:
            raise FileExistsError(f"{where} holds a previous run: resume it (--resume) or choose a new folder")
    return out


def open_run_dir(out: Path, run: dict, resume: bool, adapter, resume_from=None):
    """Make ``out`` ready for a run described by ``run`` (the run configuration): a new run
    needs a folder without a previous run; a resume needs the saved configuration to match
    (keys that older versions did not write count at their defaults). Removes temp leftovers,
    writes ``train_config.json``, and returns what to resume from (``resume_point``'s
    ``(path, (tensors, optimizer state, meta))``) or None."""
    check_out_dir(out, resume, option=None)
    out.mkdir(parents=True, exist_ok=True)
    old = out / CONFIG_FILE
    remove_temp_files(out)  # leftovers of a killed save
    if resume and old.is_file():
        diff = config_diff(_with_defaults(read_json(old), run), run)  # read_json: a damaged file named
        if diff:
            if any(d.startswith(("train.batch_size", "train.grad_accum")) for d in diff):
                diff.append(
                    "(batch_size is the global batch of all processes: a resume on another number "
                    "of processes must keep batch_size and grad_accum)"
                )
            raise ValueError(f"{out}: cannot resume, the run differs from the saved one:\n  " + "\n  ".join(diff))
    write_json_atomic(old, run)
    return resume_point(out, adapter, resume_from) if resume else None


def truncate_log(out: Path, step: int) -> None:
    """Drop the log lines past ``step`` (a resumed run writes them again)."""
    log = out / LOG_FILE
    keep = [r for r in read_log(log) if r.get("step", 0) <= step] if log.is_file() else []
    atomic_write(log, lambda tmp: Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in keep)))
