"""AdamW of the LoRA paper's code in PyTorch; the math is documented in ``lora_core.train.optim``.

Contract (same in every backend): ``AdamW(named_params, cfg)``; ``backward(loss, scale)``
accumulates gradients; ``clip_grad_norm(max_norm)``; ``step(lr)`` applies one update and
clears the gradients; ``grads_numpy()``; ``state_numpy()``/``load_state_numpy()``.
With ``cfg.loss_scale`` (fp16): ``backward`` scales the loss by the current loss scale, the
gradients are unscaled once before clipping or the update, and ``step`` skips an update whose
gradients are not finite (``lora_core.train.precision.DynamicLossScale``; ``loss_scale`` attribute).
Parameters may be FSDP2 ``DTensor`` shards (ZeRO, ``backends.torch.distributed``): the update
acts on this rank's shard, the norm sums the shards, ``*_numpy`` gather whole tensors (collectives).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lora_core.train.optim import AdamWConfig, decays, pack_state, step_size, unpack_state
from lora_core.train.precision import DynamicLossScale


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (the same storage), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: torch.Tensor) -> np.ndarray:
    """numpy copy of the whole tensor (a ``DTensor`` is all-gathered)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().numpy().copy()


def _copy_whole(dst: torch.Tensor, src: np.ndarray) -> None:
    """Copy the whole value ``src`` into ``dst`` (a ``DTensor``: its Shard(0) piece only)."""
    src = torch.from_numpy(src)
    if isinstance(dst, DTensor):
        pieces = torch.chunk(src, dst.device_mesh.size(), dim=0)
        rank = dst.device_mesh.get_local_rank()
        if rank < len(pieces):
            dst.to_local().copy_(pieces[rank])
    else:
        dst.copy_(src)


GROUP_BYTES = 64 * 2**20  # a multi-tensor update's parameters (AdamW._groups)


class AdamW:
    """AdamW over the given ``{name: parameter}`` (only those train; no state for others)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], cfg: AdamWConfig = AdamWConfig()):
        self.params, self.cfg, self.t = dict(params), cfg, 0
        self.decay = {n: decays(n, tuple(p.shape), cfg.decay) for n, p in self.params.items()}
        self.m = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.loss_scale = DynamicLossScale(cfg.loss_scale) if cfg.loss_scale is not None else None
        self._finite: bool | None = None  # set when the scaled gradients have been unscaled
        self._grouped: list[list[str]] | None = None  # _groups()

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        """Add ``scale * d loss / d p`` to the gradients of the trained parameters."""
        if self.loss_scale is not None:
            scale *= self.loss_scale.scale
        (loss * scale if scale != 1.0 else loss).backward()

    @torch.no_grad()
    def _unscale(self) -> bool:
        """Divide loss-scaled gradients by the scale (once per update); True if all are finite."""
        if self.loss_scale is None:
            return True
        if self._finite is None:
            grads = [p.grad for p in self.params.values() if p.grad is not None]
            device = next(iter(self.params.values())).device  # NCCL reduces device tensors
            finite = torch.tensor([all(bool(torch.isfinite(_local(g)).all()) for g in grads)], dtype=torch.int32,
                                  device=device)  # fmt: skip
            if any(isinstance(p, DTensor) for p in self.params.values()):  # ZeRO: each rank sees its shard
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # one decision for every rank
            self._finite = bool(finite.item())
            for g in grads:
                g.mul_(1.0 / self.loss_scale.scale)
        return self._finite

    def _grads(self):
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in self.params.items()}

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before."""
        self._unscale()
        whole = list(self._grads().values())
        grads, sharded = [_local(g) for g in whole], [isinstance(g, DTensor) for g in whole]
        sq = torch.zeros(2, dtype=torch.float64, device=grads[0].device if grads else None)
        for g, s in zip(grads, sharded):
            sq[int(s)] += (g.double() ** 2).sum()
        if any(sharded):
            dist.all_reduce(sq[1:])  # shards: summed over ranks
        norm = torch.sqrt(sq.sum()).item()
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for g in grads:
                g.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One update with learning rate ``lr``, then clear the gradients (with loss scaling: no
        update when the gradients are not finite)."""
        finite = self._unscale()
        self._finite = None
        if self.loss_scale is not None and not self.loss_scale.update(finite):
            self.zero_grad()
            return
        self.t += 1
        b1, b2 = self.cfg.betas
        size = step_size(lr, self.t, self.cfg)
        for names in self._groups():
            ps = [_local(self.params[n]) for n in names]
            gs = [_local(self.params[n].grad) if self.params[n].grad is not None else torch.zeros_like(p)
                  for n, p in zip(names, ps)]  # fmt: skip
            ms, vs = [_local(self.m[n]) for n in names], [_local(self.v[n]) for n in names]
            torch._foreach_mul_(ms, b1)
            torch._foreach_add_(ms, gs, alpha=1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
            den = torch._foreach_sqrt(vs)
            torch._foreach_add_(den, self.cfg.eps)
            torch._foreach_addcdiv_(ps, ms, den, value=-size)
            del den
            decayed = [p for n, p in zip(names, ps) if self.decay[n]]
            if self.cfg.weight_decay > 0 and decayed:
                torch._foreach_add_(decayed, decayed, alpha=-lr * self.cfg.weight_decay)
            for n in names:
                self.params[n].grad = None

    def _groups(self) -> list[list[str]]:
        """The parameters in groups of at most ``GROUP_BYTES`` (a larger one alone), in order: each
        group's update is one multi-tensor (``torch._foreach_*``) call per operation, the same
        element-wise arithmetic as one call per tensor (on the CPU PyTorch runs exactly those), a
        few kernel launches for all of LoRA's adapters on a GPU instead of 7 per tensor; the
        denominators ``sqrt(v) + eps`` of one group at a time (no copy of every moment at once)."""
        if self._grouped is None:
            self._grouped, size = [], GROUP_BYTES
            for n, p in self.params.items():
                nbytes = _local(p).numel() * _local(p).element_size()
                if size + nbytes > GROUP_BYTES:
                    self._grouped.append([])
                    size = 0
                self._grouped[-1].append(n)
                size += nbytes
        return self._grouped

    def zero_grad(self) -> None:
        self._finite = None
        for p in self.params.values():
            p.grad = None

    def grads_numpy(self) -> dict[str, np.ndarray]:
        return {n: _whole(g) for n, g in self._grads().items()}

    def state_numpy(self) -> dict:
        """Moments and step count as one flat numpy dict (``lora_core.train.optim.pack_state``)."""
        state = pack_state({n: _whole(t) for n, t in self.m.items()}, {n: _whole(t) for n, t in self.v.items()}, self.t)
        return state if self.loss_scale is None else {**state, **self.loss_scale.state_numpy()}

    @torch.no_grad()
    def load_state_numpy(self, state: dict) -> None:
        if self.loss_scale is not None:
            state = self.loss_scale.load_state_numpy(state)
        m, v, self.t = unpack_state(list(self.params), state)
        for n in self.params:
            _copy_whole(self.m[n], m[n])
            _copy_whole(self.v[n], v[n])
