"""The weights of a Hugging Face checkpoint folder, in any of the four layouts
``transformers``' ``save_pretrained`` writes (``modeling_utils``: ``SAFE_WEIGHTS_NAME``,
``SAFE_WEIGHTS_INDEX_NAME``, ``WEIGHTS_NAME``, ``WEIGHTS_INDEX_NAME``):

- ``model.safetensors``;
- ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``
  (``{"metadata": {...}, "weight_map": {tensor name: shard file}}``);
- ``pytorch_model.bin``, and its sharded form with ``pytorch_model.bin.index.json``.

Safetensors files are memory-mapped (``read_tensors(mmap=True)``): the caller converts one
tensor at a time, so a model is never in memory twice; ``lazy`` goes further for a caller that
drops each tensor once converted (the 4-bit loader): bfloat16 tensors and those of ``.bin``
files are ``LazyTensor`` s, read when converted, shard by shard as the index places them. An index is strict: a shard it names
that is missing, a shard cut short, a tensor the index places in a shard that lacks it, or a
tensor in a shard the index does not list raise :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .tensor_files import CheckpointError, read_json, read_tensors

__all__ = ["WEIGHT_FILES", "find_weights", "read_hf_weights", "write_hf_checkpoint"]

# In transformers' order of preference.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def find_weights(path: str | os.PathLike) -> Path:
    """The weights file (or index) of a checkpoint folder; ``path`` may also name one."""
    path = Path(path)
    if path.is_file():
        return path
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"{path}: no {', '.join(WEIGHT_FILES)} in this folder")


def read_hf_weights(path: str | os.PathLike, lazy: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint at ``path`` (a folder, a weights file or an index), as
    numpy arrays under the checkpoint's own names (memory maps where the format allows;
    ``lazy``: ``LazyTensor`` s where a tensor must be read or widened, see ``read_tensors``)."""
    wpath = find_weights(path)
    if not wpath.name.endswith(".index.json"):
        return read_tensors(wpath, mmap=True, lazy=lazy)
    index = read_json(wpath)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{wpath}: no 'weight_map' object (tensor name -> shard file) in this index")
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise CheckpointError(f"{wpath}: weight_map gives {bad[0]!r} the shard {bad[1]!r}, not a file name")
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        spath = wpath.parent / shard
        if not spath.is_file():
            names = sorted(k for k, v in weight_map.items() if v == shard)
            raise CheckpointError(f"{wpath}: shard {shard} is missing (it holds {len(names)} tensors, e.g. {names[0]})")
        tensors = read_tensors(spath, mmap=True, lazy=lazy)  # a shard cut short: CheckpointError naming it
        listed = {k for k, v in weight_map.items() if v == shard}
        absent, extra = sorted(listed - set(tensors)), sorted(set(tensors) - listed)
        if absent or extra:
            raise CheckpointError(
                f"{spath}: does not hold what {wpath.name} says: "
                + "; ".join(s for s in (f"missing {absent[:5]}" if absent else "",
                                        f"not in the index {extra[:5]}" if extra else "") if s)
            )
        out.update(tensors)
    return out


def write_hf_checkpoint(folder: str | os.PathLike, config: dict, tensors: dict[str, np.ndarray]) -> None:
    """A checkpoint folder transformers' ``from_pretrained`` reads: ``config.json`` (``config``,
    e.g. ``LlamaConfig.to_hf_dict()``) and ``model.safetensors`` (float32 tensors under
    transformers' names, ``{"format": "pt"}`` metadata as transformers writes), each written
    atomically (a kill leaves no half-written file under the final name)."""
    import json

    from .checkpoint import write_weights_and_config

    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    write_weights_and_config(folder, "model.safetensors", arrays, {"format": "pt"}, "config.json",
                             json.loads(json.dumps(config)))
