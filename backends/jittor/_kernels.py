"""CPU kernels for jittor's attention and beam-search cache.

Batched matrix products:
On CPU ``jt.matmul`` of 3-D/4-D operands is a broadcast multiply and a reduction, not a
GEMM: for GPT-2's attention (batch 8 x 12 heads, ~72 tokens, head size 64) forward plus
backward took 82 ms per layer against 15 ms with the loop of oneDNN ``dnnl_sgemm`` calls
below (one thread). jittor already loads oneDNN for its own 2-D ``mkl_matmul``; this calls
the same library. Without it (jittor built without oneDNN, or on CUDA, where ``jt.matmul``
uses cuBLAS' batched GEMM) the plain ``jt.matmul`` is used.

``softmax_scaled``: ``softmax(x * scale + bias)`` over the last axis with its gradient, one
pass per row; jittor's fused broadcast/reduce kernels for the same expression took 5.2 ms
per demo-size layer (batch 8, 4 heads, 50 tokens), forward plus backward, against 1.1 ms.

``grow_rows``: the beam-search cache step (gather the rows of the beams that continue,
append the new position) as one copy; as two jittor ops (getitem, then concat) it copied
twice (35 ms per gpt2 step of 300).
"""

from __future__ import annotations

import jittor as jt

_DECL = ('extern "C" int dnnl_sgemm(char, char, long, long, long, float, const float*, long, '
         "const float*, long, float, float*, long);")


def _onednn() -> bool:
    from jittor import compile_extern

    return not jt.flags.use_cuda and getattr(compile_extern, "mkl_ops", None) is not None


def _gemm(a: jt.Var, b: jt.Var, ta: str, tb: str) -> jt.Var:
    """``op(a[i]) @ op(b[i])`` for each i; op is the identity ("N") or the transpose ("T")."""
    m = a.shape[1] if ta == "N" else a.shape[2]
    n = b.shape[2] if tb == "N" else b.shape[1]
    return jt.code((a.shape[0], m, n), a.dtype, [a, b], cpu_header=_DECL, cpu_src=f"""
        const long bt = in0_shape0, ra = in0_shape1, ca = in0_shape2, rb = in1_shape1, cb = in1_shape2;
        const long m = '{ta}' == 'N' ? ra : ca, k = '{ta}' == 'N' ? ca : ra, n = '{tb}' == 'N' ? cb : rb;
        for (long i = 0; i < bt; i++) {{
            int status = dnnl_sgemm('{ta}', '{tb}', m, n, k, 1.f, in0_p + i * ra * ca, ca,
                                    in1_p + i * rb * cb, cb, 0.f, out0_p + i * m * n, n);
            ASSERTop(status, ==, 0);
        }}
    """)


class _MatmulNT(jt.Function):
    def execute(self, a, b):
        self.a, self.b = a, b
        return _gemm(a, b, "N", "T")

    def grad(self, g):
        return _gemm(g, self.b, "N", "N"), _gemm(g, self.a, "T", "N")


class _MatmulNN(jt.Function):
    def execute(self, a, b):
        self.a, self.b = a, b
        return _gemm(a, b, "N", "N")

    def grad(self, g):
        return _gemm(g, self.b, "N", "T"), _gemm(self.a, g, "T", "N")


def bmm_nt(a: jt.Var, b: jt.Var) -> jt.Var:
    """``a @ b^T`` over a leading batch axis: (n, m, k) x (n, p, k) -> (n, m, p)."""
    return _MatmulNT.apply(a, b) if _onednn() else jt.matmul(a, b.transpose(0, 2, 1))


def bmm(a: jt.Var, b: jt.Var) -> jt.Var:
    """``a @ b`` over a leading batch axis: (n, m, k) x (n, k, p) -> (n, m, p)."""
    return _MatmulNN.apply(a, b) if _onednn() else jt.matmul(a, b)


