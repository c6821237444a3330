"""What the trainer trains: the task supplies examples, batches, the update's loss, the
evaluation and the adapter files; ``lora_core.train.trainer`` supplies everything else (data order,
schedule, gradient accumulation, dropout streams, logging, checkpoints, resume, several
processes) and never looks inside an example.

Two tasks:

- :class:`LMTask`: causal LM on ``(context, completion)`` pairs, loss on the completion
  tokens (the LoRA paper's NLG experiments: GPT-2 on E2E, WebNLG, DART); validation NLL and
  perplexity; adapters in the GPT-2 format (``lora_core.formats.checkpoint.save_adapter``).
- :class:`ClassificationTask`: sequence classification on ``(token_ids, label)`` examples
  (DistilBERT on SST-2), cross-entropy of the labels; validation accuracy and loss;
  adapters of injected models (``lora_core.formats.adapter_io``).

A task object holds no state of a run; a backend module (``lora_core.get_backend``) is passed
to the methods that touch tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..data import cls_data
from ..data.batching import collate as collate_pairs
from ..formats import adapter_io
from ..formats.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_shapes, load_adapter, save_adapter
from ..lora.injection import injection_of
from .distributed import Comm, shard_range
from .run_dir import fingerprint

__all__ = ["ClassificationTask", "GPT2AdapterFiles", "InjectedAdapterFiles", "LMTask", "max_positions", "task_for"]


# --------------------------------------------------------------------------- adapter files


class GPT2AdapterFiles:
    """A GPT-2 adapter in a checkpoint folder (``save_adapter``): strict, and refused when it
    was trained with another LoRA config or on another base shape."""

    FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)  # what ``write`` puts in a checkpoint folder

    def __init__(self, model_config, lora_config, base: str | None = None):
        self.model_config, self.lora_config, self.base = model_config, lora_config, base

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return adapter_shapes(self.model_config, self.lora_config)

    def write(self, folder: Path, tensors: dict) -> None:
        save_adapter(folder, self.model_config, self.lora_config, tensors, base=self.base)

    def read(self, folder: Path) -> dict[str, np.ndarray]:
        lora, cfg, tensors, _ = load_adapter(folder)
        if lora != self.lora_config or cfg != self.model_config:
            raise ValueError(
                f"{folder}: adapter was trained with {lora} on {cfg}, "
                f"the model has {self.lora_config} on {self.model_config}"
            )
        return tensors


class InjectedAdapterFiles:
    """The adapter of an injected model (``inject_lora``) in a checkpoint folder, our format;
    refused when its targeting config or a tensor shape differs from the model's."""

    FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)

    def __init__(self, injection, param_shapes: dict[str, tuple[int, ...]], base: str | None = None):
        self.injection, self.param_shapes, self.base = injection, dict(param_shapes), base

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return adapter_io.expected_shapes(self.injection, self.param_shapes)

    def write(self, folder: Path, tensors: dict) -> None:
        adapter_io.save(folder, self.injection, tensors, self.param_shapes, "lora_core", base=self.base)

    def read(self, folder: Path) -> dict[str, np.ndarray]:
        config, _ = adapter_io.read_config(folder)
        if config != self.injection.config:
            raise ValueError(f"{folder}: adapter was trained with {config}, the model has {self.injection.config}")
        return adapter_io.load(folder, self.injection, self.param_shapes)


# --------------------------------------------------------------------------- tasks


