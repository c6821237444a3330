"""bitsandbytes' 4-bit checkpoint layout, read and written without torch: what
``transformers``' ``save_pretrained`` writes for a model loaded with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` (the form in which
pre-quantized models are published).

For each quantized ``<module>.weight`` (bitsandbytes ``QuantState.as_dict(packed=True)``):
    ``<m>.weight``           (ceil(n / 2), 1) uint8 packed NF4 codes (``lora_core.quant.nf4``)
    ``<m>.weight.absmax``    uint8 8-bit codes of the block scales (double quantization) or float32
    ``<m>.weight.quant_map`` (16,) float32, the NF4 table
    ``<m>.weight.nested_absmax`` / ``.nested_quant_map`` float32 (double quantization only)
    ``<m>.weight.quant_state.bitsandbytes__nf4`` uint8 bytes of ``json.dumps`` of
        ``{quant_type, blocksize, dtype, shape[, nested_blocksize, nested_dtype, nested_offset]}``
and ``config.json`` carries ``quantization_config`` (``quant_method: "bitsandbytes"``).
Weights are stored (out, in), GPT-2's Conv1D ones too (transformers transposes them before
quantizing). A damaged state raises ``CheckpointError`` naming the tensor and the file.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from ..quant.nf4 import NF4_CODE, NF4State, check_blocksize, dynamic_map
from .tensor_files import CheckpointError, read_json

SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
QS_PREFIX = "quant_state.bitsandbytes__"
_QS_KEYS = {"quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"}


def quantization_config(path: str | os.PathLike) -> dict | None:
    """The ``quantization_config`` of the checkpoint folder at ``path`` (None: not quantized);
    anything but bitsandbytes' 4-bit NF4 raises ``ValueError`` naming what is supported."""
    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p.parent / "config.json" if p.is_file() else None
    if cfg is None or not cfg.is_file():
        return None
    qc = read_json(cfg).get("quantization_config")
    if qc is None:
        return None
    supported = "supported: bitsandbytes 4-bit NF4 (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))"
    if not isinstance(qc, dict):
        raise ValueError(f"{cfg}: quantization_config must be an object (transformers' BitsAndBytesConfig as "
                         f"JSON), got {type(qc).__name__}; {supported}")
    method = qc.get("quant_method")
    if method != "bitsandbytes":
        raise ValueError(f"{cfg}: quantization_config quant_method {method!r} is not supported; {supported}")
    if not qc.get("load_in_4bit", qc.get("_load_in_4bit")):
        raise ValueError(f"{cfg}: a bitsandbytes 8-bit checkpoint (load_in_4bit is not set) is not supported; {supported}")
    qtype = qc.get("bnb_4bit_quant_type", "fp4")
    if qtype != "nf4":
        raise ValueError(f"{cfg}: bnb_4bit_quant_type {qtype!r} is not supported; {supported}")
    return qc


def _bad(where, name, why) -> CheckpointError:
    return CheckpointError(f"{where}: {name}: damaged 4-bit quant state ({why})")


