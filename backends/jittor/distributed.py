"""Data parallelism for Jittor: ``mpirun`` and jittor's MPI ops (``Var.mpi_all_reduce``; NCCL
on GPUs); contract in ``backends.torch.distributed``, semantics in ``lora_core.train.distributed``."""

from __future__ import annotations

import jittor as jt
import numpy as np

from lora_core.train.distributed import DistributedError, World, pick_loss

from .classify import cls_loss
from .lora import assign_keep_grad, trainable_parameters
from .train import lm_loss


def init_process_group(world: World, timeout_s: float = 300.0) -> None:
    """Check that jittor runs inside the ``mpirun`` job described by ``world`` (MPI itself was
    initialised by jittor at import). ``timeout_s`` is not used: ``mpirun`` ends the whole job
    when a rank dies."""
    if world.launcher != "mpirun":
        raise DistributedError(
            f"the jittor backend runs several processes under mpirun (found a {world.launcher} job): "
            "mpirun -np N python -m examples.nlg.train --backend jittor ..."
        )
    if jt.compile_extern.mpi is None:
        raise DistributedError(
            "jittor found no MPI (mpicc): install Open MPI (apt-get install openmpi-bin libopenmpi-dev)"
        )
    if not jt.in_mpi or (jt.rank, jt.world_size) != (world.rank, world.size):
        raise DistributedError(
            f"jittor's MPI sees rank {jt.rank} of {jt.world_size}, the environment says {world.rank} of {world.size}"
        )


def all_reduce_sum(x: np.ndarray) -> np.ndarray:
    """Element-wise sum of ``x`` over all ranks (float64)."""
    x = jt.array(np.ascontiguousarray(x, dtype=np.float64), dtype="float64")  # else jittor makes it float32
    return x.mpi_all_reduce("add").numpy()


class _DataParallel:
    """The model and what the update needs; gradients are summed with one fused all-reduce."""

    def __init__(self, model, loss: str):
        self.model, self.loss = model, pick_loss(loss, lm_loss, cls_loss)


def data_parallel(model, loss: str = "lm"):
    """A handle over ``model`` for ``parallel_train_step``; the trainable (LoRA) parameters
    are broadcast from rank 0 once, so every rank starts from the same values."""
    with jt.no_grad():
        for p in trainable_parameters(model).values():
            assign_keep_grad(p, p.mpi_broadcast(0))
    return _DataParallel(model, loss)


def _all_reduce_grads(optimizer) -> None:
    grads = optimizer.grads
    names = list(grads)
    flat = jt.concat([grads[n].reshape(-1) for n in names]).mpi_all_reduce("add")
    out, at = {}, 0
    for n in names:
        size = int(np.prod(grads[n].shape))
        out[n] = flat[at : at + size].reshape(grads[n].shape).stop_grad()
        at += size
    jt.sync(list(out.values()))
    optimizer.grads = out


def parallel_train_step(
    wrapper,
    optimizer,
    micro_batches: list,
    weights: list,
    lr: float,
    label_smooth: float = 0.0,
    max_grad_norm: float = 0.0,
) -> dict:
    """One update: micro-batch ``k`` contributes ``weights[k] x`` its mean loss; the summed
    gradients are all-reduced (added) over ranks before clipping and the AdamW step."""
    model = wrapper.model
    model.train()
    total = 0.0
    for mb, w in zip(micro_batches, weights):
        loss = wrapper.loss(model, mb, label_smooth)
        optimizer.backward(loss, w)
        total += w * float(loss.item())
    _all_reduce_grads(optimizer)
    norm = optimizer.clip_grad_norm(max_grad_norm) if max_grad_norm > 0 else float("nan")
    optimizer.step(lr)
    return {"loss": total, "grad_norm": norm}


def shutdown_process_group() -> None:
    """Nothing to leave: MPI is finalised by jittor at exit."""


__all__ = ["all_reduce_sum", "data_parallel", "init_process_group", "parallel_train_step", "shutdown_process_group"]
