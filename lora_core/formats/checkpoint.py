"""Checkpoint and adapter formats (numpy + safetensors), strict by construction.

- ``load_gpt2_checkpoint``: HF/OpenAI GPT-2 weights from ``model.safetensors`` or
  ``pytorch_model.bin`` (with or without the ``transformer.`` prefix) -> canonical names,
  Conv1D weights transposed once (``naming.TRANSPOSED``).
- ``save_model``/``load_model``: a full model, ``config.json`` + ``model.safetensors``.
- ``save_adapter``/``load_adapter``: the adapter alone, ``adapter_config.json`` +
  ``adapter.safetensors`` (LoRA tensors and the trained biases, canonical names).

Every loader lists missing, unexpected and mis-shaped keys in one ``CheckpointError``
(nanoGPT / peft strictness; no ``strict=False``); a file cut short or of the wrong format
raises one naming the file and the damage (``lora_core.formats.tensor_files``). Writers go through a temp file and
``os.replace`` so that a kill never leaves a half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ..models.gpt2 import (
    TRANSPOSED,
    GPT2Config,
    LoRAConfig,
    base_shapes,
    is_non_parameter,
    lora_shapes,
    trainable_names,
)
from .hf_checkpoint import find_weights, read_hf_weights
from .tensor_files import CheckpointError, read_json, read_tensors

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter.safetensors"
MODEL_CONFIG, MODEL_WEIGHTS = "config.json", "model.safetensors"
FORMAT_VERSION = 1
_HEADS_BY_WIDTH = {768: 12, 1024: 16, 1280: 20, 1600: 25}


def check_tensors(path, tensors: dict, expected: dict[str, tuple[int, ...]]) -> None:
    """Raise one ``CheckpointError`` listing missing, unexpected and mis-shaped keys."""
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    shapes = [f"{k}: file {tuple(tensors[k].shape)} != model {tuple(expected[k])}"
              for k in expected if k in tensors and tuple(tensors[k].shape) != tuple(expected[k])]
    if missing or unexpected or shapes:
        parts = [f"{path}: checkpoint does not match the model"]
        if missing:
            parts.append(f"  missing keys ({len(missing)}): {missing}")
        if unexpected:
            parts.append(f"  unexpected keys ({len(unexpected)}): {unexpected}")
        if shapes:
            parts.append(f"  shape mismatches ({len(shapes)}): {shapes}")
        raise CheckpointError("\n".join(parts))


def umask_mode(folder: bool = False) -> int:
    """The mode ``open``/``mkdir`` give a new file (folder) under the process's umask: what an
    atomically written file or checkpoint folder gets, not ``mkstemp``'s 0600 (``mkdtemp``'s 0700),
    so that a run's outputs are as readable to a group or other users as any file the user writes.
    The umask is read from ``/proc/self/status`` where Linux shows it: setting it to read it back
    would, for a moment, let another thread create a file with no mask at all."""
    return (0o777 if folder else 0o666) & ~_umask()


def _umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)  # elsewhere: the one way to read it (the strictest mask meanwhile)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call ``write(tmp_path)`` then rename onto ``path`` (same folder, so the rename is atomic);
    the file gets the umask's mode (:func:`umask_mode`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, umask_mode())  # after ``write``, which may make the file anew (safetensors does)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json_atomic(path, obj) -> None:
    """``obj`` as JSON, its top-level keys sorted; nested objects keep their order (a LoRA
    config's ``rank_pattern`` / ``alpha_pattern``: the first matching pattern wins, as in peft,
    so sorting them would change which rank or alpha a module gets once reloaded)."""
    if isinstance(obj, dict):
        obj = {k: obj[k] for k in sorted(obj)}

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    atomic_write(path, write)


def write_safetensors_atomic(path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    from safetensors.numpy import save_file
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(arrays, tmp, metadata=metadata))


def write_weights_and_config(folder, weights_name: str, tensors: dict[str, np.ndarray], metadata: dict | None,
                             config_name: str, config: dict) -> None:
    """A checkpoint's weights and the config that says what they are, saved so that no kill
    leaves one save's weights under another save's config: an old config in ``folder`` is
    removed first, the weights written, the config last (each file atomically). Until the config
    is written the folder reads as incomplete (the loaders name the missing config), never as the
    new weights under the old settings."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / config_name).unlink(missing_ok=True)
    write_safetensors_atomic(folder / weights_name, tensors, metadata)
    write_json_atomic(folder / config_name, config)


def saved_whole(folder, config_name: str = MODEL_CONFIG) -> bool:
    """Whether ``folder`` holds a complete save of ``write_weights_and_config`` (its config is
    written last): a resumed run keeps such a ``OUT/base`` as it is, where writing it again
    would leave it without its config for the moment the weights are rewritten."""
    return (Path(folder) / config_name).is_file()


