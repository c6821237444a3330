"""Data parallelism without tensors: who this process is, which examples are its own, and how
the processes of one job agree (configuration hash, errors, beam outputs).

The engines do the communication: ``torchrun`` + ``torch.distributed`` (gloo on CPU, NCCL on
GPUs) and ``mpirun`` + jittor's MPI ops. Each backend's ``distributed`` module offers the same
few tensor operations (``init_process_group``, ``all_reduce_sum``, ``data_parallel``,
``parallel_train_step``, ``shutdown``); :class:`Comm` builds everything else here on their
``all_reduce_sum``.

Semantics (the one-process run is the reference). Update ``s`` uses the same global batch
``idx`` whatever the number of processes ``N``: ``idx`` is cut into the same micro-batches as
in one process (``np.array_split(idx, min(grad_accum, len(idx)))``), and each micro-batch into
``N`` contiguous shards (``np.array_split`` again, so uneven batches give shards that differ
by one example). A rank weighs its shard's mean loss by ``local positions / global positions
/ micro-batches``; the sum over ranks of the weighted gradients is then exactly the gradient of
the one-process update (mean over each micro-batch's loss positions, averaged over
micro-batches), and clipping and AdamW act on that global gradient on every rank. LoRA dropout
masks in ``numpy`` mode: :class:`ShardedDropout` draws the whole micro-batch's mask from the
one-process stream and keeps this rank's rows (the packed rows of its examples).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..lora.dropout import NumpyDropout

__all__ = [
    "World",
    "Comm",
    "StepShard",
    "ShardedDropout",
    "DistributedError",
    "discover_world",
    "start_job",
    "Job",
    "run_job",
    "report_error",
    "report_exception",
    "shard_range",
    "shard_step",
    "check_shardable",
    "code_version",
    "run_hash",
    "FINGERPRINT_SAMPLES",
    "sample_positions",
    "weights_digest",
    "pack_outputs",
    "unpack_outputs",
    "batch_shard",
    "gather_outputs",
    "LOSSES",
    "pick_loss",
]


LOSSES = ("lm", "cls")  # data_parallel(model, loss=...): lm_loss (GPT-2) or cls_loss (classifiers)


def pick_loss(loss: str, lm_loss, cls_loss):
    """The backend's training loss of one micro-batch for ``data_parallel(model, loss)``, as
    ``f(model, batch, label_smooth)`` (classification takes no label smoothing)."""
    if loss not in LOSSES:
        raise ValueError(f"data_parallel: loss must be one of {sorted(LOSSES)}, got {loss!r}")
    return lm_loss if loss == "lm" else lambda model, batch, _: cls_loss(model, batch)


class DistributedError(RuntimeError):
    """An error every rank of the job raises with the same message."""


@dataclass(frozen=True)
class World:
    """This process's place in the job: ``rank`` of ``size`` (``local_rank`` on its machine)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    launcher: str = "none"  # "torchrun", "mpirun" or "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.size > 1