def _state_json(raw: np.ndarray, where, key) -> dict:
    try:
        d = json.loads(bytes(np.asarray(raw, np.uint8).reshape(-1)).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(where, key, f"not the JSON bitsandbytes writes: {e}") from None
    if not isinstance(d, dict) or not {"quant_type", "blocksize", "dtype", "shape"} <= set(d) or set(d) - _QS_KEYS:
        raise _bad(where, key, f"keys {sorted(d) if isinstance(d, dict) else type(d).__name__}, expected {sorted(_QS_KEYS)}")
    return d


# bnb_4bit_quant_storage: the dtype bitsandbytes views the packed bytes as (``packed.view(dtype)``,
# (ceil(n / 2) / itemsize, 1)); FSDP / DeepSpeed ZeRO-3 QLoRA stores them as the model's float
# dtype. numpy's dtype of each as this package's tensor reader hands it over: bfloat16 widened to
# float32 exactly (``tensor_files.bf16_to_f32``: its bits are the top half of the float32's).
QUANT_STORAGE = {"uint8": np.uint8, "int8": np.int8, "float16": np.float16, "bfloat16": np.float32,
                 "int16": np.int16, "float32": np.float32, "int32": np.int32, "float64": np.float64,
                 "int64": np.int64}


def quant_storage(qc: dict | None, where) -> str:
    """``quantization_config``'s ``bnb_4bit_quant_storage`` (``"uint8"`` where absent; ``"torch."``
    dropped); one numpy cannot reinterpret raises ValueError naming it."""
    raw = (qc or {}).get("bnb_4bit_quant_storage") or "uint8"
    name = str(raw).removeprefix("torch.")
    if name not in QUANT_STORAGE:
        raise ValueError(f"{where}: quantization_config bnb_4bit_quant_storage {raw!r} is not supported; "
                         f"expected one of {sorted(QUANT_STORAGE)}")
    return name


def _packed_bytes(arr, storage: str, where, name) -> np.ndarray:
    """The packed NF4 codes of ``name`` as uint8 (its bytes, not its values), from the tensor the
    reader gave for a weight stored as ``storage``: a bfloat16 one (widened to float32 by the
    reader, exactly) narrowed back to its 16 bits, any other reinterpreted byte for byte."""
    a = np.asarray(arr)
    want = np.dtype(QUANT_STORAGE[storage])
    if storage == "uint8" or a.dtype != want:
        return a  # the shape/dtype check below names what is wrong
    if storage == "bfloat16":
        a = (np.ascontiguousarray(a).view(np.uint32) >> 16).astype("<u2")
    return np.ascontiguousarray(a, a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8).reshape(-1, 1)


def _one_state(name: str, parts: dict, where, storage: str = "uint8") -> NF4State:
    """The ``NF4State`` of quantized weight ``name`` from its tensors ``parts`` (by suffix);
    ``storage``: the checkpoint's ``bnb_4bit_quant_storage`` (``quant_storage``)."""
    qs_keys = [k for k in parts if k.startswith(QS_PREFIX)]
    if len(qs_keys) != 1:
        raise _bad(where, name, f"expected one {name}.{QS_PREFIX}nf4 tensor, found {qs_keys}")
    qkey = f"{name}.{qs_keys[0]}"
    if qs_keys[0] != QS_PREFIX + "nf4":
        raise ValueError(f"{where}: {qkey}: quant type {qs_keys[0][len(QS_PREFIX):]!r} is not supported; only 'nf4'")
    d = _state_json(parts[qs_keys[0]], where, qkey)
    if d["quant_type"] != "nf4":
        raise ValueError(f"{where}: {qkey}: quant_type {d['quant_type']!r} is not supported; only 'nf4'")
    try:
        bs = check_blocksize(d["blocksize"], f"{qkey}: blocksize")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    shape = tuple(d["shape"]) if isinstance(d["shape"], list) else None
    if shape is None or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise _bad(where, qkey, f"shape {d['shape']!r}")
    n, nested = math.prod(shape), "nested_absmax" in parts
    need = ["absmax", "quant_map"] + (["nested_absmax", "nested_quant_map"] if nested else [])
    missing = [f"{name}.{s}" for s in need if s not in parts]
    if missing or (nested and "nested_offset" not in d):
        raise _bad(where, name, f"missing {missing or ['nested_offset in ' + qkey]}")
    if nested:
        nbs, off = d.get("nested_blocksize"), d["nested_offset"]
        if type(nbs) is not int or nbs < 1:
            raise _bad(where, qkey, f"nested_blocksize {nbs!r}, expected a positive int")
        if type(off) not in (int, float) or not math.isfinite(off):
            raise _bad(where, qkey, f"nested_offset {off!r}, expected a finite number")
    packed, absmax = _packed_bytes(parts["weight"], storage, where, name), np.asarray(parts["absmax"])
    nb = -(-n // bs)
    checks = [
        (name, packed, (-(-n // 2), 1), np.uint8),
        (f"{name}.absmax", absmax, (nb,), np.uint8 if nested else np.float32),
        (f"{name}.quant_map", np.asarray(parts["quant_map"]), (16,), np.float32),
    ]
    if nested:
        checks += [(f"{name}.nested_absmax", np.asarray(parts["nested_absmax"]), (-(-nb // d["nested_blocksize"]),), np.float32),
                   (f"{name}.nested_quant_map", np.asarray(parts["nested_quant_map"]), (256,), np.float32)]
    for key, arr, shp, dt in checks:
        if tuple(arr.shape) != shp or arr.dtype != dt:
            got = f"{arr.dtype}{list(arr.shape)}"
            if key == name and storage != "uint8":  # what the file holds, before its bytes were taken
                got = f"{np.asarray(parts['weight']).dtype}{list(np.shape(parts['weight']))} under bnb_4bit_quant_storage {storage}, {got} as bytes"
            raise _bad(where, key, f"{got}, expected {np.dtype(dt)}{list(shp)} for shape {list(shape)}, blocksize {bs}")
    if not np.array_equal(parts["quant_map"], NF4_CODE):
        raise _bad(where, f"{name}.quant_map", "not bitsandbytes' NF4 table")
    if nested and not np.array_equal(parts["nested_quant_map"], dynamic_map()):
        raise _bad(where, f"{name}.nested_quant_map", "not bitsandbytes' dynamic 8-bit map")
    st = NF4State(packed, absmax, shape, bs, str(d["dtype"]))
    if nested:
        st.nested_absmax, st.offset = np.asarray(parts["nested_absmax"]), np.float32(d["nested_offset"])
        st.nested_blocksize = int(d["nested_blocksize"])
    return st


def split_bnb4bit(tensors: dict, where, storage: str = "uint8") -> dict[str, NF4State]:
    """Pop every bitsandbytes 4-bit weight (and its state tensors) out of ``tensors`` (names
    as in the file) and return their ``NF4State`` by weight name; the rest stays. ``storage``:
    the dtype the packed weights are stored as (``quant_storage(qc)``); their bytes are the codes."""
    groups: dict[str, dict] = {}
    for k in list(tensors):
        head, _, tail = k.partition(".weight.")
        if tail and (tail in SUFFIXES or tail.startswith(QS_PREFIX)):
            groups.setdefault(head + ".weight", {})[tail] = tensors.pop(k)
    states = {}
    for name, parts in groups.items():
        if name not in tensors:
            raise _bad(where, name, f"its state tensors ({sorted(parts)}) are there but the packed weight is not")
        parts["weight"] = tensors.pop(name)
        states[name] = _one_state(name, parts, where, storage)
    return states


def bnb4bit_tensors(name: str, st: NF4State) -> dict[str, np.ndarray]:
    """The tensors bitsandbytes saves for quantized weight ``name`` (see the module docstring)."""
    qs = {"quant_type": "nf4", "blocksize": st.blocksize, "dtype": st.dtype, "shape": list(st.shape)}
    out = {name: np.asarray(st.packed, np.uint8).reshape(-1, 1), f"{name}.absmax": np.asarray(st.absmax),
           f"{name}.quant_map": NF4_CODE.copy()}
    if st.nested:
        out[f"{name}.nested_absmax"] = np.asarray(st.nested_absmax, np.float32)
        out[f"{name}.nested_quant_map"] = dynamic_map()
        qs.update(nested_blocksize=st.nested_blocksize, nested_dtype="float32", nested_offset=float(st.offset))
    out[f"{name}.{QS_PREFIX}nf4"] = np.frombuffer(json.dumps(qs).encode("utf-8"), np.uint8).copy()
    return out


def bnb4bit_config(double_quant: bool = True, compute_dtype: str = "float32", skip_modules=None) -> dict:
    """``quantization_config`` as transformers 5 writes it for ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant)``."""
    return {"_load_in_4bit": True, "_load_in_8bit": False, "bnb_4bit_compute_dtype": compute_dtype,
            "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": bool(double_quant), "llm_int8_enable_fp32_cpu_offload": False,
            "llm_int8_has_fp16_weight": False, "llm_int8_skip_modules": skip_modules, "llm_int8_threshold": 6.0,
            "load_in_4bit": True, "load_in_8bit": False, "quant_method": "bitsandbytes"}


def write_bnb4bit_checkpoint(folder: str | os.PathLike, config: dict, tensors: dict[str, np.ndarray],
                             states: dict[str, NF4State], compute_dtype: str = "float32",
                             skip_modules: list[str] | None = None) -> None:
    """A 4-bit checkpoint folder transformers' ``from_pretrained`` loads without re-quantizing:
    ``config.json`` (``config`` plus ``quantization_config``, whose ``llm_int8_skip_modules``
    is ``skip_modules``: the linear layers transformers must leave in full precision) and
    ``model.safetensors`` (``tensors``, float32, and each state in ``states`` as
    ``bnb4bit_tensors``; names are transformers'), each written atomically."""
    from .checkpoint import write_weights_and_config

    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    nested = {st.nested for st in states.values()}
    if len(nested) > 1:
        raise ValueError("all 4-bit weights of a checkpoint must share double quantization (one quantization_config)")
    for name, st in states.items():
        arrays.update(bnb4bit_tensors(name, st))
    cfg = json.loads(json.dumps(config))
    cfg["quantization_config"] = bnb4bit_config(nested.pop() if nested else True, compute_dtype, skip_modules)
    write_weights_and_config(folder, "model.safetensors", arrays, {"format": "pt"}, "config.json", cfg)


__all__ = ["QUANT_STORAGE", "bnb4bit_config", "bnb4bit_tensors", "quant_storage", "quantization_config", "split_bnb4bit",
           "write_bnb4bit_checkpoint"]
