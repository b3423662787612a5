"""`numpy`: a plain NumPy backend, written independently of the oracle.

It computes in the input's own precision (float16 and bfloat16 in float32, cast back
once), with a two-pass variance, the way a careful hand-written kernel would. It is the
baseline the project's deliberately broken backends are derived from, and a worked
example of the protocol for third parties (data-parallel BatchNorm in numpy_dp.py). It
does not import normspec.spec: a backend that consulted the oracle would be checking
itself.
"""

from __future__ import annotations

import numpy as np

from ._running import RunningStats, RunningStatsLayer
from .numpy_dp import NumpyDataParallel
from .protocol import (
    DTYPES,
    NORM_OPS,
    Backend,
    Capabilities,
    Conventions,
    FusedAddNormResult,
    Result,
    compute_dtype,
)


def _up(a, ct):
    return None if a is None else np.asarray(a).astype(ct)


def _sum(v, axes, keepdims=False):
    """Sum over `axes`, pairwise: NumPy sums pairwise only along a contiguous last axis
    and adds row by row over any other (an error growing as n, not log n, which a careful
    kernel's tree reduction does not have), so the reduced axes are moved last first."""
    axes = tuple(a % v.ndim for a in axes)
    rest = [a for a in range(v.ndim) if a not in axes]
    moved = np.ascontiguousarray(np.transpose(v, rest + list(axes)))
    kept = moved.shape[:len(rest)]
    s = moved.reshape(kept + (int(np.prod(moved.shape[len(rest):])),)).sum(axis=-1)
    if keepdims:
        s = s.reshape([1 if a in axes else n for a, n in enumerate(v.shape)])
    return s


def _mean(v, axes):
    """Mean over `axes`, keepdims, pairwise (see _sum)."""
    n = int(np.prod([v.shape[a] for a in axes]))
    return _sum(v, axes, keepdims=True) / v.dtype.type(n)


def _axes(x, normalized_shape):
    n = len(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else 1
    return tuple(range(x.ndim - n, x.ndim))


class NumpyBackend(NumpyDataParallel, Backend):
    name = "numpy"
    version = np.__version__
    capabilities = Capabilities(ops=NORM_OPS + ("fused_add_norm",), dtypes=DTYPES,
                                gradients={"layer_norm", "rms_norm", "batch_norm",
                                           "fused_add_norm"},
                                cumulative_momentum=True, untracked_stats=True,
                                data_parallel={"local", "sync"})
    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": 1e-6, "batch_norm": 1e-5},
        native_momentum="weight of the new batch (PyTorch's meaning)",
        data_parallel_buffers="per_replica",
        fused_residual_sum="rounded",
    )

    def compile_seconds(self) -> float:
        return 0.0  # NumPy compiles nothing

    # --- statistics, overridable one at a time by the test-suite's broken variants ---
    def mean(self, v, axes):
        """The sum of v 2^-k over n 2^-k, 2^k >= n: n values near the largest finite value
        cannot overflow the sum (a constant row of 8.5e37 gives LayerNorm output beta, not
        NaN: pytorch #173793), and scaling by a power of two is exact above the subnormal
        range, so the mean has the same bits as sum / n there (values below ~2^k * 1e-38
        in float32 lose low bits)."""
        n = int(np.prod([v.shape[a] for a in axes]))
        scale = v.dtype.type(2.0 ** -(n - 1).bit_length())
        return _sum(v * scale, axes, keepdims=True) / (v.dtype.type(n) * scale)

    def variance(self, v, axes, mu):
        return _mean((v - mu) ** 2, axes)

    def mean_square(self, v, axes):
        return _mean(v * v, axes)

    def inv_std(self, var, eps):
        return 1.0 / np.sqrt(var + eps)

    # --- LayerNorm (F2) ---
    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        ct = compute_dtype(x.dtype)
        xc, w, b = _up(x, ct), _up(weight, ct), _up(bias, ct)
        axes = _axes(xc, normalized_shape)
        mu = self.mean(xc, axes)
        r = self.inv_std(self.variance(xc, axes, mu), ct.type(eps))
        x_hat = (xc - mu) * r
        y = x_hat * w if w is not None else x_hat
        y = y + b if b is not None else y
        if grad_output is None:
            return Result(y.astype(x.dtype))
        g = _up(grad_output, ct)
        h = g * w if w is not None else g
        gx = r * (h - _mean(h, axes) - x_hat * _mean(h * x_hat, axes))
        lead = tuple(range(axes[0]))
        gw = _sum(g * x_hat, lead).astype(x.dtype) if w is not None else None
        gb = _sum(g, lead).astype(x.dtype) if b is not None else None
        return Result(y.astype(x.dtype), gx.astype(x.dtype), gw, gb)

    # --- RMSNorm (F3) ---
    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        ct = compute_dtype(x.dtype)
        xc, w = _up(x, ct), _up(weight, ct)
        axes = _axes(xc, normalized_shape)
        r = self.inv_std(self.mean_square(xc, axes), ct.type(eps))
        y = xc * r * w if w is not None else xc * r
        if grad_output is None:
            return Result(y.astype(x.dtype))
        g = _up(grad_output, ct)
        h = g * w if w is not None else g
        gx = r * (h - xc * r * r * _mean(h * xc, axes))
        gw = _sum(g * xc * r, tuple(range(axes[0]))).astype(x.dtype) if w is not None else None
        return Result(y.astype(x.dtype), gx.astype(x.dtype), gw)

    # --- fused residual add + norm (F8), the eager composition: contract "rounded" ---
    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        ct = compute_dtype(x.dtype)
        s = (x.astype(ct) + residual.astype(ct)).astype(x.dtype)  # the sum, held in x's dtype
        g_y = None if grad_outputs is None else grad_outputs[0]
        if norm == "rms_norm":
            res = self.rms_norm(s, normalized_shape, weight, eps, g_y)
        else:
            res = self.layer_norm(s, normalized_shape, weight, bias, eps, g_y)
        if grad_outputs is None:
            return FusedAddNormResult(res.output, s)
        g = (res.grad_input.astype(ct) + grad_outputs[1].astype(ct)).astype(x.dtype)
        return FusedAddNormResult(res.output, s, g, g.copy(), res.grad_weight,
                                  res.grad_bias if norm == "layer_norm" else None)

    # --- QK-norm (F6) ---
    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        ct = compute_dtype(q.dtype)
        d = q.shape[-1]
        q_hat = self.rms_norm(q, (d,), q_weight, eps).output.astype(ct)
        k_hat = self.rms_norm(k, (d,), k_weight, eps).output.astype(ct)
        s = np.matmul(q_hat, np.swapaxes(k_hat, -1, -2)) * ct.type(scale)
        return s.astype(q.dtype)

    # --- soft-capping (F7) ---
    def softcap(self, scores, cap):
        ct = compute_dtype(scores.dtype)
        return (ct.type(cap) * np.tanh(scores.astype(ct) / ct.type(cap))).astype(scores.dtype)

    # --- BatchNorm (F1, F4, F5) ---
    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return NumpyBatchNorm(self, num_features, eps, momentum, affine, track_running_stats,
                              np.dtype(dtype), weight, bias)


