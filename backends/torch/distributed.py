"""Data parallelism for PyTorch: ``torch.distributed`` (gloo on CPU, NCCL on GPUs) and
``DistributedDataParallel``; the semantics are documented in ``lora_core.train.distributed``.

Contract (same in every backend): ``init_process_group(world, timeout_s)``;
``all_reduce_sum(x: np.ndarray) -> np.ndarray``; ``data_parallel(model, loss="lm", zero=0) -> wrapper``
(``loss``: ``"lm"`` for ``lm_loss``, ``"cls"`` for ``cls_loss``; ``zero``: ZeRO stage 0, 2 or 3);
``parallel_adamw(wrapper, params, cfg) -> optimizer`` (built after ``data_parallel``: ZeRO
replaces the parameters by their shards); ``full_parameters(wrapper, write=False)``, a context
in which every parameter is whole on every rank (saving; ``write``: values written
inside are kept, for loading); ``evaluation(wrapper)``, a context for validation forwards that
yields whether every rank must evaluate every batch (else each evaluates its share);
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
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lora_core.train import heap
from lora_core.train.distributed import DistributedError, World, pick_loss, sample_positions, weights_digest

from .classify import cls_loss
from .optim import AdamW
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


def data_parallel(model, loss: str = "lm", zero: int = 0):
    """``DistributedDataParallel`` over ``model`` (moved to this rank's GPU under NCCL). Only
    the trainable (LoRA) parameters are synchronised; the frozen base is neither broadcast
    nor reduced. ``zero`` 2 or 3: PyTorch FSDP2 (``fully_shard``) instead, see :func:`_fsdp`."""
    if getattr(model, "compiled_loss", None) is not None:
        raise ValueError("compile (set_compile, --compile) runs on one process for now: the data-parallel "
                         "step is not compiled; drop --compile with torchrun")
    check_zero(zero)
    if _device().type == "cuda":
        model.to(_device())
    if zero:
        return _fsdp(model, loss, zero)
    frozen = [f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad]
    frozen += [f"model.{n}" for n, _ in model.named_buffers()]
    module = _Loss(model, loss)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen)
    # the gradients are views of DDP's flat buckets, not a second copy beside them (lora_core.plan: System.dp_grad_copies)
    return DistributedDataParallel(module, device_ids=None, gradient_as_bucket_view=True)


def _fsdp(model, loss: str, zero: int):
    r"""ZeRO on FSDP2: every block of the model (each item of its ``nn.ModuleList``\ s) is one
    ``fully_shard`` unit, the loss module around the model the root. Stage 2 shards the
    trained parameters, their gradients and AdamW moments on dim 0 (``reshard_after_forward=
    False``: gathered once per update); the frozen base stays whole on every rank (ignored, as
    with DDP). Stage 3 shards every parameter, frozen ones included, and regathers each block
    in the backward pass; the root (embeddings, final norm, head) stays gathered from its forward
    to its backward (FSDP2's own rule for the root, which applies only when its
    ``reshard_after_forward`` is left unset: set to True, the root was freed after the forward and
    gathered again for the backward, 2 x 62.5 MB more at llama-bench where nothing freed was there to
    reuse: QLoRA-z3). Buffers (the 4-bit layers' packed weights, masks) are never sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(_device().type, (dist.get_world_size(),))
    ignored = set() if zero == 3 else {p for p in model.parameters() if not p.requires_grad}
    module = _Loss(model, loss)
    blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    for b in blocks:
        if any(p.requires_grad or zero == 3 for p in b.parameters()):
            fully_shard(b, mesh=mesh, reshard_after_forward=zero == 3, ignored_params=ignored)
    fully_shard(module, mesh=mesh, reshard_after_forward=None if zero == 3 else False, ignored_params=ignored)
    module.zero = zero
    return module


def check_zero(zero: int) -> None:
    """Refuse a ZeRO stage this backend cannot run (torch: 0, 2 and 3 run)."""
    if zero not in (0, 2, 3):
        raise ValueError(f"data_parallel: zero must be 0, 2 or 3, got {zero!r}")


def weights_fingerprint(model) -> str:
    """``lora_core.train.distributed.weights_digest`` of every tensor of ``model``'s state (a few
    values each, read where they are: no tensor is copied whole)."""
    items = []
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t = t.detach()
            idx = sample_positions(t.numel())
            if t.is_contiguous():
                values = t.reshape(-1)[torch.from_numpy(idx).to(t.device)]
            else:  # a view (a transposed map of the checkpoint): the elements by their indices
                values = t[tuple(torch.from_numpy(i).to(t.device) for i in np.unravel_index(idx, tuple(t.shape)))]
            items.append((name, tuple(t.shape), str(t.dtype), values.float().cpu().numpy()))
    return weights_digest(items)


def parallel_adamw(wrapper, params: dict, cfg):
    """AdamW for a data-parallel run (after ``data_parallel``): with ZeRO the parameters are
    FSDP2's ``DTensor`` shards and ``AdamW`` keeps the moments of this rank's shard only."""
    return AdamW(params, cfg)


@contextlib.contextmanager
def full_parameters(wrapper, write: bool = False):
    """Every parameter whole on every rank inside, for reading and loading them (ZeRO: each
    ``DTensor`` shard is all-gathered into a plain parameter put in its place; a collective);
    ``write``: values written inside are copied into this rank's shards at the end. Not for
    forwards: FSDP's hooks would put the shards back."""
    sharded = [(m, n, p) for m in wrapper.modules() for n, p in m._parameters.items()
               if isinstance(p, DTensor)] if getattr(wrapper, "zero", 0) else []
    copies: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for m, n, p in sharded:
            if id(p) not in copies:  # tied weights stay tied
                copies[id(p)] = torch.nn.Parameter(p.full_tensor().clone(), requires_grad=p.requires_grad)
            m._parameters[n] = copies[id(p)]
    try:
        yield
        if write:
            rank, size = dist.get_rank(), dist.get_world_size()
            with torch.no_grad():
                for m, n, p in sharded:
                    pieces = torch.chunk(m._parameters[n], size, dim=0)  # FSDP2's Shard(0) layout
                    if rank < len(pieces):
                        p.to_local().copy_(pieces[rank])
    finally:
        for m, n, p in sharded:
            m._parameters[n] = p


@contextlib.contextmanager
def evaluation(wrapper):
    """The validation forwards of a data-parallel run, without gradients; yields True when every
    rank must evaluate every batch. ZeRO: FSDP2 gathers each block's shards as the block runs (a
    collective, so the ranks must run the same forwards; ZeRO-3 keeps its per-rank memory bound);
    the root unit, whose forward the evaluation does not call, is gathered here and every unit
    is sharded again at the end, as between updates. Without ZeRO: nothing, each rank evaluates
    its share of the batches."""
    from torch.distributed.fsdp import FSDPModule

    if not getattr(wrapper, "zero", 0):
        with torch.no_grad():
            yield False
        return
    wrapper.unshard()
    try:
        with torch.no_grad():
            yield True
    finally:
        for u in wrapper.modules():
            if isinstance(u, FSDPModule):
                u.reshard()


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
    gradients are reduced once, on the last micro-batch (``no_sync`` before; with ZeRO FSDP2's
    reduce-scatter, which also averages)."""
    wrapper.train()
    size, total = dist.get_world_size(), 0.0
    release_first = _device().type == "cpu" and heap.releases_before_gather(heap.mode(), getattr(wrapper, "zero", 0))
    for k, (mb, w) in enumerate(zip(micro_batches, weights)):
        sync = k == len(micro_batches) - 1
        if getattr(wrapper, "zero", 0):
            wrapper.set_requires_gradient_sync(sync)
        with contextlib.nullcontext() if sync or getattr(wrapper, "zero", 0) else wrapper.no_sync():
            if release_first:  # before FSDP2 gathers the root (lora_core.train.heap)
                heap.release()
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


__all__ = ["all_reduce_sum", "check_zero", "data_parallel", "evaluation", "full_parameters", "init_process_group",
           "parallel_adamw", "parallel_train_step", "shutdown_process_group", "weights_fingerprint"]
