"""AdamW of the LoRA paper's code in Jittor; math in ``lora_core.train.optim``, contract in
``backends.torch.optim`` (loss scaling included). Gradients come from ``jt.grad`` and are
accumulated here."""

from __future__ import annotations

import jittor as jt
import numpy as np

from lora_core.train.optim import AdamWConfig, decays, pack_state, step_size, unpack_state
from lora_core.train.precision import DynamicLossScale

from .lora import assign_keep_grad


class AdamW:
    """AdamW over the given ``{name: Var}`` (only those train; no state for others)."""

    def __init__(self, params: dict, cfg: AdamWConfig = AdamWConfig()):
        self.params, self.cfg, self.t = dict(params), cfg, 0
        self.decay = {n: decays(n, tuple(p.shape), cfg.decay) for n, p in self.params.items()}
        self.m = {n: jt.zeros(p.shape).stop_grad() for n, p in self.params.items()}
        self.v = {n: jt.zeros(p.shape).stop_grad() for n, p in self.params.items()}
        self.grads: dict | None = None
        self.loss_scale = DynamicLossScale(cfg.loss_scale) if cfg.loss_scale is not None else None
        self._finite: bool | None = None  # set when the scaled gradients have been unscaled

    def backward(self, loss, scale: float = 1.0) -> None:
        """Add ``scale * d loss / d p`` to the accumulated gradients."""
        if self.loss_scale is not None:
            scale *= self.loss_scale.scale
        names = list(self.params)
        gs = jt.grad(loss * scale if scale != 1.0 else loss, [self.params[n] for n in names])
        if self.grads is None:
            self.grads = {n: g.stop_grad() for n, g in zip(names, gs)}
        else:
            self.grads = {n: (self.grads[n] + g).stop_grad() for n, g in zip(names, gs)}
        jt.sync(list(self.grads.values()))

    def _unscale(self) -> bool:
        """Divide loss-scaled gradients by the scale (once per update); True if all are finite."""
        if self.loss_scale is None or self.grads is None:
            return True
        if self._finite is None:
            # finite * 0 = 0, inf * 0 = nan * 0 = nan: one scalar says whether all are finite
            probe = sum(float((g * 0).sum().item()) for g in self.grads.values())
            self._finite = bool(np.isfinite(probe))
            self.grads = {n: (g * (1.0 / self.loss_scale.scale)).stop_grad() for n, g in self.grads.items()}
        return self._finite

    def _grads(self):
        if self.grads is None:
            return {n: jt.zeros(p.shape) for n, p in self.params.items()}
        return self.grads

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before."""
        self._unscale()
        grads = self._grads()
        norm = float(np.sqrt(sum(float((g.float64() ** 2).sum().item()) for g in grads.values())))
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            self.grads = {n: g * coef for n, g in grads.items()}
        return norm

    def _begin_step(self, lr: float) -> float | None:
        """The update's step size (the step count advanced), or None when loss scaling skips the
        update (gradients not finite; they are cleared)."""
        finite = self._unscale()
        self._finite = None
        if self.loss_scale is not None and not self.loss_scale.update(finite):
            self.grads = None
            return None
        self.t += 1
        return step_size(lr, self.t, self.cfg)

    def step(self, lr: float) -> None:
        """One update with learning rate ``lr``, then clear the gradients (with loss scaling: no
        update when the gradients are not finite)."""
        size = self._begin_step(lr)
        if size is None:
            return
        b1, b2 = self.cfg.betas
        grads = self._grads()
        with jt.no_grad():
            for n, p in self.params.items():
                g = grads[n]
                m = self.m[n].update(self.m[n] * b1 + g * (1 - b1))
                v = self.v[n].update(self.v[n] * b2 + g * g * (1 - b2))
                new = p - size * m / (jt.sqrt(v) + self.cfg.eps)
                if self.cfg.weight_decay > 0 and self.decay[n]:
                    new = new - lr * self.cfg.weight_decay * new
                assign_keep_grad(p, new)
        jt.sync(list(self.params.values()) + list(self.m.values()) + list(self.v.values()))
        self.grads = None

    def zero_grad(self) -> None:
        self.grads, self._finite = None, None

    def grads_numpy(self) -> dict:
        return {n: g.numpy().copy() for n, g in self._grads().items()}

    def state_numpy(self) -> dict:
        """Moments and step count as one flat numpy dict (``lora_core.train.optim.pack_state``)."""
        state = pack_state({n: t.numpy().copy() for n, t in self.m.items()},
                           {n: t.numpy().copy() for n, t in self.v.items()}, self.t)
        return state if self.loss_scale is None else {**state, **self.loss_scale.state_numpy()}

    def load_state_numpy(self, state: dict) -> None:
        if self.loss_scale is not None:
            state = self.loss_scale.load_state_numpy(state)
        m, v, self.t = unpack_state(list(self.params), state)
        for n in self.params:
            self.m[n].update(jt.array(m[n]))
            self.v[n].update(jt.array(v[n]))
