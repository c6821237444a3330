"""GELU, LayerNorm and frozen linear products for Jittor whose backward keeps only what it needs.

Jittor's autograd keeps every intermediate of an expression that its backward reads. For
GELU (tanh form) ``0.5 * x * (1 + tanh(c * (x + 0.044715 x^3)))`` that is five tensors of
the MLP's width per layer (``x``, ``x*x``, the tanh, ``1 + tanh``, ``0.5 x``); for
``jittor.nn.LayerNorm`` (``x * w + b`` with per-row ``w = weight / std`` and ``b``) several
of the model's width; and a product ``x @ W^T`` keeps ``x`` even when ``W`` is frozen and only
``dx = g @ W`` is needed. Measured with jittor's memory profiler on a training step of GPT-2
small (batch 8 of E2E, 460 real tokens, one thread): 782 MB of intermediates alive at the
peak, 323 MB of them (460, 3072) tensors and 239 MB (460, 768) ones; peak RSS of 12 steps
1.86-1.93 GB. With the three below: 555 MB of intermediates, peak RSS 1.57 GB.

Here each is a ``jt.Function``: the forward pass is the same expression as before (the same
operations in the same order: the same numbers for the layer alone; inside a model jittor may
fuse across the new boundary differently, a rounding-level change) except LayerNorm's variance,
taken from the centred values as torch takes it (jittor's ``mean(x^2) - mean(x)^2`` cancels for
rows with a large mean: since 2026-11-28), and the backward pass keeps the input
(GELU), the input and two per-row statistics (LayerNorm) or the frozen weight (the product).
On the CPU the GELU and LayerNorm gradients are one C++ loop over (input, incoming gradient):
written as jittor expressions, the parts that do not depend on the incoming gradient (the
recomputed tanh, the normalised input) are ready as soon as the forward pass is, and jittor's
executor computes them early and keeps them for every layer at once, which undid most of the
saving (measured). On CUDA the expressions are used.

The gradients are the analytic derivatives (LayerNorm's row sums in double); they differ from
the chained ones by float rounding, and are compared with torch's in the tests. One more
reason for the GELU one: jittor's own gradient of ``tanh`` is ``g / cosh(u)^2``, and its
vectorised CPU kernel returns NaN where ``cosh`` overflows (|u| > ~44, reached in GELU's tanh
form at |x| > ~9.4 for arrays of 16 or more elements; measured with jittor 1.3.11), so a
large MLP pre-activation made every LoRA gradient NaN. The derivative here stays finite.
"""

from __future__ import annotations

import math

import jittor as jt
from jittor import nn

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT2 = 1.4142135623730951  # jittor.nn.gelu's constant


def _gelu_tanh_expr(x: jt.Var) -> jt.Var:
    return 0.5 * x * (1.0 + jt.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def _gelu_erf_expr(x: jt.Var) -> jt.Var:
    return (jt.erf(x / _SQRT2) + 1) * x * 0.5  # jittor.nn.gelu


def _elementwise_grad(x: jt.Var, g: jt.Var, derivative: str) -> jt.Var:
    """``g * f'(x)`` in one pass on the CPU; ``derivative``: C++ statements that set ``float d``
    (``f'``) from ``float x``."""
    return jt.code(x.shape, x.dtype, [x, g], cpu_header="#include <cmath>", cpu_src=f"""
        const long n = in0->num;
        for (long i = 0; i < n; i++) {{
            const float x = in0_p[i];
            float d;
            {derivative}
            out0_p[i] = in1_p[i] * d;
        }}
    """)


_C = f"{_SQRT_2_OVER_PI!r}f"
_GELU_TANH_D = (f"const float t = std::tanh({_C} * (x + 0.044715f * x * x * x));"
                f" d = 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * {_C} * (1.f + 3.f * 0.044715f * x * x);")
_GELU_ERF_D = f"d = 0.5f * (1.f + std::erf(x / {_SQRT2!r}f)) + x * std::exp(-0.5f * x * x) * {_INV_SQRT_2PI!r}f;"


class _GeluTanh(jt.Function):
    def execute(self, x):
        self.x = x
        return _gelu_tanh_expr(x)

    def grad(self, g):
        x = self.x
        if not jt.flags.use_cuda:
            return _elementwise_grad(x, g, _GELU_TANH_D)
        t = jt.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
        dt = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
        return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt)


class _GeluErf(jt.Function):
    def execute(self, x):
        self.x = x
        return _gelu_erf_expr(x)

    def grad(self, g):
        x = self.x
        if not jt.flags.use_cuda:
            return _elementwise_grad(x, g, _GELU_ERF_D)
        return g * (0.5 * (jt.erf(x / _SQRT2) + 1) + x * jt.exp(-0.5 * x * x) * _INV_SQRT_2PI)


