"""The files of a training run folder (``OUT``), shared by the trainer and the tools that
read runs: ``train_config.json``, ``log.jsonl``, ``ckpt-{step}/`` and ``latest``.

A checkpoint ``OUT/ckpt-{step}/`` holds the adapter (``save_adapter``), the optimizer moments
(``trainer_state.safetensors``) and ``trainer_state.json`` (position, schedule, RNG recipe).
It is written in a hidden temp folder renamed into place, then the ``OUT/latest`` pointer is
replaced atomically; temp leftovers of a killed run are ignored and removed.
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

from .checkpoint import (
    atomic_write,
    load_adapter,
    read_tensors,
    save_adapter,
    write_json_atomic,
    write_safetensors_atomic,
)

__all__ = [
    "LOG_FILE",
    "CONFIG_FILE",
    "LATEST_FILE",
    "find_checkpoint",
    "read_log",
    "write_checkpoint",
    "read_checkpoint",
    "remove_temp_files",
]

LOG_FILE, CONFIG_FILE, LATEST_FILE = "log.jsonl", "train_config.json", "latest"
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"
FORMAT_VERSION = 1


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


def find_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``OUT/latest`` names; without that file, the highest ``ckpt-N`` (every
    such folder is complete: it appears by rename). Hidden temp folders are ignored."""
    out_dir = Path(out_dir)
    latest = out_dir / LATEST_FILE
    if latest.is_file():
        path = out_dir / latest.read_text(encoding="utf-8").strip()
        if not (path / STATE_JSON).is_file():
            raise FileNotFoundError(f"{latest} names {path.name}, which is not a complete checkpoint")
        return path
    done = [p for p in out_dir.glob("ckpt-*") if p.name[5:].isdigit() and (p / STATE_JSON).is_file()]
    return max(done, key=lambda p: int(p.name[5:])) if done else None


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


def write_checkpoint(out_dir: Path, step: int, adapter: tuple, optimizer_state: dict, meta: dict) -> Path:
    """Write ``out_dir/ckpt-{step}`` atomically and point ``latest`` at it.

    ``adapter`` is ``(model_config, lora_config, tensors, base_note)`` for ``save_adapter``;
    ``meta`` goes into ``trainer_state.json`` (with the format version and the time)."""
    name = f"ckpt-{step}"
    final = out_dir / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir))
    model_cfg, lora_cfg, tensors, base = adapter
    save_adapter(tmp, model_cfg, lora_cfg, tensors, base=base)
    write_safetensors_atomic(tmp / STATE_TENSORS, optimizer_state)
    write_json_atomic(tmp / STATE_JSON, {"format": FORMAT_VERSION, **meta, "time": time.time()})
    if final.exists():  # a save of this step from a run killed before it updated `latest`
        trash = Path(tempfile.mkdtemp(prefix=f".{name}.old.", suffix=".tmp", dir=out_dir))
        os.replace(final, trash / name)
        shutil.rmtree(trash)
    os.replace(tmp, final)
    atomic_write(out_dir / LATEST_FILE, lambda p: Path(p).write_text(name + "\n", encoding="utf-8"))
    return final


def read_checkpoint(path, model_config, lora_config) -> tuple[dict, dict, dict]:
    """Adapter tensors, optimizer state and ``trainer_state.json`` of a checkpoint folder;
    strict: the adapter must have been trained with ``lora_config`` on ``model_config``."""
    path = Path(path)
    lora, cfg, tensors, _ = load_adapter(path)
    if lora != lora_config or cfg != model_config:
        raise ValueError(
            f"{path}: adapter was trained with {lora} on {cfg}, the model has {lora_config} on {model_config}"
        )
    opt = read_tensors(path / STATE_TENSORS)
    if "t" in opt:
        opt["t"] = opt["t"].reshape(())  # stored (1,): safetensors writers make scalars 1-d
    return tensors, opt, json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
