"""Read PyTorch ``.bin``/``.pt`` state dicts into numpy without importing torch.

Both formats of ``torch.save``: the zip archive (torch >= 1.6, ``archive/data.pkl`` plus
one file per storage) and the legacy stream (magic number, protocol, sys info, the
pickle, the storage keys, then each storage as an int64 element count and raw bytes;
the HF ``gpt2`` ``pytorch_model.bin`` files of 2019 are legacy). Only the classes a
state dict needs are resolved; anything else is refused (no arbitrary code runs).
Follows ``torch/serialization.py`` (``_load``, ``_legacy_load``) and
``torch/_utils.py`` (``_rebuild_tensor_v2``).
"""

from __future__ import annotations

import collections
import pickle
import zipfile

import numpy as np

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
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


class _Deferred:
    """A tensor of the legacy format, built once its storage bytes (after the pickle) are read."""

    def __init__(self, args):
        self.args = args


def _load_zip(path: str) -> dict:
    with zipfile.ZipFile(path) as zf:
        pkl = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        root = pkl[: -len("data.pkl")]
        cache = {}

        def load_storage(pid):
            _, stype, key, _location, _numel = pid
            if key not in cache:
                st = _Storage(_DTYPES[stype], key)
                st.array = _as_array(zf.read(f"{root}data/{key}"), st.dtype)
                cache[key] = st
            return cache[key]

        with zf.open(pkl) as f:
            return _Unpickler(f, load_storage).load()


def _load_legacy(path: str) -> dict:
    with open(path, "rb") as f:
        if pickle.load(f) != _LEGACY_MAGIC:
            raise ValueError(f"{path}: not a PyTorch checkpoint (bad magic number)")
        pickle.load(f)  # protocol version
        pickle.load(f)  # sys info
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
        keys = pickle.load(f)
        for key in keys:
            st = storages[key]
            n = int(np.frombuffer(f.read(8), dtype="<i8")[0])
            itemsize = 2 if st.dtype == "bfloat16" else np.dtype(st.dtype).itemsize
            st.array = _as_array(f.read(n * itemsize), st.dtype)
        for vs, base, off, size in views:
            vs.array = base.array[off:off + size]
    return _resolve(obj)


def _resolve(obj):
    if isinstance(obj, _Deferred):
        return _rebuild_tensor(*obj.args)
    if isinstance(obj, dict):
        return type(obj)((k, _resolve(v)) for k, v in obj.items())
    return obj


def load_torch_file(path: str) -> dict[str, np.ndarray]:
    """A state dict saved by ``torch.save`` as ``{name: np.ndarray}`` (torch not needed)."""
    state = _load_zip(path) if zipfile.is_zipfile(path) else _load_legacy(path)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if "model_state_dict" in state and isinstance(state["model_state_dict"], dict):
        state = state["model_state_dict"]
    bad = [k for k, v in state.items() if not isinstance(v, np.ndarray)]
    if bad:
        raise ValueError(f"{path}: entries that are not tensors: {bad[:5]}")
    return dict(state)
