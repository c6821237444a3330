"""Reading tensor and JSON files of checkpoints, with a diagnosis when a file is damaged.

A checkpoint cut short (an interrupted copy, a full disk) or replaced by something else
raises :class:`CheckpointError` naming the file and what is wrong with it, instead of the
parsing library's bare message. ``.safetensors`` files are parsed by the ``safetensors``
library; only when it fails are the 8-byte header length, the JSON header and the tensors'
``data_offsets`` read here to say whether the file is truncated or not a safetensors file
(format: https://github.com/huggingface/safetensors#format). ``torch.save`` files are read
by :mod:`lora_core.formats.torch_pickle`, which diagnoses its own formats.

A loader that converts one tensor at a time (the 4-bit loader quantizes each weight and drops
it) asks for ``lazy`` tensors: a :class:`LazyTensor` is read from its file, and a bfloat16 one
widened to float32, only when it is converted (``np.asarray``), so the float32 model of a
bfloat16 ``.safetensors`` file or a ``pytorch_model.bin`` is never in memory at once.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

__all__ = ["CheckpointError", "LazyTensor", "bf16_to_f32", "read_tensors", "read_safetensors", "diagnose_safetensors",
           "read_json"]

_MAX_HEADER = 100_000_000  # the safetensors library refuses longer headers


class CheckpointError(ValueError):
    """A checkpoint file is damaged or does not fit the model: names the file and the problem."""


class LazyTensor:
    """A checkpoint tensor read from its file only when it is converted (``np.asarray``, which
    returns a new float32 array for bfloat16, else the file's values, possibly a memory map);
    ``shape``, ``dtype`` (what the conversion gives), ``ndim``, ``size``, ``nbytes`` and ``T``
    as an array's. Nothing is kept: each conversion reads again.

    Args:
        shape: the tensor's shape.
        dtype: the dtype ``read`` returns.
        read: ``read() -> np.ndarray`` of ``shape`` (raises ``CheckpointError`` naming the file
            when the bytes turn out damaged).
    """

    __slots__ = ("shape", "dtype", "_read", "_transposed")

    def __init__(self, shape: tuple[int, ...], dtype, read, transposed: bool = False):
        self.shape, self.dtype, self._read, self._transposed = tuple(shape), np.dtype(dtype), read, transposed

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def T(self) -> LazyTensor:  # noqa: N802 (numpy's name)
        return LazyTensor(self.shape[::-1], self.dtype, self._read, not self._transposed)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        arr = self._read()
        arr = arr.T if self._transposed else arr
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape}, dtype={self.dtype})"


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (``uint16``, any shape) widened to float32 (a new array), exactly:
    a bfloat16 value is the top half of a float32 one."""
    out = raw.astype(np.uint32)
    out <<= 16
    return out.view(np.float32)


def read_tensors(path: str | os.PathLike, mmap: bool = False, lazy: bool = False) -> dict[str, np.ndarray]:
    """Tensors of a ``.safetensors`` or ``torch.save`` file as numpy arrays (no torch needed).
    ``mmap``: memory-map a ``.safetensors`` file (for frozen base weights; see ``read_safetensors``).
    ``lazy``: for a consumer that converts one tensor at a time: memory maps, and a
    :class:`LazyTensor` for each tensor that needs reading or widening (bfloat16, and every tensor
    of a ``torch.save`` file: ``torch_pickle.load_torch_file(lazy=True)``).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is truncated or not a file of its format.
    """
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if path.endswith(".safetensors"):
        return read_safetensors(path, mmap or lazy, lazy)
    from .torch_pickle import load_torch_file

    return load_torch_file(path, lazy=lazy)


_MMAP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
                "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
                "BOOL": np.bool_}  # fmt: skip


def read_safetensors(path: str | os.PathLike, mmap: bool = False, lazy: bool = False) -> dict[str, np.ndarray]:
    """The tensors of a ``.safetensors`` file; errors re-raised with the path and a diagnosis.

    ``mmap``: the arrays are copy-on-write memory maps of the file (the library checks the
    header first), so processes that load the same frozen base share its pages in the page
    cache instead of each reading a private copy. BF16 tensors (numpy has no bfloat16) are
    widened to float32 copies, exactly (a bf16 value is the top half of an fp32 one); with ``lazy``
    they are :class:`LazyTensor` s widened when converted, one at a time. Only for files nobody
    rewrites in place while the arrays are in use (a base checkpoint): the maps follow the file."""
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    try:
        with safe_open(str(path), framework="numpy") as f:  # validates the header and offsets
            f.keys()
        dtypes = {k: v["dtype"] for k, v in _header(path)[1].items()}
        other = {k: d for k, d in dtypes.items() if d not in _MMAP_DTYPES and d != "BF16"}
        if other:
            name = sorted(other)[0]
            raise CheckpointError(f"{path}: tensor {name} has dtype {other[name]}, which is not read here "
                                  f"({len(other)} such tensors); the dtypes read: BF16, {', '.join(_MMAP_DTYPES)}")  # fmt: skip
        if mmap or lazy:
            return _memory_maps(path, lazy)
        if "BF16" in dtypes.values():  # numpy has no bfloat16: widened
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


def _memory_maps(path, lazy: bool = False) -> dict[str, np.ndarray]:
    """One copy-on-write map per tensor (a tensor's pages leave the process when it is dropped,
    as the 4-bit loader drops each weight once quantized), or, where the open-file limit cannot
    take one more file descriptor per tensor (each map holds one), one map of the whole data
    section that every tensor views (``_room_for_maps``)."""
    n, header = _header(path)
    whole = None
    if not _room_for_maps(sum(v["data_offsets"][1] > v["data_offsets"][0] for v in header.values())):
        size = max((v["data_offsets"][1] for v in header.values()), default=0)
        whole = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n, shape=(size,)) if size else None
    out = {}
    for name, v in header.items():
        start, end = v["data_offsets"]
        bf16 = v["dtype"] == "BF16"
        dtype, shape = np.dtype(np.uint16 if bf16 else _MMAP_DTYPES[v["dtype"]]).newbyteorder("<"), tuple(v["shape"])
        if end == start:
            out[name] = np.zeros(shape, np.float32 if bf16 else dtype)
            continue
        if whole is not None:
            m = whole[start:end].view(dtype)
        else:
            m = np.memmap(path, dtype=dtype, mode="c", offset=8 + n + start, shape=(int(np.prod(shape)),))
        arr = m.view(np.ndarray).reshape(shape)  # a plain array over the map (kept alive)
        if bf16:
            arr = LazyTensor(shape, np.float32, functools.partial(bf16_to_f32, arr)) if lazy else bf16_to_f32(arr)
        out[name] = arr
    return out


# file descriptors kept free for everything else (sockets, logs, the next shard's own reads)
_FD_SPARE = 256


def _room_for_maps(count: int) -> bool:
    """Whether ``count`` more memory maps (one file descriptor each: Python's ``mmap`` keeps a
    duplicate) fit under the open-file limit, raising the soft limit up to the hard one where
    they would not (a bitsandbytes 4-bit Llama-2-7B holds 6 tensors a weight, ~1400 in all,
    over the usual soft limit of 1024)."""
    try:
        import resource

        open_now = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError):  # no /proc (not Linux): assume room, as before
        return True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = open_now + count + _FD_SPARE
    if soft == resource.RLIM_INFINITY or need <= soft:
        return True
    if hard != resource.RLIM_INFINITY and need > hard:
        return False
    target = 2 * need if hard == resource.RLIM_INFINITY else min(2 * need, hard)  # room for the next shards too
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return False
    return True


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
