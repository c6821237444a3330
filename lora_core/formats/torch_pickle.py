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

``lazy=True`` streams: each tensor is a ``LazyTensor`` that reads its bytes when converted.
A zip member is stored uncompressed by torch's writer (``ZipInfo.compress_type`` is checked)
and 64-byte aligned, so it is memory-mapped at its offset (its CRC-32 checked on the first
read, as ``zipfile`` checks it) and a tensor of it is a view of the map; a compressed or
misaligned member is read with ``zipfile``, a legacy file's storage from its offset.
"""

from __future__ import annotations

import collections
import functools
import os
import pickle
import zipfile
import zlib

import numpy as np

from .tensor_files import CheckpointError, LazyTensor, bf16_to_f32

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PREFIX = pickle.dumps(_LEGACY_MAGIC, protocol=2)  # torch.save's first record
_ZIP_MAGIC = b"PK\x03\x04"
_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _Storage:
    """A storage's elements in the file's dtype (``uint16`` for bfloat16): ``array`` (read), or,
    streamed, ``numel`` and ``read(start, stop)`` giving elements [start, stop) when needed
    (``mapped``: a view of a memory map, not a copy)."""

    def __init__(self, dtype, key):
        self.dtype, self.key, self.array, self.numel, self.read, self.mapped = dtype, key, None, None, None, False

    def set_array(self, array: np.ndarray) -> None:
        self.array, self.numel = array, len(array)


def _file_dtype(dtype) -> np.dtype:
    return np.dtype("<u2") if dtype == "bfloat16" else np.dtype(dtype).newbyteorder("<")


def _as_array(raw: bytes, dtype) -> np.ndarray:
    return np.frombuffer(raw, dtype=_file_dtype(dtype))


def _strided(arr: np.ndarray, offset: int, size, stride) -> np.ndarray:
    if not size:
        return arr[offset:offset + 1].reshape(())
    return np.lib.stride_tricks.as_strided(arr[offset:], shape=tuple(size),
                                           strides=tuple(s * arr.dtype.itemsize for s in stride))


def _values(view: np.ndarray, dtype, copy: bool = True) -> np.ndarray:
    """A tensor's values from a view of its storage: bfloat16 widened to float32 (a bf16 value
    is the top half of an fp32 one), others copied (``copy=False``: the view itself)."""
    if dtype == "bfloat16":
        return bf16_to_f32(view)
    return np.array(view, copy=True) if copy else view


def _read_tensor(storage, start: int, stop: int, size, stride) -> np.ndarray:
    raw = storage.read(start, stop)  # a map, or bytes read for this tensor (writable: its own)
    view = _strided(raw, 0, size, stride)
    return _values(view, storage.dtype, copy=not (storage.mapped or (raw.flags.writeable and view.flags.c_contiguous)))


def _rebuild_tensor(storage, offset, size, stride, *_args):
    n = storage.numel
    if n is None:
        raise ValueError(f"storage {storage.key!r} has no data")
    end = offset + sum((k - 1) * st for k, st in zip(size, stride)) + 1 if all(size) else offset
    if offset < 0 or end > n:
        raise ValueError(f"tensor of size {tuple(size)} at offset {offset} lies outside its storage "
                         f"{storage.key!r} of {n} elements")
    if storage.array is None:  # streamed: read when converted
        dtype = np.float32 if storage.dtype == "bfloat16" else _file_dtype(storage.dtype)
        return LazyTensor(tuple(size), dtype,
                          functools.partial(_read_tensor, storage, offset, max(end, offset), tuple(size), tuple(stride)))
    return _values(_strided(storage.array, offset, size, stride), storage.dtype)


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
        if module == "torch" and name.endswith("Storage"):
            raise UnsupportedTensor(f"a tensor of torch.{name} (dtype {name[: -len('Storage')] or 'untyped'}) is not "
                                    f"supported; the dtypes read: {', '.join(sorted(_DTYPES))}")  # fmt: skip
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            raise UnsupportedTensor("a tensor of a dtype torch saves without a typed storage (torch._utils."
                                    "_rebuild_tensor_v3: uint16/32/64, float8, ...) is not supported; the dtypes "
                                    f"read: {', '.join(sorted(_DTYPES))}")  # fmt: skip
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a tensor state dict")

    def persistent_load(self, pid):
        return self._load_storage(pid)


class UnsupportedTensor(pickle.UnpicklingError):
    """An intact file holding a tensor this reader does not convert (its dtype): named as such,
    not as a damaged file."""


class _PlainUnpickler(pickle.Unpickler):
    """For the legacy header records (ints, a dict of ints, a list of keys): no classes at all."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} in a header record")


