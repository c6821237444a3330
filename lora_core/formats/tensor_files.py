"""Reading tensor and JSON files of checkpoints, with a diagnosis when a file is damaged.

A checkpoint cut short (an interrupted copy, a full disk) or replaced by something else
raises :class:`CheckpointError` naming the file and what is wrong with it, instead of the
parsing library's bare message. ``.safetensors`` files are parsed by the ``safetensors``
library; only when it fails are the 8-byte header length, the JSON header and the tensors'
``data_offsets`` read here to say whether the file is truncated or not a safetensors file
(format: https://github.com/huggingface/safetensors#format). ``torch.save`` files are read
by :mod:`lora_core.formats.torch_pickle`, which diagnoses its own formats.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["CheckpointError", "read_tensors", "read_safetensors", "diagnose_safetensors", "read_json"]

_MAX_HEADER = 100_000_000  # the safetensors library refuses longer headers


class CheckpointError(ValueError):
    """A checkpoint file is damaged or does not fit the model: names the file and the problem."""


def read_tensors(path: str | os.PathLike, mmap: bool = False) -> dict[str, np.ndarray]:
    """Tensors of a ``.safetensors`` or ``torch.save`` file as numpy arrays (no torch needed).
    ``mmap``: memory-map a ``.safetensors`` file (for frozen base weights; see ``read_safetensors``).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is truncated or not a file of its format.
    """
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if path.endswith(".safetensors"):
        return read_safetensors(path, mmap)
    from .torch_pickle import load_torch_file

    return load_torch_file(path)


_MMAP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def read_safetensors(path: str | os.PathLike, mmap: bool = False) -> dict[str, np.ndarray]:
    """The tensors of a ``.safetensors`` file; errors re-raised with the path and a diagnosis.

    ``mmap``: the arrays are copy-on-write memory maps of the file (the library checks the
    header first), so processes that load the same frozen base share its pages in the page
    cache instead of each reading a private copy. BF16 tensors (numpy has no bfloat16) are
    widened to float32 copies, exactly (a bf16 value is the top half of an fp32 one). Only for files nobody rewrites in place
    while the arrays are in use (a base checkpoint): the maps follow the file."""
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    try:
        if mmap:
            with safe_open(str(path), framework="numpy") as f:  # validates the header and offsets
                f.keys()
            maps = _memory_maps(path)
            if maps is not None:
                return maps
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
        if _has_bf16(path):
            return {k: np.array(v) for k, v in _memory_maps(path).items()}
        return load_file(str(path))
    except SafetensorError as e:
        why = diagnose_safetensors(path) or f"unreadable safetensors file ({e})"
        raise CheckpointError(f"{path}: {why}") from e


def _header(path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return n, header


def _has_bf16(path) -> bool:
    return any(v["dtype"] == "BF16" for v in _header(path)[1].values())


def _memory_maps(path) -> dict[str, np.ndarray] | None:
    n, header = _header(path)
    if any(v["dtype"] not in _MMAP_DTYPES and v["dtype"] != "BF16" for v in header.values()):
        return None
    out = {}
    for name, v in header.items():
        start, end = v["data_offsets"]
        bf16 = v["dtype"] == "BF16"
        dtype, shape = np.dtype(np.uint16 if bf16 else _MMAP_DTYPES[v["dtype"]]).newbyteorder("<"), tuple(v["shape"])
        if end == start:
            out[name] = np.zeros(shape, np.float32 if bf16 else dtype)
            continue
        m = np.memmap(path, dtype=dtype, mode="c", offset=8 + n + start, shape=(int(np.prod(shape)),))
        arr = m.view(np.ndarray).reshape(shape)  # a plain array over the map (kept alive)
        out[name] = (arr.astype(np.uint32) << 16).view(np.float32) if bf16 else arr
    return out


def diagnose_safetensors(path: str | os.PathLike) -> str | None:
    """What is wrong with a safetensors file's framing (None: nothing found at this level)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated safetensors file ({size} bytes, less than its 8-byte header length)"
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or f.read(1) not in (b"{", b""):
            return f"not a safetensors file (its first 8 bytes give a header length of {n} bytes)"
        if 8 + n > size:
            return f"truncated safetensors file (header says {n} bytes of header, file has {size - 8} after the length)"
        f.seek(8)
        raw = f.read(n)
    try:
        header = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return f"not a safetensors file (the header is not safetensors JSON: {e})"
    need, have = max(ends, default=0), size - 8 - n
    if need > have:
        return f"truncated safetensors file (header says {need} bytes of data, file has {have})"
    if need < have:
        return f"not a file safetensors wrote ({have - need} bytes after the last tensor's data)"
    return None


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object from ``path``; a cut or garbled file raises :class:`CheckpointError`."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not a JSON file (not UTF-8 text at byte {e.start})") from None
    if not text.strip():
        raise CheckpointError(f"{path}: empty file (truncated?)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        cut = text.lstrip().startswith("{") and not text.rstrip().endswith("}")
        why = "truncated JSON file" if cut else "not JSON"
        raise CheckpointError(f"{path}: {why} (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj
