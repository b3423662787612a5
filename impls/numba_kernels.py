"""`numba`: CPU kernels compiled by Numba, parallel over rows with `prange`.

One pass reads a row into cache, the statistics are fused (mean, then the centred sum of
squares over the cached row: a two-pass variance, robust to a large mean) and accumulated
in float64, the row is written once. float16 and bfloat16 inputs are computed in float32
and cast back once. Fast-math is restricted to reassociation and contraction, which is
what lets LLVM vectorize the reductions; 'nnan'/'ninf' are left out on purpose, so NaN and
inf propagate as IEEE arithmetic says (the F2/F3.nan_inf check).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .protocol import (
    Backend,
    BackendUnavailable,
    BatchNormLayer,
    Capabilities,
    Conventions,
    Result,
)

FASTMATH = {"reassoc", "contract", "nsz"}
HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))

try:
    import numba
    from numba import njit, prange
except ImportError as exc:  # the registry reports the backend as unavailable
    numba = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None


def _kernels():
    """Compile lazily, once: importing this module never pays for compilation."""
    if _kernels.cache is not None:
        return _kernels.cache
    jit = njit(parallel=True, fastmath=FASTMATH, cache=False, nogil=True)

    @jit
    def ln_fwd(x, w, b, eps, y, mean_out, rstd_out):
        rows, d = x.shape
        for r in prange(rows):
            acc = 0.0
            for j in range(d):
                acc += np.float64(x[r, j])
            mu = acc / d
            sq = 0.0
            for j in range(d):
                c = np.float64(x[r, j]) - mu
                sq += c * c
            rstd = 1.0 / math.sqrt(sq / d + eps)
            mean_out[r] = mu
            rstd_out[r] = rstd
            m32 = x.dtype.type(mu)
            s32 = x.dtype.type(rstd)
            for j in range(d):
                y[r, j] = (x[r, j] - m32) * s32 * w[j] + b[j]

    @jit
    def rms_fwd(x, w, eps, y, rstd_out):
        rows, d = x.shape
        for r in prange(rows):
            sq = 0.0
            for j in range(d):
                v = np.float64(x[r, j])
                sq += v * v
            rstd = 1.0 / math.sqrt(sq / d + eps)
            rstd_out[r] = rstd
            s32 = x.dtype.type(rstd)
            for j in range(d):
                y[r, j] = x[r, j] * s32 * w[j]

    @jit
    def ln_bwd(x, w, g, mean, rstd, dx, dw_part, db_part, chunk):
        rows, d = x.shape
        n_chunks = dw_part.shape[0]
        for c in prange(n_chunks):
            for r in range(c * chunk, min(rows, (c + 1) * chunk)):
                mu, s = mean[r], rstd[r]
                sh = 0.0
                shx = 0.0
                for j in range(d):
                    xh = (np.float64(x[r, j]) - mu) * s
                    h = np.float64(g[r, j]) * w[j]
                    sh += h
                    shx += h * xh
                    dw_part[c, j] += np.float64(g[r, j]) * xh
                    db_part[c, j] += np.float64(g[r, j])
                mh, mhx = sh / d, shx / d
                for j in range(d):
                    xh = (np.float64(x[r, j]) - mu) * s
                    h = np.float64(g[r, j]) * w[j]
                    dx[r, j] = s * (h - mh - xh * mhx)

    @jit
    def rms_bwd(x, w, g, rstd, dx, dw_part, chunk):
        rows, d = x.shape
        n_chunks = dw_part.shape[0]
        for c in prange(n_chunks):
            for r in range(c * chunk, min(rows, (c + 1) * chunk)):
                s = rstd[r]
                shx = 0.0
                for j in range(d):
                    xr = np.float64(x[r, j]) * s
                    h = np.float64(g[r, j]) * w[j]
                    shx += h * xr
                    dw_part[c, j] += np.float64(g[r, j]) * xr
                mhx = shx / d
                for j in range(d):
                    xr = np.float64(x[r, j]) * s
                    h = np.float64(g[r, j]) * w[j]
                    dx[r, j] = s * (h - xr * mhx)

    @jit
    def bn_stats(x, mean_out, sumsq_out):
        n, ch, length = x.shape
        for c in prange(ch):
            acc = 0.0
            for i in range(n):
                for l_ in range(length):
                    acc += np.float64(x[i, c, l_])
            mu = acc / (n * length)
            sq = 0.0
            for i in range(n):
                for l_ in range(length):
                    v = np.float64(x[i, c, l_]) - mu
                    sq += v * v
            mean_out[c] = mu
            sumsq_out[c] = sq

    @jit
    def bn_apply(x, mean, var, w, b, eps, y):
        n, ch, length = x.shape
        for c in prange(ch):
            s = 1.0 / math.sqrt(var[c] + eps)
            for i in range(n):
                for l_ in range(length):
                    y[i, c, l_] = (np.float64(x[i, c, l_]) - mean[c]) * s * w[c] + b[c]

    @jit
    def bn_bwd(x, w, g, mean, var, eps, dx, dw, db):
        n, ch, length = x.shape
        m = n * length
        for c in prange(ch):
            s = 1.0 / math.sqrt(var[c] + eps)
            sh = 0.0
            shx = 0.0
            sg = 0.0
            sgx = 0.0
            for i in range(n):
                for l_ in range(length):
                    xh = (np.float64(x[i, c, l_]) - mean[c]) * s
                    gv = np.float64(g[i, c, l_])
                    sh += gv * w[c]
                    shx += gv * w[c] * xh
                    sg += gv
                    sgx += gv * xh
            dw[c] = sgx
            db[c] = sg
            for i in range(n):
                for l_ in range(length):
                    xh = (np.float64(x[i, c, l_]) - mean[c]) * s
                    dx[i, c, l_] = s * (np.float64(g[i, c, l_]) * w[c] - sh / m - xh * shx / m)

    _kernels.cache = dict(ln_fwd=ln_fwd, rms_fwd=rms_fwd, ln_bwd=ln_bwd, rms_bwd=rms_bwd,
                          bn_stats=bn_stats, bn_apply=bn_apply, bn_bwd=bn_bwd)
    return _kernels.cache


_kernels.cache = None


def _ct(dtype):
    return np.dtype(np.float32) if np.dtype(dtype) in HALF else np.dtype(dtype)


def _rows(a, d, ct):
    return np.ascontiguousarray(a, dtype=ct).reshape(-1, d)


def _param(p, d, ct, fill):
    return np.full(d, fill, ct) if p is None else np.ascontiguousarray(p, dtype=ct).reshape(d)


def _chunks(rows):
    threads = numba.get_num_threads()
    chunk = max(1, -(-rows // threads))
    return chunk, -(-rows // chunk)


class NumbaBackend(Backend):
    name = "numba"
    capabilities = Capabilities(
        ops=frozenset({"layer_norm", "rms_norm", "qk_norm_scores", "batch_norm"}),
        gradients=frozenset({"layer_norm", "rms_norm", "batch_norm"}), no_grad_mode=False)
    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": 1e-6, "batch_norm": 1e-5},
        half_compute_dtype="float32 (statistics accumulated in float64)")

    def __init__(self):
        if numba is None:
            raise BackendUnavailable(f"numba is not installed: {_IMPORT_ERROR}")
        self.version = numba.__version__
        self.k = _kernels()

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        ct, d = _ct(x.dtype), int(np.prod(normalized_shape))
        xr = _rows(x, d, ct)
        w, b = _param(weight, d, ct, 1.0), _param(bias, d, ct, 0.0)
        y = np.empty_like(xr)
        mean, rstd = np.empty(xr.shape[0]), np.empty(xr.shape[0])
        self.k["ln_fwd"](xr, w, b, float(eps), y, mean, rstd)
        out = y.reshape(x.shape).astype(x.dtype)
        if grad_output is None:
            return Result(out)
        g = _rows(grad_output, d, ct)
        chunk, n_chunks = _chunks(xr.shape[0])
        dx = np.empty_like(xr)
        dw_part, db_part = np.zeros((n_chunks, d)), np.zeros((n_chunks, d))
        self.k["ln_bwd"](xr, w.astype(np.float64), g, mean, rstd, dx, dw_part, db_part, chunk)
        shape = tuple(normalized_shape)
        gw = dw_part.sum(axis=0).reshape(shape).astype(x.dtype) if weight is not None else None
        gb = db_part.sum(axis=0).reshape(shape).astype(x.dtype) if bias is not None else None
        return Result(out, dx.reshape(x.shape).astype(x.dtype), gw, gb)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        ct, d = _ct(x.dtype), int(np.prod(normalized_shape))
        xr = _rows(x, d, ct)
        w = _param(weight, d, ct, 1.0)
        y = np.empty_like(xr)
        rstd = np.empty(xr.shape[0])
        self.k["rms_fwd"](xr, w, float(eps), y, rstd)
        out = y.reshape(x.shape).astype(x.dtype)
        if grad_output is None:
            return Result(out)
        g = _rows(grad_output, d, ct)
        chunk, n_chunks = _chunks(xr.shape[0])
        dx = np.empty_like(xr)
        dw_part = np.zeros((n_chunks, d))
        self.k["rms_bwd"](xr, w.astype(np.float64), g, rstd, dx, dw_part, chunk)
        gw = (dw_part.sum(axis=0).reshape(tuple(normalized_shape)).astype(x.dtype)
              if weight is not None else None)
        return Result(out, dx.reshape(x.shape).astype(x.dtype), gw)

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        ct, d = _ct(q.dtype), q.shape[-1]
        # q_hat and k_hat are stored in the input dtype, as a model's RMSNorm output would be
        q_hat = self.rms_norm(q, (d,), q_weight, eps).output.astype(ct)
        k_hat = self.rms_norm(k, (d,), k_weight, eps).output.astype(ct)
        return (np.matmul(q_hat, np.swapaxes(k_hat, -1, -2)) * ct.type(scale)).astype(q.dtype)

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return NumbaBatchNorm(self.k, num_features, eps, momentum, affine, track_running_stats,
                              np.dtype(dtype), weight, bias)


class NumbaBatchNorm(BatchNormLayer):
    def __init__(self, k, c, eps, momentum, affine, track, dtype, weight, bias):
        self.k, self.eps, self.momentum, self.dtype = k, eps, momentum, dtype
        self.ct = _ct(dtype)
        self.affine = affine
        self.w = _param(weight if affine else None, c, np.float64, 1.0)
        self.b = _param(bias if affine else None, c, np.float64, 0.0)
        self._mean = np.zeros(c, self.ct) if track else None
        self._var = np.ones(c, self.ct) if track else None
        self.t = 0
        self.training = True

    @property
    def running_mean(self):
        return None if self._mean is None else self._mean.astype(self.dtype)

    @property
    def running_var(self):
        return None if self._var is None else self._var.astype(self.dtype)

    def forward(self, x, grad_output=None):
        n, c = x.shape[:2]
        x3 = np.ascontiguousarray(x, dtype=self.ct).reshape(n, c, -1)
        m = n * x3.shape[2]
        batch = self.training or self._mean is None
        if batch:
            if m <= 1:
                raise ValueError(f"Expected more than 1 value per channel when training, "
                                 f"got input of shape {x.shape}")
            mean, sumsq = np.empty(c), np.empty(c)
            self.k["bn_stats"](x3, mean, sumsq)
            var = sumsq / m
            if self.training and self._mean is not None:
                self.t += 1
                a = 1.0 / self.t if self.momentum is None else self.momentum
                # run <- (1 - a) run + a stat, with the unbiased variance (F4)
                self._mean = ((1 - a) * self._mean + a * mean).astype(self.ct)
                self._var = ((1 - a) * self._var + a * sumsq / (m - 1)).astype(self.ct)
        else:
            mean, var = self._mean.astype(np.float64), self._var.astype(np.float64)
        y = np.empty(x3.shape)
        self.k["bn_apply"](x3, mean, var, self.w, self.b, float(self.eps), y)
        out = y.reshape(x.shape).astype(self.dtype)
        if grad_output is None:
            return Result(out)
        g3 = np.ascontiguousarray(grad_output, dtype=self.ct).reshape(x3.shape)
        dx, dw, db = np.empty(x3.shape), np.empty(c), np.empty(c)
        self.k["bn_bwd"](x3, self.w, g3, mean, var, float(self.eps), dx, dw, db)
        gw = dw.astype(self.dtype) if self.affine else None
        gb = db.astype(self.dtype) if self.affine else None
        return Result(out, dx.reshape(x.shape).astype(self.dtype), gw, gb)


def make_backend() -> NumbaBackend:
    return NumbaBackend()
