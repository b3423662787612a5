"""`numba`: CPU kernels compiled by Numba, parallel over rows with `prange`.

Each row is read once from memory: its statistics come from one read (shifted-data sums
of x - k and (x - k)^2 with k = x[0], accumulated in float64, which a large mean cannot
cancel), then the row is normalized from cache and written once. float16 and bfloat16
are computed in float32 and rounded once: the kernels decode and encode the 16-bit
values themselves (round to nearest even), so a half-precision call moves half the bytes
of a float32 one; their forward statistics are float32 block sums around the mean of
the row's first 16 elements, added in float64, and summed again in float64 where that
could lose accuracy (_numba_rows._half_stats). The backward of float32 rows is computed
in float32 as well, its row sums in float64 lanes fed by short float32 partial sums
(_numba_lanes), dgamma/dbeta likewise (_numba_backward.FLUSH_ROWS_F32); float64 rows in
float64. The kernels live in _numba_rows.py (forward), _numba_moments.py (its row
sums), _numba_norm_row.py (its normalize loop, which streams large outputs: see
_numba_stream.py), _numba_backward.py, _numba_codec.py, _numba_fused.py and
_numba_bn.py, compiled as _numba_jit.py says (cached on disk; no fast-math but
contraction, and every sum in one written-out order, so a row's bits are the same in
any batch and in every process).
"""

from __future__ import annotations

import functools
import glob
import os

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
    FusedAddNormResult,
    Result,
    compute_dtype,
    np_dtype,
)

HALF = tuple(np_dtype(name) for name in HALF_DTYPES)
_FMT = {np.dtype(np.float16): 0, np.dtype(ml_dtypes.bfloat16): 1}

try:
    import numba
except ImportError as exc:  # the registry reports the backend as unavailable
    numba = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None


def _kernels():
    """The compiled kernels, imported on first use: importing this module never pays for
    compilation, and Numba's on-disk cache means only the first process ever does."""
    from . import _numba_backward as backward
    from . import _numba_bn as bn
    from . import _numba_fused as fused
    from . import _numba_rows as rows
    from ._numba_jit import COMPILING

    kernels = dict(ln_fwd=rows.ln_fwd, rms_fwd=rows.rms_fwd, half_fwd=rows.half_fwd,
                   bwd=backward.bwd, bwd_cols=backward.bwd_cols, bn_stats=bn.bn_stats,
                   bn_apply=bn.bn_apply, channels_first=bn.channels_first,
                   bn_grad_sums=bn.bn_grad_sums, bn_dx=bn.bn_dx,
                   add_norm_fwd=fused.add_norm_fwd, half_add_norm_fwd=fused.half_add_norm_fwd,
                   decode_all=rows.decode_all, encode_all=rows.encode_all)
    return {name: COMPILING.time(k) for name, k in kernels.items()}


def _writable(a):
    """`a`, or a copy of it if it is read-only: Numba types read-only arrays apart, so
    each kernel would be compiled again for them (seconds): one compiled kernel per
    dtype, whatever the caller's arrays. (That second kernel, loaded from Numba's cache
    while the first was compiled afresh, once rounded a float64 row's mean 1 ULP apart;
    the sums are in a fixed order now, see _numba_moments.)"""
    return a if a.flags.writeable else a.copy()


def _rows(a, d, ct):
    return _writable(np.ascontiguousarray(a, dtype=ct)).reshape(-1, d)


def _bits(a, d):
    """A float16/bfloat16 array as rows of its 16-bit patterns (a view when contiguous)."""
    return _writable(np.ascontiguousarray(a)).reshape(-1, d).view(np.uint16)


#: Bytes every row of the backward's scratch starts on: one cache line, the width of the
#: widest vector the kernels use (AVX-512).
ROW_ALIGN = 64
#: The span of address bits a CPU compares first when a load follows a store (4K aliasing).
PAGE = 4096