def _length_order_shards(lengths: list[int], batch_size: int, comm: Comm | None) -> list[list[int]]:
    """Evaluation batches (example indices) in length order, little padding; with ``comm`` each
    rank keeps its share of the batches."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    if comm is not None and comm.world.parallel:
        batches = batches[slice(*shard_range(len(batches), comm.world.size, comm.world.rank))]
    return batches


def _all_reduce(comm: Comm | None, values: list[float]) -> list[float]:
    if comm is not None and comm.world.parallel:
        return [float(v) for v in comm.all_reduce_sum(values)]
    return values


def max_positions(model) -> int:
    """How many positions the model attends over (GPT-2's ``n_positions``, the Llama
    family's ``max_position_embeddings``)."""
    cfg = model.config
    return cfg.n_positions if hasattr(cfg, "n_positions") else cfg.max_position_embeddings


class LMTask:
    """Causal LM on ``(context_ids, completion_ids)`` pairs, ``read_encoded`` records, or
    packed text blocks ``{"ids": block}`` (``examples.lm.prepare``: every token after the
    first is a target, as ``(block[:1], block[1:])``). A GPT-2 with its built-in LoRA, or any
    causal LM with injected LoRA (``inject_lora``: a Llama-family model)."""

    name = "lm"
    loss = "lm"  # the backends' data-parallel loss (``data_parallel(model, loss)``)
    sharded_dropout_masks = True  # parity-mode masks work on several processes (ShardedDropout)

    def examples(self, raw) -> list[tuple[list[int], list[int]]]:
        return [((e["ids"][:1], e["ids"][1:]) if "ids" in e else (e["context"], e["completion"]))
                if isinstance(e, dict) else (e[0], e[1]) for e in raw]

    def check(self, examples, model, where: str = "example") -> None:
        """Every example against the model before any work (else a bad one is refused only when
        its batch is collated, mid-run): a non-empty context and completion, at most the model's
        positions of input tokens (``len(context) + len(completion) - 1``: the model reads
        ``seq[:-1]``) and token ids in its vocabulary. ``where``: how the message names the
        examples with their 1-based number (``"training example"``: the line of an encoded
        file)."""
        V, P = model.config.vocab_size, max_positions(model)
        for i, (c, t) in enumerate(examples):
            if not len(c) or not len(t):
                raise ValueError(f"{where} {i + 1} has an empty {'context' if not len(c) else 'completion'}")
            n = len(c) + len(t) - 1
            if n > P:
                raise ValueError(
                    f"{where} {i + 1} has {n} input tokens (context {len(c)} + completion {len(t)} - 1), "
                    f"more than the model's {P} positions (drop or shorten it when preparing the data)"
                )
            lo, hi = min(min(c), min(t)), max(max(c), max(t))
            if hi >= V or lo < 0:
                raise ValueError(
                    f"{where} {i + 1}: token id {hi if hi >= V else lo} outside the model's vocabulary of {V} "
                    f"(wrong tokenizer, or a random-init model with too small a vocab_size?)"
                )

    def check_config(self, cfg, model) -> None:
        if cfg.pad_to is not None and cfg.pad_to > max_positions(model):
            raise ValueError(f"pad_to={cfg.pad_to} exceeds the model's {max_positions(model)} positions")

    def fingerprint(self, examples) -> str:
        return fingerprint(examples)

    def sizes(self, example) -> tuple[int, int]:
        """(loss positions, input tokens): the completion tokens; the model reads seq[:-1]."""
        c, t = example
        return len(t), len(c) + len(t) - 1

    def collate(self, examples, cfg, model) -> dict:
        return collate_pairs(examples, pad_to=cfg.pad_to, max_len=max_positions(model))

    def train_step(self, backend, model, optimizer, micro: list[dict], lr: float, cfg) -> dict:
        return backend.train_step(model, optimizer, micro, lr, cfg.label_smooth, cfg.max_grad_norm)

    def describe(self, model) -> dict:
        inj = injection_of(model)
        lora = inj.config if inj is not None else model.lora_config
        return {"model": model.config.to_dict(), "lora": lora.to_dict()}

    def trained_tensors(self, backend, model) -> dict[str, np.ndarray]:
        """What a checkpoint stores of the model: the adapter."""
        return backend.lora_state_dict(model)

    def adapter_files(self, backend, model, base: str | None) -> GPT2AdapterFiles | InjectedAdapterFiles:
        if injection_of(model) is not None:
            shapes = {n: tuple(v.shape) for n, v in backend.lora_state_dict(model).items()}
            return InjectedAdapterFiles(injection_of(model), shapes, base)
        return GPT2AdapterFiles(model.config, model.lora_config, base)

    def evaluate(self, backend, model, examples, batch_size: int, cfg=None, comm: Comm | None = None) -> dict:
        """Plain NLL per completion token and perplexity (batches in length order)."""
        pad_to = getattr(cfg, "pad_to", None)
        total, count = 0.0, 0
        for idx in _length_order_shards([len(c) + len(t) for c, t in examples], batch_size, comm):
            batch = collate_pairs([examples[i] for i in idx], pad_to=pad_to, max_len=max_positions(model))
            nll, n = backend.eval_nll(model, batch)
            total, count = total + nll, count + n
        total, count = _all_reduce(comm, [total, count])
        mean = total / max(count, 1)
        return {"valid_nll": mean, "valid_ppl": math.exp(min(mean, 700.0)), "valid_tokens": int(count)}


def check_token_ids(seqs, cfg, where: str = "example") -> None:
    """Every sequence between 1 token and the model's positions, every id in its vocabulary (a
    classifier's inputs, labelled or not); the message names ``where`` and the 1-based number."""
    for i, ids in enumerate(seqs):
        if not len(ids) or len(ids) > cfg.max_position_embeddings:
            raise ValueError(f"{where} {i + 1} has {len(ids)} tokens: between 1 and the model's "
                             f"{cfg.max_position_embeddings} positions expected (cut them when preparing: --max-len)")
        if max(ids) >= cfg.vocab_size or min(ids) < 0:
            raise ValueError(f"{where} {i + 1}: token id outside the model's vocabulary of {cfg.vocab_size}")


class ClassificationTask:
    """Sequence classification on ``(token_ids, label)`` examples (or ``{"ids", "label"}``
    records of ``examples.cls.prepare``) for a model with injected LoRA."""

    name = "classification"
    loss = "cls"
    sharded_dropout_masks = False  # every dropout of the model draws parity masks: one process only

    def examples(self, raw) -> list[tuple[list[int], int]]:
        return [(e["ids"], e["label"]) if isinstance(e, dict) else (e[0], e[1]) for e in raw]

    def check(self, examples, model, where: str = "example") -> None:
        """Labels, lengths and token ids against the model; ``where``: how the message names the
        examples with their 1-based number (``"validation example"``, ``"dev.jsonl line"``)."""
        cfg = model.config
        for i, (_, label) in enumerate(examples):
            if not isinstance(label, (int, np.integer)) or not 0 <= label < cfg.num_labels:
                raise ValueError(f"{where} {i + 1}: label {label!r} is not one of 0..{cfg.num_labels - 1}")
        check_token_ids([ids for ids, _ in examples], cfg, where)

    def check_config(self, cfg, model) -> None:
        if cfg.pad_to is not None:
            raise ValueError("pad_to is not used by classification (batches are padded to their longest)")
        if injection_of(model) is None:
            raise ValueError("the model has no injected LoRA: call inject_lora(model, targets) first")

    def fingerprint(self, examples) -> str:
        return fingerprint([(ids, [label]) for ids, label in examples])

    def sizes(self, example) -> tuple[int, int]:
        return 1, len(example[0])

    def collate(self, examples, cfg, model) -> dict:
        batch = cls_data.collate([ids for ids, _ in examples], [label for _, label in examples])
        batch["n_tokens"] = int(batch["attention_mask"].sum())
        return batch

    def train_step(self, backend, model, optimizer, micro: list[dict], lr: float, cfg) -> dict:
        if cfg.label_smooth:
            raise ValueError("label_smooth is not supported by classification: set it to 0")
        return backend.cls_train_step(model, optimizer, micro, lr, cfg.max_grad_norm)

    def describe(self, model) -> dict:
        return {"model": model.config.to_dict(), "lora": injection_of(model).config.to_dict()}

    def trained_tensors(self, backend, model) -> dict[str, np.ndarray]:
        return backend.lora_state_dict(model)

    def adapter_files(self, backend, model, base: str | None) -> InjectedAdapterFiles:
        shapes = {n: tuple(v.shape) for n, v in backend.lora_state_dict(model).items()}
        return InjectedAdapterFiles(injection_of(model), shapes, base)

    def evaluate(self, backend, model, examples, batch_size: int, cfg=None, comm: Comm | None = None) -> dict:
        """Accuracy and mean cross-entropy (batches in length order)."""
        loss, correct, n = 0.0, 0, 0
        for idx in _length_order_shards([len(ids) for ids, _ in examples], batch_size, comm):
            batch = cls_data.collate([examples[i][0] for i in idx], [examples[i][1] for i in idx])
            loss_sum, pred = backend.cls_eval(model, batch)
            loss, correct, n = loss + loss_sum, correct + int((pred == batch["labels"]).sum()), n + len(idx)
        loss, correct, n = _all_reduce(comm, [loss, correct, n])
        return {"valid_accuracy": correct / max(n, 1), "valid_loss": loss / max(n, 1), "valid_examples": int(n)}


def task_for(model) -> LMTask | ClassificationTask:
    """The task a model trains on by default: classification for a model with ``num_labels``
    in its config (DistilBERT, with injected LoRA or fully fine-tuned), else the causal LM."""
    if hasattr(getattr(model, "config", None), "num_labels"):
        return ClassificationTask()
    return LMTask()