def _env_int(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def discover_world(env=None) -> World:
    """The job from the launcher's environment: ``torchrun`` sets ``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``; Open MPI's ``mpirun`` sets ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``.
    Neither: one process."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env and "RANK" in env:
        names, launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK"), "torchrun"
    elif "OMPI_COMM_WORLD_SIZE" in env:
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
        launcher = "mpirun"
    else:
        return World()
    rank, size = _env_int(env, names[0]), _env_int(env, names[1])
    local = _env_int(env, names[2]) if names[2] in env else rank
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{names[0]}={rank}, {names[1]}={size}: the rank must be in [0, world size)")
    return World(rank, size, local, launcher)


def shard_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``rank`` when ``n`` items are cut into ``size`` contiguous
    shards as ``np.array_split`` does (the first ``n % size`` shards have one more)."""
    q, r = divmod(n, size)
    start = rank * q + min(rank, r)
    return start, start + q + (rank < r)


# --------------------------------------------------------------------------- training batches


@dataclass
class StepShard:
    """This rank's part of one update.

    ``chunks``: example indices of each micro-batch shard; ``weights``: their loss weights
    (``local positions / global positions / micro-batches``); ``dropout_rows``: per
    micro-batch ``(global packed rows, offset of this shard's rows, local rows)``;
    ``examples``/``tokens``: the whole global batch's examples and real input tokens."""

    chunks: list[np.ndarray]
    weights: list[float]
    dropout_rows: list[tuple[int, int, int]]
    examples: int
    tokens: int


def _lm_sizes(pair) -> tuple[int, int]:
    """(loss positions, input tokens) of a ``(context, completion)`` pair: the completion
    tokens, and the model reads seq[:-1]."""
    return len(pair[1]), len(pair[0]) + len(pair[1]) - 1


def shard_step(idx: np.ndarray, examples, grad_accum: int, world: World, sizes=_lm_sizes) -> StepShard:
    """Cut the global batch ``idx`` of ``examples`` for ``world``; ``sizes(example)`` gives
    its (loss positions, input tokens) (default: ``(context, completion)`` pairs; a task's
    ``sizes`` otherwise). Micro-batch weights follow the loss positions."""
    micro = np.array_split(idx, min(grad_accum, len(idx)))
    chunks, weights, rows = [], [], []
    for chunk in micro:
        a, b = shard_range(len(chunk), world.size, world.rank)
        if a == b:
            raise ValueError(f"a micro-batch of {len(chunk)} examples cannot give each of {world.size} processes one")
        positions, tokens = zip(*(sizes(examples[i]) for i in chunk))
        chunks.append(chunk[a:b])
        weights.append(sum(positions[a:b]) / sum(positions) / len(micro))
        rows.append((sum(tokens), sum(tokens[:a]), sum(tokens[a:b])))
    total = int(sum(sizes(examples[i])[1] for i in idx))
    return StepShard(chunks, weights, rows, len(idx), total)


def check_shardable(n: int, batch_size: int, grad_accum: int, last_batch: str, world_size: int) -> None:
    """Refuse (ValueError) a world size that would leave a process without examples in some
    micro-batch: every micro-batch needs at least ``world_size`` examples."""
    sizes = {batch_size}
    rest = n % batch_size
    if rest and last_batch == "keep":
        sizes.add(rest)
    for size in sorted(sizes):
        smallest = size // min(grad_accum, size)
        if smallest < world_size:
            raise ValueError(
                f"{world_size} processes cannot share a batch of {size} examples in {min(grad_accum, size)} "
                f"micro-batch(es) (the smallest has {smallest}): every micro-batch needs at least one example "
                f"per process; use fewer processes, a larger batch_size or a smaller grad_accum"
                + (
                    f" (the last batch of an epoch has {rest}: last_batch=fill or drop avoids it)"
                    if size == rest
                    else ""
                )
            )


class ShardedDropout(NumpyDropout):
    """The one-process ``NumpyDropout`` stream seen from one rank: each LoRA layer's mask is
    drawn for the whole micro-batch (all ranks' packed rows) and this rank keeps its rows.

    ``plan(rows, calls)`` before an update: ``rows`` = ``StepShard.dropout_rows``, ``calls`` =
    masks drawn per forward (LoRA layers with dropout); a mask of unexpected shape raises."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.rows: list[tuple[int, int, int]] = []
        self.calls, self.count = 1, 0

    def plan(self, rows: list[tuple[int, int, int]], calls: int) -> None:
        self.rows, self.calls, self.count = list(rows), max(calls, 1), 0

    def mask(self, shape: tuple[int, ...], p: float) -> np.ndarray:
        micro = self.count // self.calls
        if micro >= len(self.rows):
            raise RuntimeError(
                f"ShardedDropout: mask {self.count} requested past the plan of {len(self.rows)} micro-batches"
            )
        total, offset, local = self.rows[micro]
        if shape[0] != local:
            raise RuntimeError(f"ShardedDropout: mask for {shape[0]} rows, the plan says {local}")
        self.count += 1
        return super().mask((total, *shape[1:]), p)[offset : offset + local]


# --------------------------------------------------------------------------- agreement


def code_version(backend_name: str) -> str:
    """sha256 over the source files that define a run: ``lora_core`` (every subpackage), the
    backend and the example commands, each named by its path in the repository."""
    root = Path(__file__).resolve().parents[2]  # lora_core/train/distributed.py -> the repository
    h = hashlib.sha256()
    files = [f for folder in (root / "lora_core", root / "backends" / backend_name, root / "examples")
             for f in sorted(folder.rglob("*.py"))]  # fmt: skip
    if not files:
        raise RuntimeError(f"code_version: no source files under {root}")
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def run_hash(run_config: dict, backend_name: str) -> str:
    """Hash of a run's configuration (as ``train_config.json`` holds it) and of the code."""
    text = json.dumps(run_config, sort_keys=True) + code_version(backend_name)
    return hashlib.sha256(text.encode()).hexdigest()


FINGERPRINT_SAMPLES = 64  # values read from each tensor for weights_digest


def sample_positions(numel: int, k: int = FINGERPRINT_SAMPLES) -> np.ndarray:
    """Up to ``k`` evenly spaced flat positions of a tensor of ``numel`` elements, the first and
    the last among them (each backend's ``weights_fingerprint`` reads the values there)."""
    if numel <= k:
        return np.arange(numel, dtype=np.int64)
    return np.unique(np.linspace(0, numel - 1, k).round().astype(np.int64))


def weights_digest(items) -> str:
    """sha256 over ``(name, shape, dtype, values)`` of each tensor (``values``: the ones at
    ``sample_positions``, as float64), in name order: the model's weights as each rank loaded
    them, compared between ranks before training (ranks on different base checkpoints, say one
    copy per machine that differs, would each train against its own frozen base: the trained
    values are synchronised, the frozen ones never are)."""
    h = hashlib.sha256()
    for name, shape, dtype, values in sorted(items, key=lambda t: t[0]):
        h.update(f"{name}\0{tuple(shape)}\0{dtype}\0".encode())
        h.update(np.ascontiguousarray(values, dtype=np.float64).tobytes())
    return h.hexdigest()


class Comm:
    """The collectives of one job, built on a backend's ``distributed.all_reduce_sum``.

    With one process (``world.size == 1``) nothing is communicated and ``ops`` may be ``None``.
    """

    def __init__(self, world: World = World(), ops=None):
        if world.parallel and ops is None:
            raise ValueError("a job of several processes needs the backend's distributed module")
        self.world, self.ops = world, ops

    def all_reduce_sum(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        return self.ops.all_reduce_sum(x) if self.world.parallel else x

    def all_gather(self, vec) -> np.ndarray:
        """(size, k): row ``r`` is rank ``r``'s ``vec`` (float64; exact for integers < 2**53)."""
        vec = np.asarray(vec, dtype=np.float64).reshape(-1)
        rows = np.zeros((self.world.size, vec.size))
        rows[self.world.rank] = vec
        return self.all_reduce_sum(rows)

    def barrier(self) -> None:
        self.all_reduce_sum(np.zeros(1))

    def broadcast_text(self, text: str | None) -> str | None:
        """Rank 0's ``text`` (``None`` stays ``None``) on every rank."""
        data = (text or "").encode()[:65536] if self.world.is_main else b""
        n = int(self.all_reduce_sum([len(data) + 1 if self.world.is_main and text is not None else 0])[0])
        if n == 0:
            return None
        buf = np.zeros(n - 1)
        if self.world.is_main:
            buf[:] = np.frombuffer(data, dtype=np.uint8)
        return bytes(self.all_reduce_sum(buf).astype(np.uint8)).decode(errors="replace")

    def on_main(self, fn, *args):
        """Run ``fn(*args)`` on rank 0 only; if it raises, every rank raises the same error
        (``DistributedError`` on the others, the original on rank 0). Also a barrier."""
        error, result = None, None
        if self.world.is_main:
            try:
                result = fn(*args)
            except Exception as e:  # shared with the other ranks, then re-raised
                error = e
        text = self.broadcast_text(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if text is not None:
            raise DistributedError(f"rank 0 failed: {text}")
        return result

    def check_same(self, what: str, digest: str) -> None:
        """Raise on every rank unless all ranks hold the same hex ``digest`` (first 24 bytes)."""
        head = bytes.fromhex(digest[:48])
        vec = [int.from_bytes(head[i : i + 6], "big") for i in range(0, 24, 6)]  # 48-bit pieces
        rows = self.all_gather(vec)
        differ = [r for r in range(self.world.size) if not np.array_equal(rows[r], rows[0])]
        if differ:
            raise DistributedError(
                f"the {what} differs between ranks: rank(s) {differ} do not match rank 0 "
                f"(same code, data and settings are needed on every process)"
            )


def start_job(backend, timeout_s: float = 300.0) -> Comm:
    """Join the job this process belongs to (see :func:`discover_world`) with ``backend``'s
    engine; one process: a :class:`Comm` that communicates nothing."""
    world = discover_world()
    if not world.parallel:
        return Comm(world)
    backend.init_process_group(world, timeout_s)
    return Comm(world, backend)


def report_error(comm: Comm | None, text: str) -> int:
    """Print ``error: text`` (with the rank in a job) and return exit status 1. In a job of
    several processes this process ends here at once, skipping exit handlers: a normal exit
    (``MPI_Finalize``, joining the process group) would wait for ranks that may be blocked in a
    collective, whereas the launcher (``torchrun``, ``mpirun``) ends the whole job when one
    process fails."""
    import sys

    parallel = comm is not None and comm.world.parallel
    where = f"[rank {comm.world.rank}/{comm.world.size}] " if parallel else ""
    print(f"error: {where}{text}", file=sys.stderr, flush=True)
    if parallel:
        sys.stdout.flush()
        os._exit(1)
    return 1


def report_exception(comm: Comm) -> int:
    """:func:`report_error` for an unexpected exception in a job: its traceback, then the end."""
    import traceback

    traceback.print_exc()
    text = "stopped by the exception above (a broken connection means another process of the job failed first)"
    return report_error(comm, text)


class Job:
    """What :func:`run_job` hands a command's body: ``start(backend, timeout_s)`` joins the job
    (:func:`start_job`) and keeps the ``Comm`` for the error report and the end."""

    def __init__(self):
        self.comm: Comm | None = None

    def start(self, backend, timeout_s: float = 300.0) -> Comm:
        self.comm = start_job(backend, timeout_s)
        return self.comm


def run_job(body) -> int:
    """Run a command's ``body(job) -> text`` as one process of a job (or alone); its exit status.

    ``text`` is printed by rank 0 at the end. Bad input (``ValueError``, ``OSError``,
    ``DistributedError``; ``CheckpointError`` and ``DataFormatError`` are ``ValueError``) becomes
    ``error: ...`` and status 1 (:func:`report_error`); another exception is re-raised alone and
    reported with its traceback in a job (:func:`report_exception`). A job's process group is
    shut down after a normal end."""
    job = Job()
    try:
        text = body(job)
    except (ValueError, OSError, DistributedError) as e:
        return report_error(job.comm, str(e))
    except Exception:
        if job.comm is None or not job.comm.world.parallel:
            raise
        return report_exception(job.comm)
    if job.comm.world.parallel:
        job.comm.ops.shutdown_process_group()
    if job.comm.world.is_main:
        print(text)
    return 0


# --------------------------------------------------------------------------- beam outputs


def pack_outputs(outputs: list[list[int]], start: int, total: int, width: int) -> np.ndarray:
    """(total, width + 1) float64: rows ``start..`` hold this rank's token lists (length in
    column 0), the rest zeros, so that a sum over ranks holds every output."""
    buf = np.zeros((total, width + 1))
    for i, toks in enumerate(outputs):
        buf[start + i, 0] = len(toks)
        buf[start + i, 1 : 1 + len(toks)] = toks
    return buf


def unpack_outputs(buf: np.ndarray) -> list[list[int]]:
    return [[int(t) for t in row[1 : 1 + int(row[0])]] for row in buf]


def batch_shard(n: int, batch_size: int, world: World) -> tuple[int, int]:
    """``[start, stop)`` of the items this rank decodes: whole batches of ``batch_size`` (the
    batches of the one-process run, so that each is computed exactly as there), contiguous."""
    n_batches = -(-n // batch_size)
    a, b = shard_range(n_batches, world.size, world.rank)
    return min(a * batch_size, n), min(b * batch_size, n)


def gather_outputs(comm: Comm, outputs: list[list[int]], start: int, total: int) -> list[list[int]]:
    """Every rank's token lists (rank ``r``'s from its ``start``), merged in input order."""
    if not comm.world.parallel:
        return outputs
    width = int(comm.all_gather([max((len(o) for o in outputs), default=0)]).max())
    return unpack_outputs(comm.all_reduce_sum(pack_outputs(outputs, start, total, width)))