class NumpyBatchNorm(RunningStatsLayer):
    def __init__(self, backend, c, eps, momentum, affine, track, dtype, weight, bias):
        self.backend, self.eps, self.momentum, self.dtype = backend, eps, momentum, dtype
        self.ct = compute_dtype(dtype)
        self.weight = (np.ones(c, dtype) if weight is None else np.asarray(weight, dtype)) if affine else None
        self.bias = (np.zeros(c, dtype) if bias is None else np.asarray(bias, dtype)) if affine else None
        self.stats = RunningStats(c, track, self.ct, dtype, momentum)
        self.training = True

    def _shape(self, x):
        return (0,) + tuple(range(2, x.ndim)), (1, x.shape[1]) + (1,) * (x.ndim - 2)

    def update_running(self, mu, sum_sq, m):
        self.stats.update(mu, sum_sq, m)

    def uses_batch_stats(self):
        return self.training or not self.stats.tracked

    def forward(self, x, grad_output=None):
        ct, b = self.ct, self.backend
        xc = x.astype(ct)
        axes, bshape = self._shape(xc)
        m = xc.size // xc.shape[1]
        if self.uses_batch_stats():
            if m <= 1:
                raise ValueError(f"Expected more than 1 value per channel when training, "
                                 f"got input size {x.shape}")
            mu = b.mean(xc, axes)
            var = b.variance(xc, axes, mu)
            if self.training and self.stats.tracked:
                self.update_running(mu.reshape(-1), var.reshape(-1) * m, m)
        else:
            mu, var = self.stats.mean.reshape(bshape), self.stats.var.reshape(bshape)
        r = b.inv_std(var, ct.type(self.eps))
        x_hat = (xc - mu) * r
        w = None if self.weight is None else self.weight.astype(ct).reshape(bshape)
        y = x_hat * w + self.bias.astype(ct).reshape(bshape) if w is not None else x_hat
        if grad_output is None:
            return Result(y.astype(self.dtype))
        g = grad_output.astype(ct)
        h = g * w if w is not None else g
        if self.uses_batch_stats():
            gx = r * (h - _mean(h, axes) - x_hat * _mean(h * x_hat, axes))
        else:
            gx = r * h
        gw = _sum(g * x_hat, axes).astype(self.dtype) if w is not None else None
        gb = _sum(g, axes).astype(self.dtype) if w is not None else None
        return Result(y.astype(self.dtype), gx.astype(self.dtype), gw, gb)


def make_backend() -> NumpyBackend:
    return NumpyBackend()