def gelu_tanh(x: jt.Var) -> jt.Var:
    """GELU, tanh approximation (GPT-2's ``gelu_new``; torch ``F.gelu(approximate="tanh")``)."""
    return _gelu_tanh_expr(x) if x.is_stop_grad() else _GeluTanh.apply(x)


def gelu(x: jt.Var) -> jt.Var:
    """GELU with erf (DistilBERT's; ``jittor.nn.gelu``, torch ``F.gelu``)."""
    return _gelu_erf_expr(x) if x.is_stop_grad() else _GeluErf.apply(x)


_LN_GRAD = """
    const long E = in3_shape0, rows = in0->num / E;
    for (long r = 0; r < rows; r++) {
        const float* x = in0_p + r * E;
        const float* g = in4_p + r * E;
        float* d = out0_p + r * E;
        const double mean = in1_p[r], rstd = 1.0 / in2_p[r];
        double s1 = 0, s2 = 0;
        for (long j = 0; j < E; j++) {
            const double gw = (double)g[j] * in3_p[j];
            s1 += gw;
            s2 += gw * ((x[j] - mean) * rstd);
        }
        s1 /= E;
        s2 /= E;
        for (long j = 0; j < E; j++) {
            const double xhat = (x[j] - mean) * rstd;
            d[j] = (float)(rstd * ((double)g[j] * in3_p[j] - s1 - xhat * s2));
        }
    }
"""


def _layer_norm(x, weight, bias, eps):
    """``(y, mean, std)`` over the last axis, the variance from the centred values (two passes, as
    torch computes it): ``jittor.nn.LayerNorm``'s ``mean(x^2) - mean(x)^2`` cancels where a row's
    mean is large against its spread (a row offset of 300 at unit spread: 2.5e-2 from torch; at
    DistilBERT's eps 1e-12 a clamped zero variance)."""
    xd = x.float64()  # the row statistics in double: a float32 mean of values near 300 is off by ~1e-5
    xmean = jt.mean(xd, dims=[-1], keepdims=1)
    xc = xd - xmean
    std = jt.sqrt(jt.mean(xc * xc, dims=[-1], keepdims=1) + eps)
    return (xc / std).float32() * weight + bias, xmean.float32(), std.float32()


class _LayerNormFn(jt.Function):
    """Over the last axis (``_layer_norm``), keeping the input and two row statistics."""

    def execute(self, x, weight, bias, eps):
        y, xmean, std = _layer_norm(x, weight, bias, eps)
        self.x, self.xmean, self.std, self.weight = x, xmean, std, weight
        return y

    def grad(self, g):
        rstd = 1.0 / self.std  # (..., 1)
        xhat = (self.x - self.xmean) * rstd
        if jt.flags.use_cuda:
            gw = g * self.weight
            dx = rstd * (gw - gw.mean(-1, keepdims=True) - xhat * (gw * xhat).mean(-1, keepdims=True))
        else:
            dx = jt.code(g.shape, g.dtype, [self.x, self.xmean, self.std, self.weight, g], cpu_src=_LN_GRAD)
        E = g.shape[-1]
        dweight = (g * xhat).reshape(-1, E).sum(0)  # lazy: never computed for a frozen weight
        dbias = g.reshape(-1, E).sum(0)
        return dx, dweight, dbias, None


class _FrozenMatmulT(jt.Function):
    def execute(self, x, w):
        self.w = w
        return nn.matmul_transpose(x, w)

    def grad(self, g):
        gx = nn.matmul(g.reshape(-1, g.shape[-1]), self.w)
        return gx.reshape(g.shape[:-1] + (gx.shape[-1],)), None


def frozen_matmul_t(x: jt.Var, w: jt.Var) -> jt.Var:
    """``x @ w^T`` (``jittor.nn.matmul_transpose``) for a frozen ``w``: the backward pass keeps
    ``w`` only, not ``x`` (jittor's own keeps both operands of the product)."""
    if w.is_stop_grad() and not x.is_stop_grad():
        return _FrozenMatmulT.apply(x, w)
    return nn.matmul_transpose(x, w)


class LayerNorm(nn.LayerNorm):
    """``jittor.nn.LayerNorm``'s parameters over the last axis, its variance from the centred values
    (``_layer_norm``), with the lean backward above."""

    def __init__(self, normalized_shape, eps: float = 1e-5):
        super().__init__(normalized_shape, eps=eps)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"LayerNorm: normalizes over the last axis only, got shape {self.normalized_shape}")

    def execute(self, x):
        if jt.flags.amp_level != 0:
            return super().execute(x)
        if x.is_stop_grad() and self.weight.is_stop_grad():  # no backward: the expression alone
            return _layer_norm(x, self.weight, self.bias, self.eps)[0]
        return _LayerNormFn.apply(x, self.weight, self.bias, self.eps)


__all__ = ["gelu_tanh", "gelu", "LayerNorm", "frozen_matmul_t"]