def scratch_rows(n: int, d: int, dtypes) -> list[np.ndarray]:
    """One uninitialised [n, d'] array per dtype of `dtypes`, in one buffer, which the
    kernels update together element by element: every row starts on a ROW_ALIGN-byte
    boundary (d' is d rounded up to whole ROW_ALIGN bytes; the kernels use the first d),
    and the k arrays start PAGE / k bytes apart modulo PAGE (rounded down to whole
    ROW_ALIGN bytes). Unaligned, every vector access to them spans two cache lines; at
    the same address modulo PAGE, the load of one waits for the store to the other (a
    CPU first compares a load's low 12 address bits with the stores in flight). The
    [256, 1000] float32 backward took 92 us with unaligned rows and 111 us with aligned
    ones 4 KB apart, 58-61 us laid out so (two threads, one process)."""
    step = PAGE // len(dtypes) // ROW_ALIGN * ROW_ALIGN
    layout, end = [], 0
    for dtype in dtypes:
        itemsize = np.dtype(dtype).itemsize
        per_row = -(-d * itemsize // ROW_ALIGN) * ROW_ALIGN // itemsize
        start = end + (len(layout) * step - end) % PAGE
        layout.append((start, dtype, per_row))
        end = start + n * per_row * itemsize
    raw = np.empty(end + PAGE, np.uint8)
    base = -raw.ctypes.data % PAGE
    return [raw[base + start:base + start + n * per_row * np.dtype(dtype).itemsize]
            .view(dtype).reshape(n, per_row) for start, dtype, per_row in layout]


def _param(p, d, ct, fill):
    return np.full(d, fill, ct) if p is None else _writable(np.ascontiguousarray(p, dtype=ct)).reshape(d)


def _half_params(weight, bias, d, dtype):
    """gamma and beta for the half forward (None: ones, zeros): as 16-bit patterns of
    `dtype` when both are exactly representable there: half the bytes, so they stay in
    L1 beside the row (see _numba_rows._half_fwd_rows); else as float32 vectors, which
    the kernel reads as they are. Parameters given in `dtype` are passed as their own
    bits, never converted: NumPy converts float16 at about 1 ns an element, and the
    round trip through float32 and back took 10 of the 12 ms of a [2, 2^20] float16
    forward."""
    if all(p is None or np.asarray(p).dtype == dtype for p in (weight, bias)):
        return tuple(np.full(d, fill, dtype).view(np.uint16) if p is None
                     else _bits(p, d).reshape(d) for p, fill in ((weight, 1.0), (bias, 0.0)))
    w, b = _param(weight, d, np.float32, 1.0), _param(bias, d, np.float32, 0.0)
    wh, bh = w.astype(dtype), b.astype(dtype)
    if (np.array_equal(wh.astype(np.float32), w, equal_nan=True)
            and np.array_equal(bh.astype(np.float32), b, equal_nan=True)):
        return wh.view(np.uint16), bh.view(np.uint16)
    return w, b


@functools.cache
def last_level_cache_bytes(folder: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of this machine's largest CPU cache (the highest level), as Linux lists it
    in sysfs (read once: the forward asks at every call); 32 MiB where it lists nothing."""
    sizes = {}
    for index in glob.glob(os.path.join(folder, "index*")):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes[level] = max(sizes.get(level, 0), int(digits) * unit)
    return sizes[max(sizes)] if sizes else 32 << 20


def stream_rows(y) -> bool:
    """Whether the forward streams output rows `y` to memory: when y is at least the
    last-level cache's size, so it would not stay in cache anyway (see _numba_stream)."""
    return y.nbytes >= last_level_cache_bytes()


def _chunks(rows):
    """One contiguous chunk of rows per thread (fewer when there are fewer rows)."""
    return max(1, min(rows, numba.get_num_threads()))


class NumbaBackend(Backend):
    name = "numba"
    capabilities = Capabilities(
        ops={"layer_norm", "rms_norm", "qk_norm_scores", "batch_norm", "fused_add_norm"},
        dtypes=DTYPES, gradients={"layer_norm", "rms_norm", "batch_norm", "fused_add_norm"},
        cumulative_momentum=True,
        untracked_stats=True)
    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": 1e-6, "batch_norm": 1e-5},
        half_compute_dtype="float32 (statistics accumulated in float64)",
        fused_residual_sum="float32",
        reasons={"fused_residual_sum": "the fused kernel normalizes the sum it formed in "
                                       "float32 (the compute precision) and rounds only the "
                                       "residual it writes back, as vLLM's native IR does"})

    def __init__(self):
        if numba is None:
            raise BackendUnavailable(f"numba is not installed: {_IMPORT_ERROR}")
        self.version = numba.__version__
        self.k = _kernels()
        from ._numba_backward import COLUMN_ROWS, sums_dtype

        #: Fewer rows than this take the column-tiled backward (_numba_backward), which
        #: writes dgamma/dbeta in the dtype sums_dtype gives.
        self.column_rows, self.sums_dtype = COLUMN_ROWS, sums_dtype

    def compile_seconds(self) -> float:
        from ._numba_jit import COMPILING

        return COMPILING.seconds

    def _forward(self, op, xr, w, b, eps, out=None):
        rows = xr.shape[0]
        y, mean, rstd = out if out is not None else (
            np.empty_like(xr), np.zeros(rows), np.empty(rows))
        n_chunks, stream = _chunks(rows), stream_rows(y)
        if op == "layer_norm":
            self.k["ln_fwd"](xr, w, b, float(eps), y, mean, rstd, n_chunks, stream)
        else:
            self.k["rms_fwd"](xr, w, float(eps), y, rstd, n_chunks, stream)
        return y, mean, rstd

    def _half_forward(self, op, x16, fmt, params, eps, out=None):
        """`params`: gamma and beta as _half_params made them."""
        rows = x16.shape[0]
        y16, mean, rstd = out if out is not None else (
            np.empty_like(x16), np.empty(rows), np.empty(rows))
        self.k["half_fwd"](x16, *params, float(eps), y16, mean, rstd, _chunks(rows), fmt,
                           op == "layer_norm", stream_rows(y16))
        return y16, mean, rstd

    def _bwd_out(self, xr):
        """The backward's outputs: dx (bits for 16-bit rows), then for column_rows or
        more rows (bwd) float64 dgamma/dbeta per chunk, one per thread, and the float32
        rows the float32-compute kernel sums a few rows in before adding them (never
        touched, so never paged in, for float64 rows), laid out by scratch_rows; for
        fewer (bwd_cols) dgamma and dbeta themselves, of the dtype sums_dtype gives (laid
        out so too: the kernel's vectors of them then never span two cache lines)."""
        rows, d = xr.shape
        dx = np.empty_like(xr)
        if rows < self.column_rows:
            dw, db = scratch_rows(1, d, (self.sums_dtype(rows, xr.dtype),) * 2)
            return dx, dw[0, :d], db[0, :d]
        return (dx, *scratch_rows(_chunks(rows), d, (np.float64, np.float64, np.float32,
                                                      np.float32)))

    def _backward(self, op, xr, w, g, mean, rstd, fmt=None, out=None):
        """dx, dgamma, dbeta of rows `xr` (16-bit rows as their patterns, fmt 0 float16,
        1 bfloat16; fmt None otherwise), computed as _numba_backward says; `out` as
        _bwd_out makes it. bwd leaves the final float64 dgamma/dbeta in the first of its
        partial rows; few rows take bwd_cols (see _numba_backward.COLUMN_ROWS)."""
        rows, d = xr.shape
        dx, *sums = out if out is not None else self._bwd_out(xr)
        centre, fmt = op == "layer_norm", -1 if fmt is None else fmt
        if rows < self.column_rows:
            dw, db = sums
            means = np.empty((rows, 4), np.float64 if xr.dtype == np.float64 else np.float32)
            self.k["bwd_cols"](xr, w, g, mean, rstd, dx, dw, db, means, fmt, centre)
            return dx, dw, db
        dw_part, db_part, dw32, db32 = sums
        self.k["bwd"](xr, w, g, mean, rstd, dx, dw_part, db_part, dw32, db32, fmt, centre)
        return dx, dw_part[0, :d], db_part[0, :d]

    def _norm(self, op, x, normalized_shape, weight, bias, eps, grad_output):
        ct, d = compute_dtype(x.dtype), int(np.prod(normalized_shape))
        if x.dtype in HALF:
            # the kernels read and write the 16-bit values themselves: no float32 copies
            fmt = _FMT[x.dtype]
            x16 = _bits(x, d)
            y16, mean, rstd = self._half_forward(
                op, x16, fmt, _half_params(weight, bias, d, x.dtype), eps)
            out = y16.view(x.dtype).reshape(x.shape)
            if grad_output is None:
                return Result(out)
            dx16, dw, db = self._backward(op, x16, self._half_param32(weight, d, x.dtype),
                                          _bits(grad_output, d), mean, rstd, fmt)
            dx = dx16.view(x.dtype)
            dw, db = self._to_half(dw, x.dtype), self._to_half(db, x.dtype)
        else:
            w, b = _param(weight, d, ct, 1.0), _param(bias, d, ct, 0.0)
            xr = _rows(x, d, ct)
            y, mean, rstd = self._forward(op, xr, w, b, eps)
            out = y.reshape(x.shape).astype(x.dtype, copy=False)
            if grad_output is None:
                return Result(out)
            dx, dw, db = self._backward(op, xr, w, _rows(grad_output, d, ct), mean, rstd)
        shape = tuple(normalized_shape)
        gw = dw.reshape(shape).astype(x.dtype) if weight is not None else None
        gb = db.reshape(shape).astype(x.dtype) if bias is not None else None
        return Result(out, dx.reshape(x.shape).astype(x.dtype, copy=False), gw, gb)

    def _half_param32(self, p, d, dtype):
        """gamma for a 16-bit backward, as float32: given in `dtype`, decoded by the
        kernels (exact but a NaN's payload, and faster than NumPy's float16 cast)."""
        if p is None or np.asarray(p).dtype != dtype:
            return _param(p, d, np.float32, 1.0)
        out = np.empty(d, np.float32)
        self.k["decode_all"](_bits(p, d).reshape(d), _FMT[dtype], out)
        return out

    def _to_half(self, a, dtype):
        """float32 sums `a` rounded to 16-bit `dtype` by the kernels' codec (NumPy's
        bits but a NaN's payload; see _numba_rows.encode_all); float64 sums are left to
        the caller's cast, which rounds them once, as the spec does."""
        if a.dtype != np.float32:
            return a
        out = np.empty(a.shape, np.uint16)
        self.k["encode_all"](np.ascontiguousarray(a).reshape(-1), _FMT[dtype], out.reshape(-1))
        return out.view(dtype)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._norm("layer_norm", x, normalized_shape, weight, bias, eps, grad_output)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._norm("rms_norm", x, normalized_shape, weight, None, eps, grad_output)

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        """The fused kernels of _numba_fused.py; the backward runs _backward at the
        unrounded sum (kept in the compute precision) and adds dL/dresidual'."""
        ct, d = compute_dtype(x.dtype), int(np.prod(normalized_shape))
        centre = norm == "layer_norm"
        w, b = _param(weight, d, ct, 1.0), _param(bias, d, ct, 0.0)
        if x.dtype in HALF and grad_outputs is None:
            x16 = _bits(x, d)
            r16 = _bits(residual, d)
            y16, s16 = np.empty_like(x16), np.empty_like(x16)
            self.k["half_add_norm_fwd"](x16, r16, w, b, float(eps), y16, s16,
                                        _chunks(x16.shape[0]), _FMT[x.dtype], centre)
            return FusedAddNormResult(y16.view(x.dtype).reshape(x.shape),
                                      s16.view(x.dtype).reshape(x.shape))
        # float32/float64 rows (half rows with a backward: decoded to float32 here)
        xr, rr = _rows(x, d, ct), _rows(residual, d, ct)
        rows = xr.shape[0]
        y, s, mean, rstd = np.empty_like(xr), np.empty_like(xr), np.zeros(rows), np.empty(rows)
        self.k["add_norm_fwd"](xr, rr, w, b, float(eps), y, s, mean, rstd, _chunks(rows),
                               centre)
        out = y.reshape(x.shape).astype(x.dtype)
        new_residual = s.reshape(x.shape).astype(x.dtype)
        if grad_outputs is None:
            return FusedAddNormResult(out, new_residual)
        dx, dw, db = self._backward(norm, s, w, _rows(grad_outputs[0], d, ct), mean, rstd)
        g = (dx + _rows(grad_outputs[1], d, ct)).reshape(x.shape).astype(x.dtype)
        shape = tuple(normalized_shape)
        gw = dw.reshape(shape).astype(x.dtype) if weight is not None else None
        gb = db.reshape(shape).astype(x.dtype) if bias is not None else None
        return FusedAddNormResult(out, new_residual, g, g.copy(), gw, gb)

    def prepare_benchmark(self, op, x, normalized_shape, weight, bias, eps, grad_output=None):
        """The kernels on arrays made once, for `normspec bench`: outputs are allocated once,
        as the memory-copy baseline's are (a fresh 128 MB buffer costs its page faults, which
        measure the allocator, not the kernel; the bench times the protocol call too, which
        pays them). Half-precision arrays are passed as their 16-bit patterns, which the
        kernels decode and encode themselves."""
        backward = grad_output is not None
        d = int(np.prod(normalized_shape))
        half = x.dtype in HALF
        ct = compute_dtype(x.dtype)
        xr = _bits(x, d) if half else _rows(x, d, ct)
        rows = xr.shape[0]
        w, b = _param(weight, d, ct, 1.0), _param(bias, d, ct, 0.0)
        fwd_out = (np.empty_like(xr), np.zeros(rows), np.empty(rows))
        fmt = _FMT.get(x.dtype)
        if half:
            params = _half_params(weight, bias, d, x.dtype)

            def forward():
                return self._half_forward(op, xr, fmt, params, eps, fwd_out)
        else:
            def forward():
                return self._forward(op, xr, w, b, eps, fwd_out)
        if not backward:
            return forward
        g = _bits(grad_output, d) if half else _rows(grad_output, d, ct)
        bwd_out = self._bwd_out(xr)

        def forward_backward():
            _, mean, rstd = forward()
            self._backward(op, xr, w, g, mean, rstd, fmt, bwd_out)
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
        #: What bn_apply and bn_dx store their float64 results in: float32 and float64
        #: layers' own dtype (one rounding, as NumPy's cast of a float64 array makes, and
        #: no float64 array and cast: [32, 64, 3136] float32 forward+backward 21.4 -> 7.2 ms),
        #: float64 for 16-bit layers, which the cast then rounds once (a float32 store
        #: would round twice).
        self.out_dtype = dtype if dtype.itemsize >= 4 else np.dtype(np.float64)
        self.training = True
        from ._numba_bn import PIECE, SHORT_ROWS

        self.short_rows = SHORT_ROWS
        self.ones = np.ones(PIECE)

    def _sum_layout(self, a3):
        """[n, c, length] as the kernels sum it: rows shorter than SHORT_ROWS as one row
        per channel, [1, c, n length] (a copy)."""
        n, c, length = a3.shape
        if length >= self.short_rows:
            return a3
        out = np.empty((c, n, length), a3.dtype)
        self.k["channels_first"](a3, out)
        return out.reshape(1, c, n * length)

    def forward(self, x, grad_output=None):
        n, c = x.shape[:2]
        length = int(np.prod(x.shape[2:]))  # (not -1: a batch of 0 has no size to infer)
        x3 = _writable(np.ascontiguousarray(x, dtype=self.ct)).reshape(n, c, length)
        m = n * x3.shape[2]
        batch = self.training or not self.stats.tracked
        x_sums = None
        if batch:
            if m <= 1:
                raise ValueError(f"Expected more than 1 value per channel when training, "
                                 f"got input of shape {x.shape}")
            mean, sumsq = np.empty(c), np.empty(c)
            x_sums = self._sum_layout(x3)
            self.k["bn_stats"](x_sums, mean, sumsq)
            var = sumsq / m
            if self.training and self.stats.tracked:
                self.stats.update(mean, sumsq, m)
        else:
            mean, var = self.stats.mean.astype(np.float64), self.stats.var.astype(np.float64)
        y = np.empty(x3.shape, self.out_dtype)
        self.k["bn_apply"](x3, mean, var, self.w, self.b, float(self.eps), y)
        out = y.reshape(x.shape).astype(self.dtype, copy=False)
        if grad_output is None:
            return Result(out)
        g3 = _writable(np.ascontiguousarray(grad_output, dtype=self.ct)).reshape(x3.shape)
        sums = np.empty((4, c))
        self.k["bn_grad_sums"](x_sums if x_sums is not None else self._sum_layout(x3),
                               self._sum_layout(g3), self.w, mean, var, float(self.eps),
                               self.ones, sums)
        dx = np.empty(x3.shape, self.out_dtype)
        self.k["bn_dx"](x3, self.w, g3, mean, var, float(self.eps), sums, dx, batch)
        gw = sums[1].astype(self.dtype, copy=False) if self.affine else None
        gb = sums[0].astype(self.dtype, copy=False) if self.affine else None
        return Result(out, dx.reshape(x.shape).astype(self.dtype, copy=False), gw, gb)


def make_backend() -> NumbaBackend:
    return NumbaBackend()