class _Deferred:
    """A tensor of the legacy format, built once its storage bytes (after the pickle) are read."""

    def __init__(self, args):
        self.args = args


class _ZipErrors:
    """Re-raises what a damaged zip archive makes ``zipfile``, ``zlib`` or the unpickler raise
    as one ``CheckpointError`` naming the file."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, UnsupportedTensor):
            raise CheckpointError(f"{self.path}: {e}") from e
        if isinstance(e, (zipfile.BadZipFile, zlib.error, KeyError, EOFError, pickle.UnpicklingError, ValueError)) \
                and not isinstance(e, CheckpointError):
            raise CheckpointError(f"{self.path}: damaged PyTorch zip archive ({type(e).__name__}: {e})") from e
        return False


class _ZipMember:
    """A storage's zip member, read when a tensor of it is converted: memory-mapped where it is
    stored uncompressed at an offset aligned to its dtype (CRC-32 checked once), else read with
    ``zipfile`` (which checks it)."""

    def __init__(self, path: str, info: zipfile.ZipInfo, dtype: np.dtype):
        self.path, self.name, self.dtype, self.crc, self.checked = path, info.filename, dtype, info.CRC, False
        if info.file_size % dtype.itemsize:
            raise ValueError("buffer size must be a multiple of element size")  # what np.frombuffer says
        self.numel = info.file_size // dtype.itemsize
        self.start = None
        if info.compress_type == zipfile.ZIP_STORED and info.file_size == info.compress_size:
            with open(path, "rb") as f:  # the local header: its own name and extra-field lengths
                f.seek(info.header_offset)
                head = f.read(30)
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile("Bad magic number for file header")
            start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
            if start + info.file_size > os.path.getsize(path):
                raise zipfile.BadZipFile(f"member {info.filename!r} runs past the end of the file")
            if start % dtype.itemsize == 0 and self.numel:
                self.start = start

    @property
    def mapped(self) -> bool:
        return self.start is not None

    def read(self, a: int, b: int) -> np.ndarray:
        with _ZipErrors(self.path):
            if self.start is None:
                with zipfile.ZipFile(self.path) as zf:
                    return np.frombuffer(zf.read(self.name), dtype=self.dtype)[a:b]
            m = np.memmap(self.path, dtype=self.dtype, mode="c", offset=self.start, shape=(self.numel,))
            arr = m.view(np.ndarray)  # a plain array over the map (kept alive)
            if not self.checked:
                if zlib.crc32(arr.view(np.uint8)) != self.crc:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {self.name!r}")
                self.checked = True
            return arr[a:b]


def _load_zip(path: str, lazy: bool = False) -> dict:
    with _ZipErrors(path), zipfile.ZipFile(path) as zf:
        pkls = [n for n in zf.namelist() if n.endswith("data.pkl")]
        if not pkls:
            raise CheckpointError(f"{path}: a zip archive without data.pkl: not a torch.save file")
        root = pkls[0][: -len("data.pkl")]
        record = f"{root}byteorder"  # an archive without the record: read as little-endian, as before
        order = zf.read(record).decode("ascii", "replace").strip() if record in zf.namelist() else "little"
        if order != "little":
            raise CheckpointError(f"{path}: its byteorder record says {order!r}: only little-endian torch.save "
                                  f"archives are read (load it with torch on its machine and save it again)")  # fmt: skip
        cache = {}

        def load_storage(pid):
            _, stype, key, _location, _numel = pid
            if key not in cache:
                st = _Storage(_DTYPES[stype], key)
                name = f"{root}data/{key}"
                if lazy:
                    member = _ZipMember(path, zf.getinfo(name), _file_dtype(st.dtype))
                    st.numel, st.read, st.mapped = member.numel, member.read, member.mapped
                else:
                    st.set_array(_as_array(zf.read(name), st.dtype))
                cache[key] = st
            return cache[key]

        with zf.open(pkls[0]) as f:
            return _Unpickler(f, load_storage).load()


def _load_legacy(path: str, lazy: bool = False) -> dict:
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
            return _resolve(_load_legacy_body(f, lazy))
        except (EOFError, pickle.UnpicklingError, ValueError, KeyError, IndexError) as e:
            if isinstance(e, CheckpointError):
                raise
            if isinstance(e, UnsupportedTensor):
                raise CheckpointError(f"{path}: {e}") from e
            cut = isinstance(e, EOFError) or "truncated" in str(e)
            why = "truncated legacy PyTorch file (it ends inside a pickle)" if cut else "damaged legacy PyTorch file"
            raise CheckpointError(f"{path}: {why} ({type(e).__name__}: {e})") from e


def _load_legacy_body(f, lazy: bool = False):
    """Everything after the magic number: protocol, sys info, the pickle, storage keys, storages
    (``lazy``: their offsets, each read when a tensor of it is converted)."""
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
        dtype = _file_dtype(st.dtype)
        if lazy:
            start = f.tell()
            f.seek(start + _check_left(f, n * dtype.itemsize, f"storage {key!r}"))
            st.numel, st.read = n, functools.partial(_read_range, f.name, start, dtype)
        else:
            st.set_array(_as_array(_read_exact(f, n * dtype.itemsize, f"storage {key!r}"), st.dtype))
    for vs, base, off, size in views:
        if lazy and base.numel is not None:
            vs.numel, vs.read = max(0, min(size, base.numel - off)), functools.partial(_shifted, base.read, off)
        elif lazy:
            continue  # a view of a storage without data: "has no data" when a tensor uses it
        else:
            vs.set_array(base.array[off:off + size])
    return obj


def _shifted(read, off: int, a: int, b: int) -> np.ndarray:
    return read(off + a, off + b)


def _read_range(path: str, start: int, dtype: np.dtype, a: int, b: int) -> np.ndarray:
    """Elements [a, b) of the legacy storage whose bytes begin at ``start``."""
    n = (b - a) * dtype.itemsize
    raw = bytearray(n)
    with open(path, "rb") as f:
        f.seek(start + a * dtype.itemsize)
        got = f.readinto(raw)
    if got < n:
        raise CheckpointError(f"{path}: truncated legacy PyTorch file (a storage at byte {start} ends early: the "
                              f"file changed after it was opened?)")
    return np.frombuffer(raw, dtype=dtype)


def _check_left(f, n: int, what: str) -> int:
    left = os.fstat(f.fileno()).st_size - f.tell()
    if n < 0:
        raise CheckpointError(f"{f.name}: damaged legacy PyTorch file ({what}: a negative size {n})")
    if n > left:  # checked before reading: a garbled size must not allocate terabytes
        raise CheckpointError(f"{f.name}: truncated legacy PyTorch file ({what} needs {n} bytes, "
                              f"the file has {left} left)")
    return n


def _read_exact(f, n: int, what: str) -> bytes:
    return f.read(_check_left(f, n, what))


def _resolve(obj):
    if isinstance(obj, _Deferred):
        return _rebuild_tensor(*obj.args)
    if isinstance(obj, dict):
        return type(obj)((k, _resolve(v)) for k, v in obj.items())
    return obj


def load_torch_file(path: str, lazy: bool = False) -> dict[str, np.ndarray]:
    """A state dict saved by ``torch.save`` as ``{name: np.ndarray}`` (torch not needed).
    ``lazy``: ``{name: LazyTensor}`` instead, each read when converted (see the module's
    docstring); the file's structure is checked now, a zip member's CRC when it is read.

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
    state = _load_zip(path, lazy) if is_zip else _load_legacy(path, lazy)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict")
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if "model_state_dict" in state and isinstance(state["model_state_dict"], dict):
        state = state["model_state_dict"]
    bad = [k for k, v in state.items() if not isinstance(v, (np.ndarray, LazyTensor))]
    if bad:
        raise CheckpointError(f"{path}: entries that are not tensors: {bad[:5]}")
    return dict(state)
