"""Read PyTorch ``.bin``/``.pt`` state dicts into numpy without importing torch.

Both formats of ``torch.save``: the zip archive (torch >= 1.6, ``archive/data.pkl`` plus
one file per storage) and the legacy stream (magic number, protocol, sys info, the
pickle, the storage keys, then each storage as an int64 element count and raw bytes;
the HF ``gpt2`` ``pytorch_model.bin`` files of 2019 are legacy). Only the classes a
state dict needs are resolved; anything else is refused (no arbitrary code runs).
Follows ``torch/serialization.py`` (``_load``, ``_legacy_load``) and
``torch/_utils.py`` (``_rebuild_tensor_v2``). A file cut short or of another format raises
``CheckpointError`` naming the file and the damage (truncated zip archive, legacy stream
ending early, neither format).
"""

from __future__ import annotations

import collections
import os
import pickle
import zipfile
import zlib

import numpy as np

from .tensor_files import CheckpointError

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PREFIX = pickle.dumps(_LEGACY_MAGIC, protocol=2)  # torch.save's first record
_ZIP_MAGIC = b"PK\x03\x04"
_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _Storage:
    def __init__(self, dtype, key):
        self.dtype, self.key, self.array = dtype, key, None


def _as_array(raw: bytes, dtype) -> np.ndarray:
    if dtype == "bfloat16":  # widen to float32: bf16 is the top half of an fp32
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))


def _rebuild_tensor(storage, offset, size, stride, *_args):
    arr = storage.array
    if arr is None:
        raise ValueError(f"storage {storage.key!r} has no data")
    itemsize = arr.dtype.itemsize
    end = offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1 if all(size) else offset
    if offset < 0 or end > len(arr):
        raise ValueError(f"tensor of size {tuple(size)} at offset {offset} lies outside its storage "
                         f"{storage.key!r} of {len(arr)} elements")
    if not size:
        return np.array(arr[offset], copy=True)
    view = np.lib.stride_tricks.as_strided(arr[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride))
    return np.array(view, copy=True)


def _rebuild_parameter(data, *_args):
    return data


class _Unpickler(pickle.Unpickler):
    """Resolves only what a tensor state dict needs; tensors are built by ``rebuild``."""

    def __init__(self, f, load_storage, rebuild=_rebuild_tensor):
        super().__init__(f)
        self._load_storage = load_storage
        self._classes = {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): rebuild,
            ("torch._utils", "_rebuild_tensor"): rebuild,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        }

    def find_class(self, module, name):
        if (module, name) in self._classes:
            return self._classes[(module, name)]
        if module == "torch" and name in _DTYPES:
            return name
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a tensor state dict")

    def persistent_load(self, pid):
        return self._load_storage(pid)


