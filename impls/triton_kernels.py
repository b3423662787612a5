"""`triton`: Triton kernels for LayerNorm and RMSNorm (forward and backward) and the
BatchNorm training forward, on torch tensors.

Written for a GPU; where no CUDA device is present the adapter runs the same kernels in
Triton's interpreter (TRITON_INTERPRET=1) on torch CPU tensors, which is how CI checks
them. Rows are processed one program each, in blocks of at most 4096 columns with float32
accumulation (float64 for float64 inputs); the variance is two-pass, so a large mean does
not cancel it; dL/dgamma and dL/dbeta are reduced across rows by a second kernel.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ._running import RunningStats, RunningStatsLayer
from ._torch_arrays import to_numpy, to_torch
from .protocol import (
    DTYPES,
    Backend,
    BackendUnavailable,
    Capabilities,
    Conventions,
    Result,
)

MAX_BLOCK = 4096


def _import():
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailable(f"torch is not installed (triton needs it): {exc}") from exc
    if not torch.cuda.is_available():
        # no GPU: the interpreter runs the kernels on CPU tensors; it must be chosen
        # before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise BackendUnavailable(f"triton is not installed: {exc}") from exc
    return torch, triton, tl


def _build(triton, tl):
    @triton.jit
    def norm_fwd(X, W, B, Y, Mean, Rstd, D, eps, BLOCK: tl.constexpr, ACC64: tl.constexpr,
                 CENTRE: tl.constexpr):
        """One program per row. CENTRE (LayerNorm): two-pass mean and centred sum of
        squares; otherwise (RMSNorm) the mean stays 0, the raw sum of squares is used and B
        is not read. Mean and 1/std are stored for the backward."""
        row = tl.program_id(0)
        x_row = X + row * D
        acc_t = tl.float64 if ACC64 else tl.float32
        mean = 0.0
        if CENTRE:
            total = tl.zeros([BLOCK], dtype=acc_t)
            for off in range(0, D, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                total += tl.load(x_row + cols, mask=cols < D, other=0.0).to(acc_t)
            mean = tl.sum(total, axis=0) / D
        sq = tl.zeros([BLOCK], dtype=acc_t)
        for off in range(0, D, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(acc_t)
            c = tl.where(cols < D, x - mean, 0.0)
            sq += c * c
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / D + eps)
        tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)
        for off in range(0, D, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < D
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(acc_t)
            w = tl.load(W + cols, mask=mask, other=0.0).to(acc_t)
            y = (x - mean) * rstd * w
            if CENTRE:
                y += tl.load(B + cols, mask=mask, other=0.0).to(acc_t)
            tl.store(Y + row * D + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def norm_bwd(X, W, G, Mean, Rstd, DX, GXH, D, BLOCK: tl.constexpr, ACC64: tl.constexpr,
               CENTRE: tl.constexpr):
        """dx = r (h - mean(h) - x_hat mean(h x_hat)), h = g gamma; with CENTRE false it is
        RMSNorm's r (h - x_r mean(h x_r)). Writes g * x_hat per element for dL/dgamma."""
        row = tl.program_id(0)
        acc_t = tl.float64 if ACC64 else tl.float32
        mean = tl.load(Mean + row).to(acc_t)
        rstd = tl.load(Rstd + row).to(acc_t)
        sh = tl.zeros([BLOCK], dtype=acc_t)
        shx = tl.zeros([BLOCK], dtype=acc_t)
        for off in range(0, D, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < D
            x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(acc_t)
            g = tl.load(G + row * D + cols, mask=mask, other=0.0).to(acc_t)
            w = tl.load(W + cols, mask=mask, other=0.0).to(acc_t)
            xh = tl.where(mask, (x - mean) * rstd, 0.0)
            h = g * w
            sh += h
            shx += h * xh
            tl.store(GXH + row * D + cols, g * xh, mask=mask)
        mh = tl.sum(sh, axis=0) / D
        mhx = tl.sum(shx, axis=0) / D
        for off in range(0, D, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < D
            x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(acc_t)
            g = tl.load(G + row * D + cols, mask=mask, other=0.0).to(acc_t)
            w = tl.load(W + cols, mask=mask, other=0.0).to(acc_t)
            xh = (x - mean) * rstd
            if CENTRE:
                dx = rstd * (g * w - mh - xh * mhx)
            else:
                dx = rstd * (g * w - xh * mhx)
            tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def col_sum(BUF, OUT, R, D, BLOCK: tl.constexpr):
        """OUT[j] = sum over rows of BUF[:, j]: the cross-row reduction for dgamma/dbeta."""
        pid = tl.program_id(0)
        cols = pid * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        acc = tl.zeros([BLOCK], dtype=OUT.dtype.element_ty)
        for r in range(0, R):
            acc += tl.load(BUF + r * D + cols, mask=mask, other=0.0).to(OUT.dtype.element_ty)
        tl.store(OUT + cols, acc, mask=mask)

    @triton.jit
    def bn_fwd(X, W, B, Y, Mean, Var, N, C, L, eps, USE_BATCH: tl.constexpr,
               BLOCK: tl.constexpr, ACC64: tl.constexpr):
        """One program per channel of an [N, C, L] input; with USE_BATCH the channel's
        statistics over N and L (biased variance, two-pass) are computed and stored,
        otherwise Mean/Var are read (eval)."""
        c = tl.program_id(0)
        acc_t = tl.float64 if ACC64 else tl.float32
        m = N * L
        if USE_BATCH:
            total = tl.zeros([BLOCK], dtype=acc_t)
            for off in range(0, m, BLOCK):
                idx = off + tl.arange(0, BLOCK)
                ptr = X + (idx // L) * C * L + c * L + idx % L
                total += tl.load(ptr, mask=idx < m, other=0.0).to(acc_t)
            mean = tl.sum(total, axis=0) / m
            sq = tl.zeros([BLOCK], dtype=acc_t)
            for off in range(0, m, BLOCK):
                idx = off + tl.arange(0, BLOCK)
                ptr = X + (idx // L) * C * L + c * L + idx % L
                x = tl.load(ptr, mask=idx < m, other=0.0).to(acc_t)
                d = tl.where(idx < m, x - mean, 0.0)
                sq += d * d
            var = tl.sum(sq, axis=0) / m
            tl.store(Mean + c, mean)
            tl.store(Var + c, var)
        else:
            mean = tl.load(Mean + c).to(acc_t)
            var = tl.load(Var + c).to(acc_t)
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + c).to(acc_t)
        b = tl.load(B + c).to(acc_t)
        for off in range(0, m, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            ptr_off = (idx // L) * C * L + c * L + idx % L
            x = tl.load(X + ptr_off, mask=idx < m, other=0.0).to(acc_t)
            tl.store(Y + ptr_off, ((x - mean) * rstd * w + b).to(Y.dtype.element_ty),
                     mask=idx < m)

    return dict(norm_fwd=norm_fwd, norm_bwd=norm_bwd, col_sum=col_sum, bn_fwd=bn_fwd)


def _block(n):
    return int(min(MAX_BLOCK, max(16, 1 << (max(n, 1) - 1).bit_length())))


class TritonBackend(Backend):
    name = "triton"
    capabilities = Capabilities(
        ops={"layer_norm", "rms_norm", "qk_norm_scores", "batch_norm"}, dtypes=DTYPES,
        gradients={"layer_norm", "rms_norm"}, cumulative_momentum=True, untracked_stats=True)
    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": 1e-6, "batch_norm": 1e-5},
        half_compute_dtype="float32 (float64 inputs in float64)")

    def __init__(self):
        self.torch, self.triton, tl = _import()
        self.device = "cuda" if self.torch.cuda.is_available() else "cpu"
        mode = "GPU" if self.device == "cuda" else "interpreter (TRITON_INTERPRET=1, CPU)"
        self.version = f"{self.triton.__version__} ({mode})"
        self.k = _build(self.triton, tl)
        #: the interpreter runs each program in Python: its times say nothing about a GPU
        self.benchmark_skip_reason = None if self.device == "cuda" else \
            "Triton interpreter on CPU (TRITON_INTERPRET=1); time it on a GPU"
        if self.device != "cuda":
            # measured: LayerNorm forward + backward of 4096 rows x 8 took 45 s (11 ms a
            # row); 131072 rows would take ~25 minutes per call
            self.capabilities = dataclasses.replace(
                self.capabilities, max_rows=64, max_rows_reason=(
                    "the Triton interpreter runs one Python program per row, ~11 ms each "
                    "(forward and backward): more rows are for a GPU run"))

    def _t(self, a):
        return to_torch(np.ascontiguousarray(a), self.device)

    def _acc64(self, x):
        return x.dtype == np.float64

    def _param(self, p, d, like, fill):
        if p is None:
            return self.torch.full((d,), fill, dtype=like.dtype, device=self.device)
        return self._t(np.asarray(p).reshape(d))

    def _rows(self, x, d):
        return self._t(np.ascontiguousarray(x).reshape(-1, d))

    def _stats(self, rows, dt):
        return (self.torch.empty(rows, dtype=dt, device=self.device),
                self.torch.empty(rows, dtype=dt, device=self.device))

    def _col_sum(self, buf, d, dtype):
        out = self.torch.empty(d, dtype=dtype, device=self.device)
        block = _block(min(d, 1024))
        self.k["col_sum"][(self.triton.cdiv(d, block),)](buf, out, buf.shape[0], d, BLOCK=block)
        return out

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._norm(x, normalized_shape, weight, bias, eps, grad_output, centre=True)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._norm(x, normalized_shape, weight, None, eps, grad_output, centre=False)

    def _norm(self, x, normalized_shape, weight, bias, eps, grad_output, centre):
        torch = self.torch
        d = int(np.prod(normalized_shape))
        xr = self._rows(x, d)
        rows = xr.shape[0]
        acc = torch.float64 if self._acc64(x) else torch.float32
        w = self._param(weight, d, xr, 1.0)
        y = torch.empty_like(xr)
        mean, rstd = self._stats(rows, acc)
        block, a64 = _block(d), self._acc64(x)
        b = self._param(bias, d, xr, 0.0)
        self.k["norm_fwd"][(rows,)](xr, w, b, y, mean, rstd, d, float(eps), BLOCK=block,
                                    ACC64=a64, CENTRE=centre)
        out = to_numpy(y).reshape(x.shape)
        if grad_output is None:
            return Result(out)
        g = self._rows(grad_output, d)
        dx = torch.empty_like(xr)
        gxh = torch.empty((rows, d), dtype=acc, device=self.device)
        self.k["norm_bwd"][(rows,)](xr, w, g, mean, rstd, dx, gxh, d, BLOCK=block, ACC64=a64,
                                  CENTRE=centre)
        shape = tuple(normalized_shape)
        gw = to_numpy(self._col_sum(gxh, d, acc)).reshape(shape).astype(x.dtype) \
            if weight is not None else None
        gb = to_numpy(self._col_sum(g.to(acc), d, acc)).reshape(shape).astype(x.dtype) \
            if bias is not None else None
        return Result(out, to_numpy(dx).reshape(x.shape), gw, gb)

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        d = q.shape[-1]
        ct = np.float64 if q.dtype == np.float64 else np.float32
        # q_hat and k_hat are stored in the input dtype, as a model's RMSNorm output would be
        q_hat = self._t(self.rms_norm(q, (d,), q_weight, eps).output.astype(ct))
        k_hat = self._t(self.rms_norm(k, (d,), k_weight, eps).output.astype(ct))
        s = self.torch.matmul(q_hat, k_hat.transpose(-1, -2)) * scale
        return to_numpy(s).astype(q.dtype)

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return TritonBatchNorm(self, num_features, eps, momentum, affine, track_running_stats,
                               np.dtype(dtype), weight, bias)


class TritonBatchNorm(RunningStatsLayer):
    """Training forward in one Triton kernel per channel; the running-statistics update
    (unbiased, momentum weighting the new batch) is RunningStats' few elementwise ops."""

    def __init__(self, b, c, eps, momentum, affine, track, dtype, weight, bias):
        self.b, self.eps, self.momentum, self.dtype, self.c = b, eps, momentum, dtype, c
        torch = b.torch
        self.acc = torch.float64 if dtype == np.float64 else torch.float32
        self.w = b._t(np.asarray(weight)) if affine and weight is not None else \
            torch.ones(c, dtype=self.acc, device=b.device)
        self.bias = b._t(np.asarray(bias)) if affine and bias is not None else \
            torch.zeros(c, dtype=self.acc, device=b.device)
        self.stats = RunningStats(c, track, np.float64 if dtype == np.float64 else np.float32,
                                  dtype, momentum)
        self.training = True

    def forward(self, x, grad_output=None):
        if grad_output is not None:
            raise NotImplementedError("the triton backend has no BatchNorm backward kernel")
        b, torch = self.b, self.b.torch
        n, c = x.shape[:2]
        x3 = b._t(np.ascontiguousarray(x).reshape(n, c, -1))
        length = x3.shape[2]
        m = n * length
        batch = self.training or not self.stats.tracked
        if batch and m <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"of shape {x.shape}")
        if batch:
            mean = torch.empty(c, dtype=self.acc, device=b.device)
            var = torch.empty(c, dtype=self.acc, device=b.device)
        else:
            mean, var = b._t(self.stats.mean), b._t(self.stats.var)
        y = torch.empty_like(x3)
        b.k["bn_fwd"][(c,)](x3, self.w, self.bias, y, mean, var, n, c, length, float(self.eps),
                            USE_BATCH=batch, BLOCK=_block(min(m, MAX_BLOCK)),
                            ACC64=self.acc == torch.float64)
        if self.training and self.stats.tracked:
            self.stats.update(to_numpy(mean), to_numpy(var) * m, m)
        return Result(to_numpy(y).reshape(x.shape))


def make_backend() -> TritonBackend:
    return TritonBackend()
