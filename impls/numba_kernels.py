"""`numba`: CPU kernels compiled by Numba, parallel over rows with `prange`.

Each row is read once from memory: its statistics come from one read (shifted-data sums
of x - x[0] and (x - x[0])^2, accumulated in float64, which a large mean cannot cancel),
then the row is normalized from cache and written once; the forward gathers the next
row's statistics in the loop that writes this one, so reading and writing overlap.
float16 and bfloat16 are computed in float32 and cast back once: the forward kernel
decodes and encodes the 16-bit values itself (round to nearest even); the backward
converts them in NumPy around the float32 kernel. Fast-math is restricted to
reassociation, contraction and no-signed-zeros, which is what lets LLVM vectorize the
reductions; 'nnan'/'ninf' are left out on purpose, so NaN and inf propagate as IEEE
arithmetic says (the F2/F3.nan_inf check).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ._running import RunningStats, RunningStatsLayer
from .protocol import (
    DTYPES,
    HALF_DTYPES,
    Backend,
    BackendUnavailable,
    Capabilities,
    Conventions,
    Result,
    compute_dtype,
    np_dtype,
)

FASTMATH = {"reassoc", "contract", "nsz"}
HALF = tuple(np_dtype(name) for name in HALF_DTYPES)
_FMT = {np.dtype(np.float16): 0, np.dtype(ml_dtypes.bfloat16): 1}

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
    inline = njit(fastmath=FASTMATH, inline="always")

    @inline
    def shifted_sums(xr, d):
        """Sums of (x - k) and (x - k)^2 in float64 with k = x[0]: one read of the row, and
        k lies within a few spreads of the mean, so s2/d - (s1/d)^2 does not cancel (the
        shifted-data variance), however large the mean."""
        k = np.float64(xr[0])
        s1 = 0.0
        s2 = 0.0
        for j in range(d):
            v = np.float64(xr[j]) - k
            s1 += v
            s2 += v * v
        return k, s1, s2

    @inline
    def moments(k, s1, s2, d, eps):
        m1 = s1 / d
        var = s2 / d - m1 * m1
        if var < 0.0:  # rounding only; written so that NaN stays NaN
            var = 0.0
        return k + m1, 1.0 / math.sqrt(var + eps)

    @inline
    def sum_squares(xr, d):
        s = 0.0
        for j in range(d):
            v = np.float64(xr[j])
            s += v * v
        return s

    @jit
    def ln_fwd(x, w, b, eps, y, mean_out, rstd_out, n_chunks):
        """Rows in contiguous chunks, one per thread; while row r is normalized from cache
        the statistics of row r + 1 are gathered in the same loop, so the read stream of
        the next row overlaps the write stream of this one."""
        rows, d = x.shape
        per = (rows + n_chunks - 1) // n_chunks
        for c in prange(n_chunks):
            r0, r1 = c * per, min(rows, (c + 1) * per)
            if r0 >= r1:
                continue
            k, s1, s2 = shifted_sums(x[r0], d)
            for r in range(r0, r1):
                mu, rstd = moments(k, s1, s2, d, eps)
                mean_out[r], rstd_out[r] = mu, rstd
                m_t, s_t = x.dtype.type(mu), x.dtype.type(rstd)
                xr, yr = x[r], y[r]
                if r + 1 < r1:
                    xn = x[r + 1]
                    k = np.float64(xn[0])
                    s1 = 0.0
                    s2 = 0.0
                    for j in range(d):
                        yr[j] = (xr[j] - m_t) * s_t * w[j] + b[j]
                        v = np.float64(xn[j]) - k
                        s1 += v
                        s2 += v * v
                else:
                    for j in range(d):
                        yr[j] = (xr[j] - m_t) * s_t * w[j] + b[j]

    @jit
    def rms_fwd(x, w, eps, y, rstd_out, n_chunks):
        """As ln_fwd: the sum of squares of row r + 1 is taken while row r is written."""
        rows, d = x.shape
        per = (rows + n_chunks - 1) // n_chunks
        for c in prange(n_chunks):
            r0, r1 = c * per, min(rows, (c + 1) * per)
            if r0 >= r1:
                continue
            sq = sum_squares(x[r0], d)
            for r in range(r0, r1):
                rstd = 1.0 / math.sqrt(sq / d + eps)
                rstd_out[r] = rstd
                s_t = x.dtype.type(rstd)
                xr, yr = x[r], y[r]
                if r + 1 < r1:
                    xn = x[r + 1]
                    sq = 0.0
                    for j in range(d):
                        yr[j] = xr[j] * s_t * w[j]
                        v = np.float64(xn[j])
                        sq += v * v
                else:
                    for j in range(d):
                        yr[j] = xr[j] * s_t * w[j]

    @jit
    def norm_bwd(x, w, g, mean, rstd, dx, dw_part, db_part, n_chunks, centre):
        """dx = r (h - mean(h) - x_hat mean(h x_hat)), h = g gamma (without the mean(h) term
        and with x_hat = x r for RMSNorm). Each chunk of rows keeps float64 partial sums of
        g x_hat and g; the caller adds the chunks (dL/dgamma, dL/dbeta)."""
        rows, d = x.shape
        per = (rows + n_chunks - 1) // n_chunks
        for c in prange(n_chunks):
            dwc, dbc = dw_part[c], db_part[c]
            for r in range(c * per, min(rows, (c + 1) * per)):
                mu, s = mean[r], rstd[r]
                xr, gr, dxr = x[r], g[r], dx[r]
                sh = 0.0
                shx = 0.0
                for j in range(d):
                    gv = np.float64(gr[j])
                    xh = (np.float64(xr[j]) - mu) * s
                    h = gv * w[j]
                    sh += h
                    shx += h * xh
                    dwc[j] += gv * xh
                    dbc[j] += gv
                mh = sh / d if centre else 0.0
                mhx = shx / d
                for j in range(d):
                    xh = (np.float64(xr[j]) - mu) * s
                    dxr[j] = s * (np.float64(gr[j]) * w[j] - mh - xh * mhx)

    # ---- float16 / bfloat16 in the kernel: bits in, bits out, float32 in between ----
    @inline
    def decode(h, fmt):
        """uint16 bits (fmt 0: float16, 1: bfloat16) -> float32 bits. float16 finite values
        come out with the exponent still biased by 15: the caller multiplies by 2^112,
        which rebiases normals and subnormals alike, exactly."""
        h = np.uint32(h)
        if fmt == 1:
            return h << np.uint32(16)
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        mag = (h & np.uint32(0x7FFF)) << np.uint32(13)
        if (h & np.uint32(0x7C00)) == np.uint32(0x7C00):  # inf, nan
            return sign | np.uint32(0x7F800000) | mag
        return sign | mag

    @inline
    def encode(v, bits, fmt):
        """float32 value (and its bits) -> uint16 bits, rounded to nearest, ties to even
        (checked against NumPy's and ml_dtypes' casts on every float16 and 5M float32)."""
        sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
        a = bits & np.uint32(0x7FFFFFFF)
        if fmt == 1:
            if a > np.uint32(0x7F800000):
                return np.uint16(sign | np.uint32(0x7FC0))
            return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                             >> np.uint32(16))
        if a >= np.uint32(0x47800000):  # |v| >= 65536: inf, or nan
            nan = a > np.uint32(0x7F800000)
            return np.uint16(sign | (np.uint32(0x7E00) if nan else np.uint32(0x7C00)))
        if a < np.uint32(0x38800000):  # a float16 subnormal: exact after scaling by 2^24
            return np.uint16(sign | np.uint32(np.rint(abs(v) * np.float32(16777216.0))))
        odd = (a >> np.uint32(13)) & np.uint32(1)
        a = a - np.uint32(0x38000000) + np.uint32(0xFFF) + odd  # rebias 127 -> 15, round
        return np.uint16(sign | (a >> np.uint32(13)))

    @inline
    def decode_row(src, dst_bits, dst, fmt):
        for j in range(src.shape[0]):
            dst_bits[j] = decode(src[j], fmt)
        if fmt == 0:
            for j in range(src.shape[0]):
                if (src[j] & np.uint16(0x7C00)) != np.uint16(0x7C00):
                    dst[j] = dst[j] * np.float32(2.0**112)

    @inline
    def encode_row(src, src_bits, dst, fmt):
        for j in range(src.shape[0]):
            dst[j] = encode(src[j], src_bits[j], fmt)

    @jit
    def half_fwd(x16, w, b, eps, y16, mean_out, rstd_out, n_chunks, fmt, centre):
        """LayerNorm (centre) or RMSNorm forward on float16/bfloat16 bits: each row is
        decoded into a float32 scratch row, normalized there (statistics in float64) and
        encoded once into the output."""
        rows, d = x16.shape
        per = (rows + n_chunks - 1) // n_chunks
        for c in prange(n_chunks):
            x_bits = np.empty(d, np.uint32)
            xf = x_bits.view(np.float32)
            yf = np.empty(d, np.float32)
            y_bits = yf.view(np.uint32)
            for r in range(c * per, min(rows, (c + 1) * per)):
                decode_row(x16[r], x_bits, xf, fmt)
                if centre:
                    k, s1, s2 = shifted_sums(xf, d)
                    mu, rstd = moments(k, s1, s2, d, eps)
                else:
                    mu, rstd = 0.0, 1.0 / math.sqrt(sum_squares(xf, d) / d + eps)
                mean_out[r], rstd_out[r] = mu, rstd
                m32, s32 = np.float32(mu), np.float32(rstd)
                for j in range(d):
                    yf[j] = (xf[j] - m32) * s32 * w[j] + b[j]
                encode_row(yf, y_bits, y16[r], fmt)

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
    def bn_bwd(x, w, g, mean, var, eps, dx, dw, db, batch):
        """dL/dx, dL/dgamma, dL/dbeta per channel. With `batch` the statistics are the
        batch's, functions of x: dx = r (h - mean(h) - x_hat mean(h x_hat)). Without (eval
        on running statistics) they are constants and dx = r h, h = g gamma; dL/dgamma and
        dL/dbeta are sum g x_hat and sum g either way, x_hat from the statistics given."""
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
            if not batch:
                for i in range(n):
                    for l_ in range(length):
                        dx[i, c, l_] = s * np.float64(g[i, c, l_]) * w[c]
                continue
            for i in range(n):
                for l_ in range(length):
                    xh = (np.float64(x[i, c, l_]) - mean[c]) * s
                    dx[i, c, l_] = s * (np.float64(g[i, c, l_]) * w[c] - sh / m - xh * shx / m)

    _kernels.cache = dict(ln_fwd=ln_fwd, rms_fwd=rms_fwd, norm_bwd=norm_bwd, half_fwd=half_fwd,
                          bn_stats=bn_stats, bn_apply=bn_apply, bn_bwd=bn_bwd)
    return _kernels.cache


_kernels.cache = None


def _rows(a, d, ct):
    return np.ascontiguousarray(a, dtype=ct).reshape(-1, d)


def _param(p, d, ct, fill):
    return np.full(d, fill, ct) if p is None else np.ascontiguousarray(p, dtype=ct).reshape(d)


def _chunks(rows):
    """One contiguous chunk of rows per thread (fewer when there are fewer rows)."""
    return max(1, min(rows, numba.get_num_threads()))


class NumbaBackend(Backend):
    name = "numba"
    capabilities = Capabilities(
        ops={"layer_norm", "rms_norm", "qk_norm_scores", "batch_norm"}, dtypes=DTYPES,
        gradients={"layer_norm", "rms_norm", "batch_norm"}, cumulative_momentum=True,
        untracked_stats=True)
    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": 1e-6, "batch_norm": 1e-5},
        half_compute_dtype="float32 (statistics accumulated in float64)")

    def __init__(self):
        if numba is None:
            raise BackendUnavailable(f"numba is not installed: {_IMPORT_ERROR}")
        self.version = numba.__version__
        self.k = _kernels()

    def _forward(self, op, xr, w, b, eps, out=None):
        rows = xr.shape[0]
        y, mean, rstd = out if out is not None else (
            np.empty_like(xr), np.zeros(rows), np.empty(rows))
        n_chunks = _chunks(rows)
        if op == "layer_norm":
            self.k["ln_fwd"](xr, w, b, float(eps), y, mean, rstd, n_chunks)
        else:
            self.k["rms_fwd"](xr, w, float(eps), y, rstd, n_chunks)
        return y, mean, rstd

    def _backward(self, op, xr, w, g, mean, rstd, out=None):
        n_chunks = _chunks(xr.shape[0])
        d = xr.shape[1]
        dx, dw_part, db_part = out if out is not None else (
            np.empty_like(xr), np.empty((n_chunks, d)), np.empty((n_chunks, d)))
        dw_part[...] = 0.0
        db_part[...] = 0.0
        self.k["norm_bwd"](xr, w.astype(np.float64), g, mean, rstd, dx, dw_part, db_part,
                           n_chunks, op == "layer_norm")
        return dx, dw_part.sum(axis=0), db_part.sum(axis=0)

    def _half_forward(self, op, x16, fmt, w, b, eps, out=None):
        rows = x16.shape[0]
        y16, mean, rstd = out if out is not None else (
            np.empty_like(x16), np.empty(rows), np.empty(rows))
        self.k["half_fwd"](x16, w, b, float(eps), y16, mean, rstd, _chunks(rows), fmt,
                           op == "layer_norm")
        return y16, mean, rstd

    def _norm(self, op, x, normalized_shape, weight, bias, eps, grad_output):
        ct, d = compute_dtype(x.dtype), int(np.prod(normalized_shape))
        if x.dtype in HALF and grad_output is None:
            # the kernel reads and writes the 16-bit values itself: no float32 copies
            x16 = np.ascontiguousarray(x).reshape(-1, d).view(np.uint16)
            w, b = _param(weight, d, ct, 1.0), _param(bias, d, ct, 0.0)
            y16, _, _ = self._half_forward(op, x16, _FMT[x.dtype], w, b, eps)
            return Result(y16.view(x.dtype).reshape(x.shape))
        xr = _rows(x, d, ct)
        w, b = _param(weight, d, ct, 1.0), _param(bias, d, ct, 0.0)
        y, mean, rstd = self._forward(op, xr, w, b, eps)
        out = y.reshape(x.shape).astype(x.dtype, copy=False)
        if grad_output is None:
            return Result(out)
        dx, dw, db = self._backward(op, xr, w, _rows(grad_output, d, ct), mean, rstd)
        shape = tuple(normalized_shape)
        gw = dw.reshape(shape).astype(x.dtype) if weight is not None else None
        gb = db.reshape(shape).astype(x.dtype) if bias is not None else None
        return Result(out, dx.reshape(x.shape).astype(x.dtype, copy=False), gw, gb)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._norm("layer_norm", x, normalized_shape, weight, bias, eps, grad_output)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._norm("rms_norm", x, normalized_shape, weight, None, eps, grad_output)

    def prepare_benchmark(self, op, x, normalized_shape, weight, bias, eps, grad_output=None):
        """The kernels on arrays made once, for `normspec bench`: outputs are allocated once,
        as the memory-copy baseline's are (a fresh 128 MB buffer costs its page faults, which
        measure the allocator, not the kernel). Half inputs go through the protocol call,
        converted to float32 and back inside the timed call for the backward (Numba has no
        float16 arrays; the forward kernel decodes and encodes the 16-bit values itself)."""
        backward = grad_output is not None
        if x.dtype in HALF and not backward:
            d = int(np.prod(normalized_shape))
            x16 = np.ascontiguousarray(x).reshape(-1, d).view(np.uint16)
            w, b = _param(weight, d, np.float32, 1.0), _param(bias, d, np.float32, 0.0)
            out = (np.empty_like(x16), np.empty(x16.shape[0]), np.empty(x16.shape[0]))
            return lambda: self._half_forward(op, x16, _FMT[x.dtype], w, b, eps, out)
        if x.dtype in HALF:
            args = (x, normalized_shape, weight, bias, eps) if op == "layer_norm" else \
                (x, normalized_shape, weight, eps)
            return lambda: getattr(self, op)(*args, grad_output=grad_output)
        d = int(np.prod(normalized_shape))
        xr = _rows(x, d, x.dtype)
        rows, n_chunks = xr.shape[0], _chunks(xr.shape[0])
        w, b = _param(weight, d, x.dtype, 1.0), _param(bias, d, x.dtype, 0.0)
        fwd_out = (np.empty_like(xr), np.zeros(rows), np.empty(rows))
        if not backward:
            return lambda: self._forward(op, xr, w, b, eps, fwd_out)
        g = _rows(grad_output, d, x.dtype)
        bwd_out = (np.empty_like(xr), np.empty((n_chunks, d)), np.empty((n_chunks, d)))

        def forward_backward():
            _, mean, rstd = self._forward(op, xr, w, b, eps, fwd_out)
            self._backward(op, xr, w, g, mean, rstd, bwd_out)
        return forward_backward

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        ct, d = compute_dtype(q.dtype), q.shape[-1]
        # q_hat and k_hat are stored in the input dtype, as a model's RMSNorm output would be
        q_hat = self.rms_norm(q, (d,), q_weight, eps).output.astype(ct)
        k_hat = self.rms_norm(k, (d,), k_weight, eps).output.astype(ct)
        return (np.matmul(q_hat, np.swapaxes(k_hat, -1, -2)) * ct.type(scale)).astype(q.dtype)

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return NumbaBatchNorm(self.k, num_features, eps, momentum, affine, track_running_stats,
                              np.dtype(dtype), weight, bias)


class NumbaBatchNorm(RunningStatsLayer):
    def __init__(self, k, c, eps, momentum, affine, track, dtype, weight, bias):
        self.k, self.eps, self.momentum, self.dtype = k, eps, momentum, dtype
        self.ct = compute_dtype(dtype)
        self.affine = affine
        self.w = _param(weight if affine else None, c, np.float64, 1.0)
        self.b = _param(bias if affine else None, c, np.float64, 0.0)
        self.stats = RunningStats(c, track, self.ct, dtype, momentum)
        self.training = True

    def forward(self, x, grad_output=None):
        n, c = x.shape[:2]
        x3 = np.ascontiguousarray(x, dtype=self.ct).reshape(n, c, -1)
        m = n * x3.shape[2]
        batch = self.training or not self.stats.tracked
        if batch:
            if m <= 1:
                raise ValueError(f"Expected more than 1 value per channel when training, "
                                 f"got input of shape {x.shape}")
            mean, sumsq = np.empty(c), np.empty(c)
            self.k["bn_stats"](x3, mean, sumsq)
            var = sumsq / m
            if self.training and self.stats.tracked:
                self.stats.update(mean, sumsq, m)
        else:
            mean, var = self.stats.mean.astype(np.float64), self.stats.var.astype(np.float64)
        y = np.empty(x3.shape)
        self.k["bn_apply"](x3, mean, var, self.w, self.b, float(self.eps), y)
        out = y.reshape(x.shape).astype(self.dtype)
        if grad_output is None:
            return Result(out)
        g3 = np.ascontiguousarray(grad_output, dtype=self.ct).reshape(x3.shape)
        dx, dw, db = np.empty(x3.shape), np.empty(c), np.empty(c)
        self.k["bn_bwd"](x3, self.w, g3, mean, var, float(self.eps), dx, dw, db, batch)
        gw = dw.astype(self.dtype) if self.affine else None
        gb = db.astype(self.dtype) if self.affine else None
        return Result(out, dx.reshape(x.shape).astype(self.dtype), gw, gb)


def make_backend() -> NumbaBackend:
    return NumbaBackend()