class _PlainUnpickler(pickle.Unpickler):
    """For the legacy header records (ints, a dict of ints, a list of keys): no classes at all."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} in a header record")


class _Deferred:
    """A tensor of the legacy format, built once its storage bytes (after the pickle) are read."""

    def __init__(self, args):
        self.args = args


def _load_zip(path: str) -> dict:
    try:
        with zipfile.ZipFile(path) as zf:
            pkls = [n for n in zf.namelist() if n.endswith("data.pkl")]
            if not pkls:
                raise CheckpointError(f"{path}: a zip archive without data.pkl: not a torch.save file")
            root = pkls[0][: -len("data.pkl")]
            cache = {}

            def load_storage(pid):
                _, stype, key, _location, _numel = pid
                if key not in cache:
                    st = _Storage(_DTYPES[stype], key)
                    st.array = _as_array(zf.read(f"{root}data/{key}"), st.dtype)
                    cache[key] = st
                return cache[key]

            with zf.open(pkls[0]) as f:
                return _Unpickler(f, load_storage).load()
    except (zipfile.BadZipFile, zlib.error, KeyError, EOFError, pickle.UnpicklingError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: damaged PyTorch zip archive ({type(e).__name__}: {e})") from e


def _load_legacy(path: str) -> dict:
    with open(path, "rb") as f:
        try:
            magic = _PlainUnpickler(f).load()
        except Exception as e:  # random bytes make pickle raise almost anything
            f.seek(0)
            head = f.read(len(_LEGACY_PREFIX))
            if len(head) < len(_LEGACY_PREFIX) and _LEGACY_PREFIX.startswith(head):
                raise CheckpointError(f"{path}: truncated legacy PyTorch file ({len(head)} bytes)") from e
            raise CheckpointError(f"{path}: not a PyTorch checkpoint (neither a zip archive nor a legacy "
                                  f"pickle: {type(e).__name__}: {e})") from e
        if magic != _LEGACY_MAGIC:
            raise CheckpointError(f"{path}: not a PyTorch checkpoint (neither a zip archive nor a legacy "
                                  f"torch.save file: its first pickle is not the magic number)")
        try:
            return _resolve(_load_legacy_body(f))
        except (EOFError, pickle.UnpicklingError, ValueError, KeyError, IndexError) as e:
            if isinstance(e, CheckpointError):
                raise
            cut = isinstance(e, EOFError) or "truncated" in str(e)
            why = "truncated legacy PyTorch file (it ends inside a pickle)" if cut else "damaged legacy PyTorch file"
            raise CheckpointError(f"{path}: {why} ({type(e).__name__}: {e})") from e


def _load_legacy_body(f):
    """Everything after the magic number: protocol, sys info, the pickle, storage keys, storages."""
    _PlainUnpickler(f).load()  # protocol version
    _PlainUnpickler(f).load()  # sys info
    storages, views = {}, []

    def load_storage(pid):
        _, stype, key, _location, _numel, view = pid
        if key not in storages:
            storages[key] = _Storage(_DTYPES[stype], key)
        if view is not None:  # (view_key, offset, size): a slice of the root storage
            vkey, off, size = view
            vs = _Storage(storages[key].dtype, vkey)
            views.append((vs, storages[key], off, size))
            return vs
        return storages[key]

    obj = _Unpickler(f, load_storage, rebuild=lambda *args: _Deferred(args)).load()
    for key in _PlainUnpickler(f).load():
        st = storages[key]
        n = int(np.frombuffer(_read_exact(f, 8, f"the element count of storage {key!r}"), dtype="<i8")[0])
        itemsize = 2 if st.dtype == "bfloat16" else np.dtype(st.dtype).itemsize
        st.array = _as_array(_read_exact(f, n * itemsize, f"storage {key!r}"), st.dtype)
    for vs, base, off, size in views:
        vs.array = base.array[off:off + size]
    return obj


def _read_exact(f, n: int, what: str) -> bytes:
    left = os.fstat(f.fileno()).st_size - f.tell()
    if n < 0:
        raise CheckpointError(f"{f.name}: damaged legacy PyTorch file ({what}: a negative size {n})")
    if n > left:  # checked before reading: a garbled size must not allocate terabytes
        raise CheckpointError(f"{f.name}: truncated legacy PyTorch file ({what} needs {n} bytes, "
                              f"the file has {left} left)")
    return f.read(n)


def _resolve(obj):
    if isinstance(obj, _Deferred):
        return _rebuild_tensor(*obj.args)
    if isinstance(obj, dict):
        return type(obj)((k, _resolve(v)) for k, v in obj.items())
    return obj


def load_torch_file(path: str) -> dict[str, np.ndarray]:
    """A state dict saved by ``torch.save`` as ``{name: np.ndarray}`` (torch not needed).

    Raises:
        CheckpointError: the file is cut short, damaged, not a ``torch.save`` file, or
            holds something other than a dict of tensors.
    """
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise CheckpointError(f"{path}: empty file (truncated to 0 bytes?)")
    is_zip = head == _ZIP_MAGIC
    if is_zip and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: truncated zip archive (no end-of-central-directory record; "
                              f"was the file cut short?)")
    state = _load_zip(path) if is_zip else _load_legacy(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict")
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if "model_state_dict" in state and isinstance(state["model_state_dict"], dict):
        state = state["model_state_dict"]
    bad = [k for k, v in state.items() if not isinstance(v, np.ndarray)]
    if bad:
        raise CheckpointError(f"{path}: entries that are not tensors: {bad[:5]}")
    return dict(state)