def infer_gpt2_config(tensors: dict[str, np.ndarray], path="checkpoint") -> GPT2Config:
    """GPT-2 sizes read off the canonical tensors (heads from the standard widths)."""
    if "wte.weight" not in tensors or "wpe.weight" not in tensors:
        raise CheckpointError(f"{path}: no wte.weight/wpe.weight: not a GPT-2 checkpoint (a folder whose config.json "
                              f"is missing or names no other model_type, such as llama or distilbert, is read as GPT-2)")
    V, E = tensors["wte.weight"].shape
    n_layer = len({k.split(".")[1] for k in tensors if k.startswith("h.")})
    if E not in _HEADS_BY_WIDTH:
        raise CheckpointError(f"{path}: n_embd={E} is not a standard GPT-2 width; pass a GPT2Config "
                              f"(or a config.json beside the weights)")
    return GPT2Config(vocab_size=V, n_positions=tensors["wpe.weight"].shape[0], n_embd=E,
                      n_layer=n_layer, n_head=_HEADS_BY_WIDTH[E])


def load_gpt2_checkpoint(path: str | os.PathLike, cfg: GPT2Config | None = None, lazy: bool = False
                         ) -> tuple[GPT2Config, dict[str, np.ndarray]]:
    """Load HF/OpenAI GPT-2 weights into canonical names and (out, in) layout.

    Args:
        path: a weights file or a folder holding ``model.safetensors``, ``pytorch_model.bin``
            or either's shards with their index (``hf_checkpoint.find_weights``), and
            optionally HF ``config.json``.
        cfg: the expected architecture; default: ``config.json`` beside the weights,
            else inferred from the tensor shapes.
        lazy: leave each tensor as the file gives it (a memory map of a ``.safetensors`` file,
            the Conv1D weights as transposed views of it, any float dtype; a ``LazyTensor``
            where it must be read or widened: bfloat16, a ``.bin``) for a consumer that
            converts one tensor at a time (the 4-bit loader quantizes them so: the float32
            copies of all the weights are never held at once).

    Returns:
        ``(cfg, tensors)`` with float32 arrays (``lazy``: arrays of the file's dtype).
    """
    path = Path(path)
    wpath = find_weights(path)  # a weights file, or an index of shards
    raw = read_hf_weights(wpath, lazy=lazy)  # memory maps: frozen base, ranks share its pages
    tensors = {}
    lm_head = None
    for k, v in raw.items():
        name = k[len("transformer."):] if k.startswith("transformer.") else k
        if name == "lm_head.weight":
            lm_head = v
            continue
        if is_non_parameter(name):
            continue
        if name.endswith(TRANSPOSED):
            v = v.T
        tensors[name] = v if lazy else np.ascontiguousarray(v, dtype=np.float32)
    if cfg is None:
        cfg_json = wpath.parent / MODEL_CONFIG
        cfg = GPT2Config.from_hf_json(str(cfg_json)) if cfg_json.is_file() else infer_gpt2_config(tensors, wpath)
    check_tensors(wpath, tensors, base_shapes(cfg))
    if lm_head is not None and not np.array_equal(lm_head, tensors["wte.weight"]):
        raise CheckpointError(f"{wpath}: lm_head.weight differs from wte.weight; GPT-2's LM head is tied")
    return cfg, tensors


def save_model(path: str | os.PathLike, cfg: GPT2Config, tensors: dict[str, np.ndarray],
               lora: LoRAConfig | None = None) -> None:
    """Save a full model (base + any LoRA tensors) as ``config.json`` + ``model.safetensors``."""
    path = Path(path)
    expected = dict(base_shapes(cfg), **(lora_shapes(cfg, lora) if lora else {}))
    check_tensors(path / MODEL_WEIGHTS, tensors, expected)
    write_weights_and_config(path, MODEL_WEIGHTS, tensors, {"format": "lora_core", "version": str(FORMAT_VERSION)},
                             MODEL_CONFIG, {"model_type": "gpt2", "lora_core_format": FORMAT_VERSION, **cfg.to_dict(),
                                            "lora": lora.to_dict() if lora else None})  # fmt: skip


def load_model(path: str | os.PathLike) -> tuple[GPT2Config, LoRAConfig | None, dict[str, np.ndarray]]:
    """Load what ``save_model`` wrote (strict)."""
    path = Path(path)
    meta = read_json(path / MODEL_CONFIG)
    with _config_errors(path / MODEL_CONFIG, "model config"):
        lora = LoRAConfig.from_dict(meta["lora"]) if meta.get("lora") else None
        cfg = GPT2Config.from_dict({k: v for k, v in meta.items() if k not in ("model_type", "lora_core_format", "lora")})
    tensors = read_tensors(path / MODEL_WEIGHTS, mmap=True)
    check_tensors(path / MODEL_WEIGHTS, tensors, dict(base_shapes(cfg), **(lora_shapes(cfg, lora) if lora else {})))
    return cfg, lora, tensors


@contextlib.contextmanager
def _config_errors(path: Path, what: str):
    """Re-raise a config JSON's missing or bad fields as a ``CheckpointError`` naming the file."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid {what} ({type(e).__name__}: {e})") from e


def adapter_shapes(cfg: GPT2Config, lora: LoRAConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes an adapter file holds: LoRA tensors and the biases ``lora.bias`` trains."""
    shapes = dict(base_shapes(cfg), **lora_shapes(cfg, lora))
    return {n: shapes[n] for n in trainable_names(cfg, lora)}


