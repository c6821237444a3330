"""Data parallelism for PyTorch: ``torch.distributed`` (gloo on CPU, NCCL on GPUs) and
``DistributedDataParallel``; the semantics are documented in ``lora_core.train.distributed``.

Contract (same in every backend): ``init_process_group(world, timeout_s)``;
``all_reduce_sum(x: np.ndarray) -> np.ndarray``; ``data_parallel(model, loss="lm") -> wrapper``
(``loss``: ``"lm"`` for ``lm_loss``, ``"cls"`` for ``cls_loss``);
``parallel_train_step(wrapper, optimizer, micro_batches, weights, lr, label_smooth,
max_grad_norm) -> dict`` (the ``loss`` it returns is this rank's weighted share: the sum over
ranks is the global loss); ``shutdown_process_group()``.
"""

from __future__ import annotations

import contextlib
import datetime

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lora_core.train.distributed import DistributedError, World, pick_loss

from .classify import cls_loss
from .precision import autocast
from .train import lm_loss


def init_process_group(world: World, timeout_s: float = 300.0) -> None:
    """Join the job started by ``torchrun`` (``env://``): NCCL with one GPU per rank
    (``cuda:LOCAL_RANK``) when CUDA is available, else gloo. ``timeout_s`` bounds the wait for
    the other ranks, at start and in every collective."""
    if world.launcher != "torchrun":
        raise DistributedError(
            f"the torch backend runs several processes under torchrun (found a {world.launcher} job): "
            "torchrun --nproc_per_node N -m examples.nlg.train --backend torch ..."
        )
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() > world.local_rank
    if use_nccl:
        torch.cuda.set_device(world.local_rank)
    try:
        dist.init_process_group(
            "nccl" if use_nccl else "gloo",
            rank=world.rank,
            world_size=world.size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as e:  # DistStoreError, RuntimeError, ...: one message on every rank
        raise DistributedError(
            f"rank {world.rank} of {world.size} could not reach the others within {timeout_s:g} s: {e}"
        ) from e


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(x: np.ndarray) -> np.ndarray:
    """Element-wise sum of ``x`` over all ranks (float64)."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)).to(_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().numpy()


class _Loss(torch.nn.Module):
    """The module DDP wraps: its forward is the training loss of one micro-batch."""

    def __init__(self, model, loss: str):
        super().__init__()
        self.model, self.loss = model, pick_loss(loss, lm_loss, cls_loss)

    def forward(self, batch: dict, label_smooth: float):
        with autocast(self.model):
            return self.loss(self.model, batch, label_smooth)


def data_parallel(model, loss: str = "lm"):
    """``DistributedDataParallel`` over ``model`` (moved to this rank's GPU under NCCL). Only
    the trainable (LoRA) parameters are synchronised; the frozen base is neither broadcast
    nor reduced."""
    if getattr(model, "compiled_loss", None) is not None:
        raise ValueError("compile (set_compile, --compile) runs on one process for now: the data-parallel "
                         "step is not compiled; drop --compile with torchrun")
    if _device().type == "cuda":
        model.to(_device())
    frozen = [f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad]
    frozen += [f"model.{n}" for n, _ in model.named_buffers()]
    module = _Loss(model, loss)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
    return DistributedDataParallel(module, device_ids=None)


def parallel_train_step(
    wrapper,
    optimizer,
    micro_batches: list[dict],
    weights: list[float],
    lr: float,
    label_smooth: float = 0.0,
    max_grad_norm: float = 0.0,
) -> dict:
    """One update: micro-batch ``k`` contributes ``weights[k] x`` its mean loss; DDP averages
    over ranks, so the loss is scaled by the world size to make the average the sum. The
    gradients are reduced once, on the last micro-batch (``no_sync`` before)."""
    wrapper.train()
    size, total = dist.get_world_size(), 0.0
    for k, (mb, w) in enumerate(zip(micro_batches, weights)):
        sync = k == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else wrapper.no_sync():
            loss = wrapper(mb, label_smooth)
            optimizer.backward(loss, w * size)
        total += w * loss.item()
    norm = optimizer.clip_grad_norm(max_grad_norm) if max_grad_norm > 0 else float("nan")
    optimizer.step(lr)
    return {"loss": total, "grad_norm": norm}


def shutdown_process_group() -> None:
    """Leave the process group (a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["all_reduce_sum", "data_parallel", "init_process_group", "parallel_train_step", "shutdown_process_group"]