def grow_rows(old: jt.Var, new: jt.Var, rows: jt.Var) -> jt.Var:
    """``concat([old[rows], new], dim=2)`` for (R, nh, t, hs) ``old``, (R, nh, T, hs) ``new``
    and (R,) int64 ``rows``, in one pass on CPU."""
    if jt.flags.use_cuda:
        return jt.concat([old[rows], new], dim=2)
    R, nh, t, hs = old.shape
    return jt.code((R, nh, t + new.shape[2], hs), old.dtype, [old, new, rows], cpu_header="#include <cstring>",
                   cpu_src="""
        const long R = in1_shape0, nh = in1_shape1, T = in1_shape2, hs = in1_shape3, t = in0_shape2;
        for (long r = 0; r < R; r++) {
            const long s = in2_p[r];
            for (long h = 0; h < nh; h++) {
                float* dst = out0_p + (r * nh + h) * (t + T) * hs;
                std::memcpy(dst, in0_p + (s * nh + h) * t * hs, sizeof(float) * t * hs);
                std::memcpy(dst + t * hs, in1_p + (r * nh + h) * T * hs, sizeof(float) * T * hs);
            }
        }
    """)


def rows_dot(q: jt.Var, k: jt.Var) -> jt.Var:
    """Scores of one query per row against that row's keys: (R, nh, 1, hs) x (R, nh, t, hs)
    -> (R, nh, 1, t); a vectorised dot-product loop on CPU (the broadcast multiply-reduce
    took 21 ms per gpt2 beam step)."""
    R, nh, _, hs = q.shape
    t = k.shape[2]
    if jt.flags.use_cuda:
        return (q * k).sum(-1).unsqueeze(2)
    return jt.code((R, nh, 1, t), q.dtype, [q, k], cpu_src="""
        const long n = in1_shape0 * in1_shape1, t = in1_shape2, hs = in1_shape3;
        for (long i = 0; i < n; i++) {
            const float* qi = in0_p + i * hs;
            const float* ki = in1_p + i * t * hs;
            for (long j = 0; j < t; j++) {
                float acc = 0.f;
                for (long d = 0; d < hs; d++) acc += qi[d] * ki[j * hs + d];
                out0_p[i * t + j] = acc;
            }
        }
    """)


_SOFTMAX_FWD = """
    const long B = in0_shape0, nh = in0_shape1, T = in0_shape2, L = in0_shape3, Bb = in1_shape0;
    for (long b = 0; b < B; b++) for (long h = 0; h < nh; h++) for (long t = 0; t < T; t++) {
        const long o = ((b * nh + h) * T + t) * L;
        const float* x = in0_p + o;
        const float* m = in1_p + ((Bb == 1 ? 0 : b) * T + t) * L;
        float* y = out0_p + o;
        float mx = -INFINITY;
        for (long j = 0; j < L; j++) { const float v = x[j] * SCALE + m[j]; y[j] = v; mx = v > mx ? v : mx; }
        float s = 0.f;
        for (long j = 0; j < L; j++) { const float e = std::exp(y[j] - mx); y[j] = e; s += e; }
        const float inv = 1.f / s;
        for (long j = 0; j < L; j++) y[j] *= inv;
    }
"""
_SOFTMAX_BWD = """
    const long n = in0_shape0 * in0_shape1 * in0_shape2, L = in0_shape3;
    for (long i = 0; i < n; i++) {
        const float* y = in0_p + i * L;
        const float* g = in1_p + i * L;
        float* d = out0_p + i * L;
        float s = 0.f;
        for (long j = 0; j < L; j++) s += g[j] * y[j];
        for (long j = 0; j < L; j++) d[j] = SCALE * y[j] * (g[j] - s);
    }
"""


class _SoftmaxScaled(jt.Function):
    def execute(self, x, bias, scale):
        self.scale = f"{float(scale)!r}f"
        self.y = jt.code(x.shape, x.dtype, [x, bias], cpu_header="#include <cmath>",
                         cpu_src=_SOFTMAX_FWD.replace("SCALE", self.scale))
        return self.y

    def grad(self, g):
        return jt.code(g.shape, g.dtype, [self.y, g], cpu_src=_SOFTMAX_BWD.replace("SCALE", self.scale)), None


def softmax_scaled(x: jt.Var, bias: jt.Var, scale: float) -> jt.Var:
    """``softmax(x * scale + bias, dim=-1)`` for (B, nh, T, L) ``x`` and (B|1, 1, T, L) ``bias``
    (a constant: no gradient flows to it)."""
    if jt.flags.use_cuda:
        return jt.nn.softmax(x * scale + bias, dim=-1)
    bias = bias.stop_grad()
    if bias.shape[2] != x.shape[2] or bias.shape[3] != x.shape[3] or bias.shape[1] != 1 or bias.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"softmax_scaled: bias {bias.shape} does not broadcast to {x.shape}")
    return _SoftmaxScaled.apply(x, bias, scale)
