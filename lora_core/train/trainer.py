"""The training loop, framework-agnostic, task-agnostic and resumable.

What is trained is a task's business (``lora_core.train.tasks``: examples, batches, the
update's loss, evaluation, adapter files): ``LMTask`` for the NLG experiments (the default),
``ClassificationTask`` for DistilBERT on SST-2. The loop below never looks inside an example.

For the NLG experiments it has the semantics of the LoRA paper's ``examples/NLG/src/gpt2_ft.py`` (microsoft/LoRA), through the
backend contract only (``AdamW``, ``train_step``, ``eval_nll``, ``manual_seed``,
``lora_state_dict``, ``load_partial``): batches of ``batch_size`` examples in a seeded
order per epoch, ``epochs x ceil(N / batch_size)`` updates, the lr of update ``s`` (0-based)
``lr_at(s, ...)``, label-smoothed loss on completion tokens, optional clipping and gradient
accumulation, validation NLL / perplexity every ``eval_every`` updates.

Differences from the paper code, on purpose:
- dynamic padding (``pad_to`` restores the 512-token batches);
- validation NLL is averaged over tokens (the paper averages per-batch means);
- with ``grad_accum`` the schedule counts optimizer updates (the paper steps its scheduler
  per micro-batch, so its ``--warmup_step`` is in micro-batches);
- checkpoints hold the adapter only, plus what an exact resume needs (with
  ``cfg.method == "full"``: the whole model, ``lora_core.train.full_ft``).

Exact resume. Everything random is a function of ``(seed, epoch)`` or ``(seed, step)``: the
data order is ``numpy.random.default_rng([seed, epoch]).permutation(N)``, and the framework
RNG is reseeded with ``seed * 1_000_003 + step`` before every update (dropout masks). A
checkpoint ``OUT/ckpt-{step}/`` holds the adapter (``save_adapter``), the optimizer moments
(``trainer_state.safetensors``) and ``trainer_state.json`` (step, epoch, batch position in
the epoch, schedule, RNG recipe, data fingerprint). It is written in a hidden temp folder
renamed into place, then the ``OUT/latest`` pointer is replaced atomically; temp leftovers
of a killed run are ignored and removed. A resumed run therefore ends with the same
weights as an uninterrupted one, bit for bit on the same machine and backend. A latest
checkpoint damaged afterwards (a cut copy) stops ``resume`` with an error naming the damage
and the newest intact earlier checkpoint, which ``resume_from`` then continues from.

Several processes (``torchrun``, ``mpirun``; ``comm`` from ``lora_core.train.distributed.start_job``):
the same updates as one process on the same global batch (``lora_core.train.distributed``); rank 0
alone writes the run folder, every rank resumes from it (a shared filesystem).

Outputs in ``OUT``: ``train_config.json``, ``log.jsonl`` (one JSON object per line, ``kind``
``start``/``train``/``eval``), ``ckpt-{step}/``, ``latest``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
import types
from pathlib import Path

import numpy as np

from ..lora.dropout import NumpyDropout
from ..lora.injection import injection_of
from ..lora.layers import lora_layers
from ..progress import step_bar
from .data_order import dropout_seed, epoch_batches, steps_per_epoch, total_steps
from .distributed import Comm, DistributedError, ShardedDropout, check_shardable, run_hash, shard_step
from .full_ft import FullFineTuning
from .precision import precision_log
from .recipes import TrainConfig
from .run_dir import (
    LATEST_FILE,
    LOG_FILE,
    find_checkpoint,
    open_run_dir,
    read_checkpoint,
    read_log,
    truncate_log,
    write_checkpoint,
)
from .schedule import lr_at
from .tasks import LMTask, task_for

__all__ = [
    "Trainer",
    "train",
    "epoch_batches",
    "steps_per_epoch",
    "total_steps",
    "dropout_seed",
    "evaluate",
    "find_checkpoint",
    "read_log",
    "LOG_FILE",
    "LATEST_FILE",
]


def _peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(rss / 2**20 if sys.platform == "darwin" else rss / 1024, 1)


# --------------------------------------------------------------------------- evaluation


def evaluate(backend, model, examples, batch_size: int, pad_to: int | None = None, comm: Comm | None = None,
             task=None) -> dict:
    """The task's validation figures over ``examples`` (default task: ``task_for(model)``; for
    the LM, plain NLL per completion token and perplexity), batches in length order (with
    ``comm``: shared by the ranks)."""
    task = task or task_for(model)
    cfg = types.SimpleNamespace(pad_to=pad_to)
    return task.evaluate(backend, model, task.examples(examples), batch_size, cfg, comm)


def _json_finite(value):
    """``value`` with every NaN or infinite float as ``None``: JSON has no such numbers (Python
    writes ``NaN``, which other readers refuse), and a diverged run logs them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_finite(v) for v in value]
    return value


