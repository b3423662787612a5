"""`triton`: Triton kernels for LayerNorm and RMSNorm (forward and backward) and the
BatchNorm training forward, on torch tensors.

Written for a GPU; where no CUDA device is present the adapter runs the same kernels in
Triton's interpreter (TRITON_INTERPRET=1) on torch CPU tensors, which is how CI checks
them. The kernels live in `_triton_norm` (laid out as Triton's LayerNorm tutorial), which
is imported only when this backend is created: importing normspec or the registry never
imports triton. This module picks the block sizes, hands the kernels strided views of
the caller's arrays where it can, and allocates every buffer, outputs included in the
dtype the kernels store them in: it converts arrays, never results.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ._running import RunningStats, RunningStatsLayer
from ._torch_arrays import BF16, to_numpy, to_torch, torch_dtype
from .protocol import (
    DTYPES,
    Backend,
    BackendUnavailable,
    Capabilities,
    Conventions,
    Result,
)

#: elements of one program's [BLOCK_M, BLOCK_N] tile of several rows (or BatchNorm
#: channels): 32 KB of float32 per live tensor, what a GPU program holds in registers
TILE = 8192
#: the longest block of one row (or channel): the tutorial's 64 KB of float32; longer
#: rows are walked in blocks of this many
BLOCK_MAX = 16384
#: programs of the backward (rows of the dW/dB partial buffers); fewer when there are
#: fewer row blocks
GROUP_SIZE_M = 64
#: partial-buffer rows group_sum adds in one step
SUM_BLOCK_M = 64


def _import():
    """torch, triton: on a machine without CUDA the interpreter is chosen first, as it
    must be before triton is imported."""
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailable(f"torch is not installed (triton needs it): {exc}") from exc
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton

        from . import _triton_norm
    except ImportError as exc:
        raise BackendUnavailable(f"triton is not installed: {exc}") from exc
    return torch, triton, _triton_norm


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _row_blocks(d: int) -> tuple[int, int, bool]:
    """(BLOCK_M, BLOCK_N, ONE_BLOCK) for rows of d elements: a row of up to BLOCK_MAX
    elements is one block and a program takes as many rows as fill a TILE; longer rows
    are walked one row a program, BLOCK_MAX columns at a time. Depends on d only, so a
    row's reduction order never depends on how many rows share the call (batch
    invariance)."""
    block_n = min(_pow2(d), BLOCK_MAX)
    return max(1, TILE // block_n), block_n, d <= block_n


class TritonBackend(Backend):
    name = "triton"
    capabilities = Capabilities(
        ops={"layer_norm", "rms_norm", "qk_norm_scores", "batch_norm"}, dtypes=DTYPES,
        gradients={"layer_norm", "rms_norm"}, cumulative_momentum=True, untracked_stats=True)
    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": 1e-6, "batch_norm": 1e-5},
        half_compute_dtype="float32 (float64 inputs in float64)")

    def __init__(self):
        self.torch, self.triton, self.k = _import()
        self.device = "cuda" if self.torch.cuda.is_available() else "cpu"
        mode = "GPU" if self.device == "cuda" else "interpreter (TRITON_INTERPRET=1, CPU)"
        self.version = f"{self.triton.__version__} ({mode})"
        #: the interpreter runs each program in Python: its times say nothing about a GPU
        self.benchmark_skip_reason = None if self.device == "cuda" else \
            "Triton interpreter on CPU (TRITON_INTERPRET=1); time it on a GPU"
        if self.device != "cuda":
            # measured (interpreter, d = 4, 2048 rows a program): LayerNorm forward +
            # backward of 4096 rows took 0.06 s, of 131072 rows 1.5 s; the row-count
            # cases past 4096 (65535 to 131072 rows) would add ~35 s to a four-dtype run
            self.capabilities = dataclasses.replace(
                self.capabilities, max_rows=4096, max_rows_reason=(
                    "the Triton interpreter runs every program as Python, ~10 ms each "
                    "for up to 8192 elements: past 4096 rows a call takes seconds, so "
                    "more rows are for a GPU run"))

    def compile_seconds(self) -> float | None:
        """The interpreter compiles nothing (0); on a GPU, Triton's JIT is not timed here."""
        return 0.0 if self.device != "cuda" else None

    def _t(self, a):
        return to_torch(np.ascontiguousarray(a), self.device)

    def _view(self, a, *shape):
        """a reshaped to `shape`, as a torch tensor for a kernel that takes its strides: a
        view of a's own memory where its strides allow (a strided last axis or an offset
        slice reach the kernel as they are), else a contiguous copy. Read-only arrays are
        copied (torch warns on them)."""
        a = np.asarray(a)
        if self.device == "cpu" and a.flags.writeable and a.size and all(
                s > 0 and s % a.itemsize == 0 for s in a.strides):
            t = self.torch.from_numpy(a.view(np.int16) if a.dtype == BF16 else a)
            if a.dtype == BF16:
                t = t.view(self.torch.bfloat16)
            return t.reshape(shape)
        return self._t(a).reshape(shape)

    def _param(self, p, d, like, fill):
        if p is None:
            return self.torch.full((d,), fill, dtype=like.dtype, device=self.device)
        return self._t(np.asarray(p).reshape(d))

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._norm(x, normalized_shape, weight, bias, eps, grad_output, centre=True)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._norm(x, normalized_shape, weight, None, eps, grad_output, centre=False)

    def _norm(self, x, normalized_shape, weight, bias, eps, grad_output, centre):
        torch, cdiv = self.torch, self.triton.cdiv
        d = int(np.prod(normalized_shape))
        xr = self._view(x, -1, d)
        rows = xr.shape[0]
        a64 = x.dtype == np.float64
        acc = torch.float64 if a64 else torch.float32
        dt = torch_dtype(x.dtype)
        w = self._param(weight, d, xr, 1.0)
        b = self._param(bias, d, xr, 0.0)
        y = torch.empty((rows, d), dtype=dt, device=self.device)
        mean = torch.empty(rows, dtype=acc, device=self.device)
        rstd = torch.empty(rows, dtype=acc, device=self.device)
        block_m, block_n, one = _row_blocks(d)
        self.k.norm_fwd[(cdiv(rows, block_m),)](
            xr, y, w, b, mean, rstd, xr.stride(0), xr.stride(1), y.stride(0), rows, d,
            float(eps), 1.0 / _pow2(d), BLOCK_M=block_m, BLOCK_N=block_n,
            ONE_BLOCK=one, CENTRE=centre, ACC64=a64)
        out = to_numpy(y).reshape(x.shape)
        if grad_output is None:
            return Result(out)
        g = self._view(grad_output, -1, d)
        dx = torch.empty((rows, d), dtype=dt, device=self.device)
        groups = min(GROUP_SIZE_M, cdiv(rows, block_m))
        gw = torch.empty(d, dtype=dt, device=self.device) if weight is not None else None
        gb = torch.empty(d, dtype=dt, device=self.device) if bias is not None else None
        # one program holding whole rows: its partial row is the sum, so it writes the
        # final buffers (in the parameters' dtype) and group_sum is not launched
        direct = one and groups == 1
        if direct:
            dw_part = gw if gw is not None else torch.empty(d, dtype=acc, device=self.device)
            db_part = gb if gb is not None else torch.empty(d, dtype=acc, device=self.device)
        else:
            # zeroed: the long-row path adds into its partial row
            dw_part = torch.zeros((groups, d), dtype=acc, device=self.device)
            db_part = torch.zeros((groups, d), dtype=acc, device=self.device) if centre \
                else dw_part
        self.k.norm_bwd[(groups,)](
            xr, g, w, mean, rstd, dx, dw_part, db_part, xr.stride(0), xr.stride(1),
            g.stride(0), g.stride(1), dx.stride(0), rows, d, BLOCK_M=block_m,
            BLOCK_N=block_n, ONE_BLOCK=one, CENTRE=centre, ACC64=a64)
        if not direct and (gw is not None or gb is not None):
            sum_m = min(SUM_BLOCK_M, _pow2(groups))
            sum_n = min(_pow2(d), max(1, BLOCK_MAX // sum_m))
            self.k.group_sum[(cdiv(d, sum_n),)](
                dw_part, db_part, gw if gw is not None else dw_part,
                gb if gb is not None else db_part, groups, d, HAS_DW=gw is not None,
                HAS_DB=gb is not None, BLOCK_M=sum_m, BLOCK_N=sum_n)
        shape = tuple(normalized_shape)
        return Result(out, to_numpy(dx).reshape(x.shape),
                      None if gw is None else to_numpy(gw).reshape(shape),
                      None if gb is None else to_numpy(gb).reshape(shape))

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
    """The forward in one Triton kernel, BLOCK_C channels a program; the running-statistics
    update (unbiased, momentum weighting the new batch) is RunningStats' few elementwise
    ops."""

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
        x3 = b._view(x, n, c, -1)
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
        y = torch.empty((n, c, length), dtype=x3.dtype, device=b.device)
        # a tile of whole channels where the samples fit, so small inputs take one program
        block_m = min(_pow2(m), BLOCK_MAX)
        block_c = min(_pow2(c), max(1, TILE // block_m))
        b.k.bn_fwd[(b.triton.cdiv(c, block_c),)](
            x3, y, self.w, self.bias, mean, var, x3.stride(0), x3.stride(1), x3.stride(2), n, c,
            length, float(self.eps), 1.0 / _pow2(m), USE_BATCH=batch,
            BLOCK_C=block_c, BLOCK_M=block_m,
            ONE_BLOCK=m <= block_m, ACC64=self.acc == torch.float64)
        if self.training and self.stats.tracked:
            self.stats.update(to_numpy(mean), to_numpy(var) * m, m)
        return Result(to_numpy(y).reshape(x.shape))


def make_backend() -> TritonBackend:
    return TritonBackend()