def save_adapter(path: str | os.PathLike, cfg: GPT2Config, lora: LoRAConfig,
                 tensors: dict[str, np.ndarray], base: str | None = None) -> None:
    """Save the adapter alone (small: the r=4 q,v adapter of gpt2-medium is 393,216 numbers).

    Args:
        tensors: at least every name of ``adapter_shapes(cfg, lora)``; other names (the
            frozen base) are left out.
        base: a note of which base checkpoint it was trained on (informational).
    """
    path = Path(path)
    expected = adapter_shapes(cfg, lora)
    check_tensors(path / ADAPTER_WEIGHTS, {k: v for k, v in tensors.items() if k in expected}, expected)
    write_weights_and_config(path, ADAPTER_WEIGHTS, {k: tensors[k] for k in expected}, None, ADAPTER_CONFIG,
                             {"lora_core_format": FORMAT_VERSION, "lora": lora.to_dict(), "base_config": cfg.to_dict(),
                              "base": base})  # fmt: skip


def load_adapter(path: str | os.PathLike) -> tuple[LoRAConfig, GPT2Config, dict[str, np.ndarray], str | None]:
    """Read an adapter folder (strict): ``(lora, base_cfg, tensors, base_note)``.

    An adapter alone is not a model: callers must combine it with the base weights
    (``backend.load_model_with_adapter``), which refuses a missing base.
    """
    path = Path(path)
    cfg_path = path / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path}: no adapter config (is {path} an adapter folder?)")
    meta = read_json(cfg_path)
    with _config_errors(cfg_path, "adapter config"):
        lora = LoRAConfig.from_dict(meta["lora"])
        cfg = GPT2Config.from_dict(meta["base_config"])
    tensors = read_tensors(path / ADAPTER_WEIGHTS)
    check_tensors(path / ADAPTER_WEIGHTS, tensors, adapter_shapes(cfg, lora))
    return lora, cfg, tensors, meta.get("base")


def full_weights(cfg: GPT2Config, lora: LoRAConfig | None, base: dict[str, np.ndarray] | None,
                 lora_weights: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every tensor a model with ``lora`` needs: the base plus LoRA values.

    ``lora_weights`` default to the seeded ``init_lora_weights``; a base is required
    (pass ``init_gpt2_weights(cfg, seed)`` for a random one, explicitly).
    """
    from ..models.gpt2 import init_lora_weights
    if base is None:
        raise CheckpointError("no base weights given: a LoRA model needs its base model "
                              "(pass pretrained weights, or init_gpt2_weights(cfg) explicitly)")
    check_tensors("base weights", base, base_shapes(cfg))
    out = dict(base)
    if lora is not None and lora.r:
        lw = init_lora_weights(cfg, lora) if lora_weights is None else lora_weights
        check_tensors("lora weights", lw, lora_shapes(cfg, lora))
        out.update(lw)
    return out


def resolve_pretrained(path: str | os.PathLike | None, lora: LoRAConfig | None = None,
                       adapter: str | os.PathLike | None = None, lazy: bool = False
                       ) -> tuple[GPT2Config, LoRAConfig | None, dict[str, np.ndarray]]:
    """Weights for ``from_pretrained``: a GPT-2 checkpoint (HF/OpenAI files or ``save_model``
    output) plus an optional adapter folder, whose LoRA config then wins over ``lora``.
    ``lazy``: HF/OpenAI tensors as ``load_gpt2_checkpoint(lazy=True)`` leaves them.

    Raises:
        CheckpointError: an adapter without a base path, or an adapter trained on a
            different architecture.
    """
    if path is None:
        raise CheckpointError(f"adapter {adapter} given without its base model: pass the base checkpoint "
                              f"it was trained on (an adapter alone is not a model)" if adapter else
                              "no checkpoint path given")
    p = Path(path)
    if (p / MODEL_CONFIG).is_file() and (p / MODEL_WEIGHTS).is_file() and _is_ours(p / MODEL_CONFIG):
        cfg, saved_lora, tensors = load_model(p)
        names = base_shapes(cfg)
        base = {k: v for k, v in tensors.items() if k in names}
        lora_w = {k: v for k, v in tensors.items() if k not in base} or None
        lora = lora or saved_lora
        if lora_w is not None and saved_lora != lora:
            lora_w = None
    else:
        cfg, base = load_gpt2_checkpoint(p, lazy=lazy)
        lora_w = None
    if adapter is not None:
        a_lora, a_cfg, a_tensors, _ = load_adapter(adapter)
        if a_cfg != cfg:
            raise CheckpointError(f"{adapter}: adapter was trained on {a_cfg}, base {path} is {cfg}")
        lora = a_lora
        base = dict(base, **{k: v for k, v in a_tensors.items() if k in base})
        lora_w = {k: v for k, v in a_tensors.items() if k not in base}
    return cfg, lora, full_weights(cfg, lora, base, lora_w)


def _is_ours(cfg_path: Path) -> bool:
    return "lora_core_format" in read_json(cfg_path)