@dataclasses.dataclass
class TrainerState:
    """Position of the run; ``batch_in_epoch`` batches of ``epoch`` (0-based) are done."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    examples_seen: int = 0
    tokens_seen: int = 0
    # the loss sum and updates since the last "train" log record (its ``avg_loss``), so that a run
    # resumed between two records logs the uninterrupted run's average (``run_dir.STATE_SINCE``)
    window_loss: float = 0.0
    window_steps: int = 0


class Trainer:
    """Trains ``model`` (built by ``backend``) with ``cfg``, writing into ``out_dir``.

    Args:
        backend: a backend module (``lora_core.get_backend(name)``).
        model: a LoRA model of that backend: a GPT-2 built with ``lora=`` (``model.config``,
            ``model.lora_config``), or any model after ``inject_lora`` (with the
            classification task).
        cfg: the training recipe.
        out_dir: run folder (created).
        progress: show a tqdm bar (rank 0 only).
        base_note: which base weights the adapter belongs to (stored in its config).
        comm: the job of several processes (``lora_core.train.distributed.start_job``); default one.
        task: what is trained (``lora_core.train.tasks``); default ``task_for(model)``: the
            causal LM for GPT-2, classification for an injected classifier.
    """

    def __init__(
        self,
        backend,
        model,
        cfg: TrainConfig,
        out_dir,
        progress: bool = True,
        base_note: str | None = None,
        comm: Comm | None = None,
        task=None,
    ):
        self.task = task or task_for(model)
        if cfg.method == "full":  # every weight trains; checkpoints hold the whole model
            self.task = FullFineTuning(self.task)
        elif isinstance(self.task, LMTask) and getattr(model, "lora_config", None) is None \
                and injection_of(model) is None:
            raise ValueError("the model has no LoRA: build a GPT-2 with lora=cfg.lora_config(), or call "
                             "inject_lora(model, LoRATargetConfig(...)) first")
        self.task.check_config(cfg, model)
        if cfg.method == "full":
            self.task.check_trainable(backend, model)
        self.backend, self.model, self.cfg = backend, model, cfg
        self.comm = comm or Comm()
        backend.set_precision(model, cfg.precision)  # issue 8: forward passes in cfg.precision
        self.out_dir, self.progress, self.base_note = Path(out_dir), progress and self.comm.world.is_main, base_note
        if self.comm.world.parallel and cfg.dropout_masks == "numpy" and not self.task.sharded_dropout_masks:
            raise ValueError(
                f"dropout_masks='numpy' (parity mode) runs on one process for the {self.task.name} task: "
                "use dropout_masks='framework' with several processes (on the train commands: --set "
                "dropout_masks=framework, or train.dropout_masks=framework where the recipe nests it)"
            )
        self.dp, self.optimizer = None, None
        self.files = self.task.adapter_files(backend, model, base_note)  # before ZeRO shards what it reads
        backend.check_zero(cfg.zero)  # one process too: a stage the backend cannot run is refused by name
        self._weights = None  # the weights each rank loaded (compared in _prepare)
        if self.comm.world.parallel:  # data_parallel may move the model to a GPU and shard it (ZeRO)
            self._weights = backend.weights_fingerprint(model)  # read before ZeRO shards them
            self.dp = backend.data_parallel(model, self.task.loss, cfg.zero)
            self.optimizer = backend.parallel_adamw(self.dp, backend.trainable_parameters(model), cfg.adamw_config())
        else:
            self.optimizer = backend.AdamW(backend.trainable_parameters(model), cfg.adamw_config())
            if cfg.zero:
                print(f"note: ZeRO stage {cfg.zero} on one process shards nothing: this run trains as stage 0 "
                      "(launch several processes with torchrun or mpirun to shard)", file=sys.stderr)  # fmt: skip
        self.state = TrainerState()

    # ---------------------------------------------------------------- run set-up

    def _run_config(self, examples) -> dict:
        train = {k: v for k, v in self.cfg.to_dict().items() if k != "zero"}  # changes no update: resumable
        return {
            "task": self.task.name,
            "train": train,
            **self.task.describe(self.model),
            "base": self.base_note,
            "data": {"n_train": len(examples), "sha256": self.task.fingerprint(examples)},
            # the validation set: a resume over another would log two sets' losses as one curve
            "valid_data": {"n_valid": len(self._valid), "sha256": self.task.fingerprint(self._valid)},
        }

    def _prepare_dir(self, pairs, resume: bool, resume_from=None):
        """Rank 0: ready the folder; returns the checkpoint to resume from (read), or None."""
        found = open_run_dir(self.out_dir, self._run_config(pairs), resume, self.files, resume_from)
        if resume:
            truncate_log(self.out_dir, found[1][2]["step"] if found is not None else 0)
            if found is None:  # as a preemptible job's first start does: said, not an error
                print(f"note: resume: {self.out_dir} holds no checkpoint yet; starting at step 0", file=sys.stderr)
        return None if found is None else found[1]

    def _prepare(self, pairs, resume: bool, resume_from=None) -> None:
        """Check that every rank runs the same code and configuration, let rank 0 prepare the
        folder (one error on every rank if it fails), then load the checkpoint on the others."""
        comm = self.comm
        check_shardable(len(pairs), self.cfg.batch_size, self.cfg.grad_accum, self.cfg.last_batch, comm.world.size)
        if comm.world.parallel:
            run = {**self._run_config(pairs), "zero": self.cfg.zero}
            comm.check_same("run configuration or code", run_hash(run, self.backend.NAME))
            comm.check_same("model's weights as loaded (the base checkpoint: the same files on every rank)",
                            self._weights)
        found = comm.on_main(self._prepare_dir, pairs, resume, resume_from)  # resume_from: latest points at it after
        ckpt = find_checkpoint(self.out_dir) if resume and not comm.world.is_main else None
        if ckpt is not None:
            found = read_checkpoint(ckpt, self.files)
        if resume and comm.world.parallel:  # each rank found OUT/latest in its own view of the folder
            self._check_same_start(found)
        if found is not None:  # on every rank at once (with ZeRO, loading is a collective)
            self._restore(*found)

    def _check_same_start(self, found) -> None:
        """Every rank resumes from the same step: each reads ``OUT/latest`` itself, so an out-dir
        that is not one folder shared by all ranks (node-local disks, another ``--out-dir`` per
        rank) would mix a resumed rank 0 with ranks starting over."""
        step = -1 if found is None else int(found[2]["step"])
        steps = [int(r[0]) for r in self.comm.all_gather([step])]
        if len(set(steps)) > 1:
            seen = ", ".join(f"rank {r}: {'no checkpoint' if s < 0 else f'step {s}'}" for r, s in enumerate(steps))
            raise DistributedError(
                f"resume: the ranks found different checkpoints in {self.out_dir} ({seen}): every rank reads "
                "OUT/latest, so OUT must be one folder shared by all ranks (shared storage across machines, "
                "the same --out-dir)"
            )

    def _log(self, record: dict) -> None:
        if not self.comm.world.is_main:
            return
        with open(self.out_dir / LOG_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(_json_finite(record), allow_nan=False) + "\n")

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self, total: int) -> Path:
        """Write ``OUT/ckpt-{step}`` (temp folder + rename), then point ``OUT/latest`` at it."""
        s, cfg = self.state, self.cfg
        meta = {
            **dataclasses.asdict(s),
            "total_steps": total,
            "schedule": {
                "kind": cfg.schedule,
                "base_lr": cfg.lr,
                "warmup": cfg.warmup,
                "max_step": total,
                "next_lr": lr_at(s.step, cfg.lr, cfg.warmup, total, cfg.schedule),
            },
            "rng": {
                "seed": cfg.seed,
                "data_order": "numpy default_rng([seed, epoch]).permutation(n)",
                "dropout": f"manual_seed(seed * 1000003 + step), next {dropout_seed(cfg.seed, s.step)}",
            },
            "backend": self.backend.NAME,
            "world_size": self.comm.world.size,
        }
        with self._whole():
            tensors = self.task.trained_tensors(self.backend, self.model)
        return self.comm.on_main(
            write_checkpoint, self.out_dir, s.step, self.files, tensors, self.optimizer.state_numpy(), meta
        )

    def load_checkpoint(self, path) -> None:
        """Restore adapter, optimizer moments and position from a checkpoint folder (strict)."""
        self._restore(*read_checkpoint(path, self.files))

    def _whole(self, write: bool = False):
        """Every parameter whole inside (ZeRO: gathered; ``backend.full_parameters``)."""
        return self.backend.full_parameters(self.dp, write) if self.dp is not None else contextlib.nullcontext()

    def _restore(self, tensors: dict, opt: dict, meta: dict) -> None:
        with self._whole(write=True):
            self.model.load_partial(tensors)
        self.optimizer.load_state_numpy(opt)
        self.state = TrainerState(**{f.name: meta[f.name] for f in dataclasses.fields(TrainerState)})

    # ---------------------------------------------------------------- the loop

    def fit(
        self, train_examples, valid_examples=None, resume: bool = False, kill_after: int | None = None, resume_from=None
    ) -> dict:
        """Train to ``total_steps``; returns a summary (last step, loss, valid NLL, checkpoint).

        Args:
            train_examples, valid_examples: the task's examples (LM: ``(context_ids,
                completion_ids)`` pairs or ``read_encoded`` records; classification:
                ``(token_ids, label)`` or ``{"ids", "label"}`` records). No training example,
                or an empty validation set (``None``: no validation), raises ``ValueError``.
            resume: continue from ``OUT/latest`` (a fresh start if none was saved yet); a
                damaged latest checkpoint raises ``CheckpointError`` naming the newest
                intact one.
            resume_from: continue from this ``OUT/ckpt-N`` folder instead (implies
                ``resume``); ``OUT/latest`` is pointed at it.
            kill_after: test hook: after update N (and its log and checkpoint) the process
                kills itself with SIGKILL, as a crash would.
        """
        cfg, be, model = self.cfg, self.backend, self.model
        pairs = self.task.examples(train_examples)
        if not pairs:  # before the run folder: an epoch of no updates has no length
            raise ValueError(f"the training set is empty: no {self.task.name} example to train on")
        if valid_examples is not None and len(valid_examples) == 0:
            raise ValueError("the validation set is empty: give valid_examples=None to train without validation")
        valid = self.task.examples(valid_examples or [])[: cfg.eval_limit]
        if steps_per_epoch(len(pairs), cfg.batch_size, cfg.last_batch) == 0:
            raise ValueError(f"batch_size={cfg.batch_size} with last_batch='drop' leaves no batch: the training set "
                             f"holds {len(pairs)} examples (lower batch_size, or last_batch 'keep' or 'fill')")  # fmt: skip
        self.task.check(pairs, model, "training example")
        self.task.check(valid, model, "validation example")
        if cfg.pad_to is not None:  # every row padded to pad_to input tokens: none may be longer
            longest = max(self.task.sizes(e)[1] for e in pairs + valid)
            if longest > cfg.pad_to:
                raise ValueError(f"pad_to={cfg.pad_to}: the data holds an example of {longest} input tokens; raise "
                                 f"pad_to to at least {longest} or leave it unset (rows padded to the batch's longest)")
        self._valid = valid  # (what _run_config records of it)
        self._prepare(pairs, resume or resume_from is not None, resume_from)
        total, per_epoch = total_steps(cfg, len(pairs)), steps_per_epoch(len(pairs), cfg.batch_size, cfg.last_batch)
        s = self.state
        self._log(
            {
                "kind": "start",
                "step": s.step,
                "backend": be.NAME,
                "task": self.task.name,
                "resumed": s.step > 0,
                "total_steps": total,
                "steps_per_epoch": per_epoch,
                "n_train": len(pairs),
                "n_valid": len(valid),
                "trainable": be.count_trainable(model),
                "world_size": self.comm.world.size,
            }
        )
        masks = None
        if cfg.dropout_masks == "numpy":
            masks = ShardedDropout(cfg.seed) if self.dp is not None else NumpyDropout(cfg.seed)
        be.set_dropout_source(model, masks)
        be.reset_peak_gpu(model)  # the run's own peak in log.jsonl, not the process's
        try:
            return self._loop(pairs, valid, total, per_epoch, kill_after, masks)
        finally:
            be.set_dropout_source(model, None)

    def _loop(self, pairs, valid, total: int, per_epoch: int, kill_after: int | None, masks) -> dict:
        cfg, be, s = self.cfg, self.backend, self.state
        bar = step_bar(total, s.step, f"train[{be.NAME}]", self.progress)
        window = dict(n=0, time=0.0, examples=0, tokens=0)  # this process's updates since the last record
        result = {}
        while s.step < total:
            batches = epoch_batches(len(pairs), cfg.batch_size, cfg.seed, s.epoch, cfg.last_batch)
            for b in range(s.batch_in_epoch, len(batches)):
                t0 = time.perf_counter()
                idx = batches[b]
                lr = lr_at(s.step, cfg.lr, cfg.warmup, total, cfg.schedule)
                world = self.comm.world  # framework masks: one stream per (step, rank); exact parity needs numpy masks
                be.manual_seed(dropout_seed(cfg.seed, s.step) * world.size + world.rank)
                if masks is not None:
                    masks.reseed(s.step)
                out, tokens = self._update(pairs, idx, lr, masks)
                dt = time.perf_counter() - t0
                s.step, s.batch_in_epoch = s.step + 1, b + 1
                s.examples_seen, s.tokens_seen = s.examples_seen + len(idx), s.tokens_seen + tokens
                if s.batch_in_epoch == len(batches):
                    s.epoch, s.batch_in_epoch = s.epoch + 1, 0
                for k, v in (("n", 1), ("time", dt), ("examples", len(idx)), ("tokens", tokens)):
                    window[k] += v
                s.window_loss, s.window_steps = s.window_loss + out["loss"], s.window_steps + 1
                bar.update(1)
                bar.set_postfix(loss=f"{out['loss']:.3f}", lr=f"{lr:.2e}", refresh=False)
                result = self._after_step(out, lr, window, total, per_epoch, valid)
                if s.step == kill_after and self.comm.world.rank == self.comm.world.size - 1:
                    bar.close()
                    os.kill(os.getpid(), signal.SIGKILL)
                if s.step >= total:
                    break
        bar.close()
        return {
            "step": s.step,
            "epoch": round(s.step / per_epoch, 4),
            **{k: v for k, v in result.items() if k != "kind"},
            "checkpoint": str(find_checkpoint(self.out_dir)),
            "log": str(self.out_dir / LOG_FILE),
        }

    def _update(self, pairs, idx, lr: float, masks) -> tuple[dict, int]:
        """One optimizer update on the global batch ``idx``; returns the backend's result (global
        loss) and the batch's real input tokens."""
        cfg, be, model, task = self.cfg, self.backend, self.model, self.task
        if self.dp is None:
            micro = [
                task.collate([pairs[i] for i in chunk], cfg, model)
                for chunk in np.array_split(idx, min(cfg.grad_accum, len(idx)))
            ]
            out = task.train_step(be, model, self.optimizer, micro, lr, cfg)
            return out, int(sum(int(mb["n_tokens"]) for mb in micro))
        shard = shard_step(idx, pairs, cfg.grad_accum, self.comm.world, task.sizes)
        if masks is not None:
            masks.plan(shard.dropout_rows, sum(1 for m in lora_layers(model) if getattr(m, "p", 0) > 0))
        micro = [task.collate([pairs[i] for i in c], cfg, model) for c in shard.chunks]
        out = be.parallel_train_step(
            self.dp, self.optimizer, micro, shard.weights, lr, cfg.label_smooth, cfg.max_grad_norm
        )
        out["loss"] = float(self.comm.all_reduce_sum([out["loss"]])[0])
        return out, shard.tokens

    def _after_step(self, out: dict, lr: float, window: dict, total: int, per_epoch: int, valid) -> dict:
        """Log, evaluate and save as the schedule of ``log_every``/``eval_every``/``save_every`` says."""
        cfg, s = self.cfg, self.state
        result = {"loss": out["loss"]}
        if s.step % cfg.log_every == 0 or s.step == total:
            w, world = window, self.comm.world
            memory = {"peak_rss_mb": _peak_rss_mb(), "peak_gpu_mb": self.backend.peak_gpu_mb(self.model)}
            if world.parallel:  # every rank's peak, gathered (a collective: all ranks log the same steps)
                memory["peak_rss_mb_per_rank"] = self.comm.all_gather([memory["peak_rss_mb"] or 0.0])[:, 0].tolist()
            norm = out.get("grad_norm")
            self._log(
                {
                    "kind": "train",
                    "step": s.step,
                    "epoch": round(s.step / per_epoch, 4),
                    "lr": lr,
                    "loss": out["loss"],
                    "avg_loss": s.window_loss / s.window_steps,
                    "grad_norm": norm,  # NaN (a step fp16 skipped): null, as every non-finite value
                    "ms_per_batch": 1000 * w["time"] / w["n"],
                    "examples_per_s": w["examples"] / w["time"],
                    "tokens_per_s": w["tokens"] / w["time"],
                    **memory,
                    **precision_log(self.optimizer),  # fp16: skipped_steps, loss_scale
                }
            )
            window.update(n=0, time=0.0, examples=0, tokens=0)
            s.window_loss, s.window_steps = 0.0, 0
        final = s.step == total  # evaluated before the last checkpoint: a run killed between the two
        # resumes from an earlier one and evaluates again, never ends saved without its final evaluation
        if valid and (final or cfg.eval_every and s.step % cfg.eval_every == 0):
            result.update(self._evaluate(valid, per_epoch))
        if final or cfg.save_every and s.step % cfg.save_every == 0:
            self.save_checkpoint(total)
        return result

    def _evaluate(self, valid, per_epoch: int) -> dict:
        t0 = time.perf_counter()
        with self.backend.evaluation(self.dp) if self.dp is not None else contextlib.nullcontext(False) as every:
            comm = None if every else self.comm  # every rank runs every batch (torch ZeRO: FSDP gathers per block)
            res = self.task.evaluate(self.backend, self.model, valid, self.cfg.eval_batch_size, self.cfg, comm)
        self._log(
            {
                "kind": "eval",
                "step": self.state.step,
                "epoch": round(self.state.step / per_epoch, 4),
                **res,
                "eval_s": round(time.perf_counter() - t0, 3),
            }
        )
        return res


def train(
    backend,
    model,
    train_examples,
    valid_examples,
    cfg: TrainConfig,
    out_dir,
    resume: bool = False,
    max_steps: int | None = None,
    progress: bool = True,
    base_note: str | None = None,
    kill_after: int | None = None,
    resume_from=None,
    comm: Comm | None = None,
    task=None,
) -> dict:
    """Train ``model`` with ``cfg`` into ``out_dir``; see :class:`Trainer` and :meth:`Trainer.fit`.

    ``max_steps`` is shorthand for ``cfg.max_steps`` (the run's length and the schedule's end).
    """
    if max_steps is not None:
        cfg = dataclasses.replace(cfg, max_steps=max_steps)
    trainer = Trainer(backend, model, cfg, out_dir, progress=progress, base_note=base_note, comm=comm, task=task)
    return trainer.fit(train_examples, valid_examples, resume=resume, kill_after=kill_after, resume_from=resume_from)
