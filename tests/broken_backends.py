"""Deliberately broken backends, one defect each, derived from the correct `numpy`
backend (or the oracle backend where a capability is needed). test_harness_catches.py
shows which check catches which."""

from __future__ import annotations

import dataclasses
import time
import types
from functools import partial

import normspec.spec as spec
import numpy as np
from normspec.impls.numpy_ref import NumpyBackend, NumpyBatchNorm, _axes, _mean, compute_dtype
from normspec.impls.protocol import Conventions, Result
from oracle_backend import OracleBackend, OracleBatchNorm


class NaiveVariance(NumpyBackend):
    """var = E[x^2] - E[x]^2: catastrophic cancellation for a large mean."""

    def variance(self, v, axes, mu):
        return np.maximum((v * v).mean(axis=axes, keepdims=True) - mu * mu, 0)


class MeanOverflows(NumpyBackend):
    """The mean as sum / d in the compute dtype: d copies of 8.5e37 sum to inf in float32,
    and the constant row's output is NaN (pytorch #173793)."""

    def mean(self, v, axes):
        return _mean(v, axes)  # numpy's plain pairwise sum / n


class MeanOverflowsScrubbed(MeanOverflows):
    """MeanOverflows whose NaN results (output and gradients) are then flushed to 0, as
    a fast-math kernel's may be: finite, and within the ordinary (huge) bound of a
    constant row near the float32 max, but an output of 0 where the spec says beta.
    LayerNorm only, so the constant-row bound is the only thing that can catch it."""

    capabilities = dataclasses.replace(NumpyBackend.capabilities, ops={"layer_norm"},
                                       gradients={"layer_norm"})

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        return res._replace(**{k: np.nan_to_num(v, nan=0.0) for k, v in res._asdict().items()
                               if v is not None})


class BackwardOnePassVariance(NumpyBackend):
    """A correct forward; the backward recomputes the statistics with NaiveVariance's
    E[x^2] - E[x]^2 (as a fused backward that does not save the forward's may): x^2
    overflows near the float32 max, and dL/dx is NaN where the output was right."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        out = super().layer_norm(x, normalized_shape, weight, bias, eps).output
        if grad_output is None:
            return Result(out)
        with np.errstate(over="ignore", invalid="ignore"):
            res = NaiveVariance().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        return res._replace(output=out)


class EpsOutsideSqrt(NumpyBackend):
    """1 / (sqrt(var) + eps) instead of 1 / sqrt(var + eps)."""

    def inv_std(self, var, eps):
        return 1.0 / (np.sqrt(var) + eps)


class NoEps(NumpyBackend):
    """Ignores eps: 0 / 0 on constant rows."""

    def inv_std(self, var, eps):
        with np.errstate(divide="ignore"):
            return 1.0 / np.sqrt(var)


class RmsSubtractsMean(NumpyBackend):
    """'RMSNorm' that centres first: LayerNorm without beta, which F3 says it is not."""

    def mean_square(self, v, axes):
        return self.variance(v, axes, v.mean(axis=axes, keepdims=True))

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
        centred = (x.astype(np.float64) - x.astype(np.float64).mean(axis=axes, keepdims=True))
        return super().rms_norm(centred.astype(x.dtype), normalized_shape, weight, eps, grad_output)


class LastAxisOnly(NumpyBackend):
    """Ignores normalized_shape: normalizes over the last axis alone."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        if len(normalized_shape) == 1:
            return super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        d, shape = x.shape[-1], tuple(normalized_shape)
        w = None if weight is None else np.broadcast_to(weight, shape)
        b = None if bias is None else np.broadcast_to(bias, shape)
        y = super().layer_norm(x, (d,), None, None, eps).output
        y = y * w if w is not None else y
        return Result((y + b if b is not None else y).astype(x.dtype))


class HalfAccumulation(NumpyBackend):
    """Accumulates squares in the input's own float16: overflows for rows around 1000."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        if x.dtype == np.float16:
            axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
            mu = x.mean(axis=axes, keepdims=True, dtype=np.float16)
            with np.errstate(over="ignore", invalid="ignore"):
                var = ((x - mu) * (x - mu)).sum(axis=axes, keepdims=True, dtype=np.float16) / \
                    np.float16(np.prod(normalized_shape))
                y = (x - mu) / np.sqrt(var + np.float16(eps))
            y = y * weight if weight is not None else y
            y = y + bias if bias is not None else y
            return Result(y.astype(x.dtype))
        return super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        if x.dtype == np.float16:
            axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
            with np.errstate(over="ignore", invalid="ignore"):
                ms = (x * x).sum(axis=axes, keepdims=True, dtype=np.float16) / \
                    np.float16(np.prod(normalized_shape))
                y = x / np.sqrt(ms + np.float16(eps))
            return Result((y * weight if weight is not None else y).astype(x.dtype))
        return super().rms_norm(x, normalized_shape, weight, eps, grad_output)


class WrongGradient(NumpyBackend):
    """LayerNorm VJP that forgets the mean(h) term."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        if grad_output is None:
            return res
        ct = compute_dtype(x.dtype)
        axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
        h = grad_output.astype(ct) * (weight.astype(ct) if weight is not None else 1)
        r = 1 / np.sqrt(x.astype(ct).var(axis=axes, keepdims=True) + ct.type(eps))
        wrong = res.grad_input.astype(ct) + r * h.mean(axis=axes, keepdims=True)
        return res._replace(grad_input=wrong.astype(x.dtype))


class WrongRmsGradient(NumpyBackend):
    """RMSNorm VJP as if the denominator did not depend on x."""

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        res = super().rms_norm(x, normalized_shape, weight, eps, grad_output)
        if grad_output is None:
            return res
        ct = compute_dtype(x.dtype)
        axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
        r = 1 / np.sqrt((x.astype(ct) ** 2).mean(axis=axes, keepdims=True) + ct.type(eps))
        h = grad_output.astype(ct) * (weight.astype(ct) if weight is not None else 1)
        return res._replace(grad_input=(r * h).astype(x.dtype))


class DropsTail(NumpyBackend):
    """A blocked kernel (block 64) that never visits the tail of a row whose length is
    not a multiple of the block: the tail keeps whatever the output buffer held (zeros)."""

    BLOCK = 64

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        d = int(np.prod(normalized_shape))
        full = (d // self.BLOCK) * self.BLOCK
        if full in (0, d):
            return super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        rows = x.reshape(-1, d)
        w = None if weight is None else weight.reshape(-1)[:full]
        b = None if bias is None else bias.reshape(-1)[:full]
        head = super().layer_norm(np.ascontiguousarray(rows[:, :full]), (full,), w, b, eps).output
        out = np.zeros_like(rows)
        out[:, :full] = head
        return Result(out.reshape(x.shape))


class AffineOnlyWithBoth(NumpyBackend):
    """LayerNorm takes its affine path only when gamma and beta are both given, so
    LayerNorm(bias=False) loses its gamma (and beta alone is lost too)."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        if weight is None or bias is None:
            res = super().layer_norm(x, normalized_shape, None, None, eps, grad_output)
            return res._replace(grad_weight=None if weight is None else np.zeros_like(weight),
                                grad_bias=None if bias is None else np.zeros_like(bias))
        return super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)


class BetaOnlyUnderGamma(NumpyBackend):
    """LayerNorm adds beta inside `if weight is not None`: beta without gamma is dropped,
    and its gradient with it (returned as zeros)."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        if weight is None and bias is not None:
            res = super().layer_norm(x, normalized_shape, None, None, eps, grad_output)
            return res._replace(grad_bias=None if grad_output is None else np.zeros_like(bias))
        return super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)


class AssumesContiguous(NumpyBackend):
    """Reads its input's memory in order, as a kernel that ignores strides would."""

    @staticmethod
    def _memory_order(x):
        return x if x.flags.c_contiguous else np.ascontiguousarray(x.T).reshape(x.shape)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return super().layer_norm(self._memory_order(x), normalized_shape, weight, bias, eps,
                                  grad_output)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return super().rms_norm(self._memory_order(x), normalized_shape, weight, eps, grad_output)


class NanToZero(NumpyBackend):
    """Fast-math style: NaN and inf are flushed to 0 before normalizing."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        clean = np.nan_to_num(x.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0).astype(x.dtype)
        return super().layer_norm(clean, normalized_shape, weight, bias, eps, grad_output)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        clean = np.nan_to_num(x.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0).astype(x.dtype)
        return super().rms_norm(clean, normalized_shape, weight, eps, grad_output)


class FlushesSubnormals(NumpyBackend):
    """Denormals-are-zero and flush-to-zero, as a kernel compiled with DAZ/FTZ behaves."""

    @staticmethod
    def _ftz(a):
        tiny = float(np.finfo(np.float16).smallest_normal) if a.dtype == np.float16 else 0.0
        a64 = a.astype(np.float64)
        return np.where(np.abs(a64) < tiny, 0.0, a64).astype(a.dtype)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(self._ftz(x), normalized_shape, weight, bias, eps, grad_output)
        return res._replace(output=self._ftz(res.output))

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        res = super().rms_norm(self._ftz(x), normalized_shape, weight, eps, grad_output)
        return res._replace(output=self._ftz(res.output))


class WritesInput(NumpyBackend):
    """Normalizes in place, into the caller's array."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        x[...] = res.output
        return res


class Raises(NumpyBackend):
    def layer_norm(self, *args, **kwargs):
        raise RuntimeError("kernel launch failed")


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("this message cannot be read")


class RaisesUnprintable(NumpyBackend):
    """LayerNorm raises an exception whose __str__ raises too."""

    def layer_norm(self, *args, **kwargs):
        raise _Unprintable()


class RaisesSurrogate(NumpyBackend):
    """LayerNorm raises with a lone surrogate in its message (bytes decoded with
    surrogateescape), which no UTF-8 file can hold as it is."""

    def layer_norm(self, *args, **kwargs):
        raise ValueError("byte \udcff here")


class RaisesKeyboardInterrupt(NumpyBackend):
    """LayerNorm raises KeyboardInterrupt itself (no Ctrl-C was pressed)."""

    def layer_norm(self, *args, **kwargs):
        raise KeyboardInterrupt


class RaisesSystemExit(NumpyBackend):
    """LayerNorm calls sys.exit(0)."""

    def layer_norm(self, *args, **kwargs):
        raise SystemExit(0)


class RaisesHugeMessage(NumpyBackend):
    """LayerNorm raises with five million characters of message."""

    def layer_norm(self, *args, **kwargs):
        raise ValueError("x" * 5_000_000)


class SurrogateName(NumpyBackend):
    """The correct backend, calling itself by a name holding lone surrogates (set per
    instance: every class here is named after itself, below): one that stands for a byte
    (surrogateescape) and one that does not, which a progress line could not print (the
    run then ended with a traceback and no results file: found by a review)."""

    def __init__(self):
        super().__init__()
        self.name = "numpy\udcff\ud800"


class NoReasonsTable(NumpyBackend):
    """The correct backend, declaring its conventions as a plain object (the harness reads
    them attribute by attribute) whose reasons are None, not a table."""

    conventions = types.SimpleNamespace(**{**NumpyBackend.conventions.as_dict(),
                                           "reasons": None})


class BadDeviationEntry(NumpyBackend):
    """The correct backend with a deviation entry that gives no reason: refused at load."""

    deviations = ({"op": "layer_norm"},)


class Hangs(NumpyBackend):
    def layer_norm(self, *args, **kwargs):
        time.sleep(3600)


class ReturnsNaN(NumpyBackend):
    def layer_norm(self, x, *args, **kwargs):
        res = super().layer_norm(x, *args, **kwargs)
        return res._replace(output=np.full_like(res.output, np.nan))


class WrongShape(NumpyBackend):
    def layer_norm(self, x, *args, **kwargs):
        res = super().layer_norm(x, *args, **kwargs)
        return res._replace(output=res.output.reshape(-1))


class WrongDtype(NumpyBackend):
    def layer_norm(self, x, *args, **kwargs):
        res = super().layer_norm(x, *args, **kwargs)
        return res._replace(output=res.output.astype(np.float64))


class DeclaresRefusalButAccepts(NumpyBackend):
    conventions = Conventions(eps_zero={"layer_norm": False, "rms_norm": True,
                                        "qk_norm_scores": True, "batch_norm": True})


class QkWrongScale(NumpyBackend):
    """Ignores the scale it is given (no 1/sqrt(d_k))."""

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        return super().qk_norm_scores(q, k, q_weight, k_weight, eps, 1.0)


class QkIgnoresScale(NumpyBackend):
    """Ignores the scale it is given and uses 1/sqrt(d_k), the usual one, instead."""

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        return super().qk_norm_scores(q, k, q_weight, k_weight, eps, 1.0 / np.sqrt(q.shape[-1]))


class QkNoNorm(NumpyBackend):
    """Plain q . k / sqrt(d_k): no QK-norm, so the scores grow with the projections."""

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        ct = compute_dtype(q.dtype)
        s = np.matmul(q.astype(ct), np.swapaxes(k.astype(ct), -1, -2)) * ct.type(scale)
        return s.astype(q.dtype)


class QkIgnoresGains(NumpyBackend):
    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        return super().qk_norm_scores(q, k, None, None, eps, scale)


class SoftcapClips(NumpyBackend):
    """Hard clipping instead of c tanh(s / c)."""

    def softcap(self, scores, cap):
        return np.clip(scores, -cap, cap).astype(scores.dtype)


class SoftcapIgnoresCap(NumpyBackend):
    """Ignores the cap it is given and uses 30, a common one, instead."""

    def softcap(self, scores, cap):
        return super().softcap(scores, 30.0)


# ---------------------------------------------------------------- BatchNorm defects
def _bn_backend(layer_cls, base=NumpyBackend, **attrs):
    class Broken(base):
        def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats,
                       dtype, weight=None, bias=None):
            return layer_cls(self, num_features, eps, momentum, affine, track_running_stats,
                             np.dtype(dtype), weight, bias)
    for k, v in attrs.items():
        setattr(Broken, k, v)
    return Broken


class _BiasedVarLayer(NumpyBatchNorm):
    def update_running(self, mu, sum_sq, m):
        super().update_running(mu, sum_sq * (m - 1) / m, m)  # stores sum_sq / m


class _FlippedMomentumLayer(NumpyBatchNorm):
    def update_running(self, mu, sum_sq, m):
        self.stats.momentum = 1.0 - self.momentum  # weights the old value instead
        super().update_running(mu, sum_sq, m)


class _EvalBatchStatsLayer(NumpyBatchNorm):
    def uses_batch_stats(self):
        return True


class _FlippedBiasedLayer(_BiasedVarLayer):
    def update_running(self, mu, sum_sq, m):
        self.stats.momentum = 1.0 - self.momentum
        super().update_running(mu, sum_sq, m)


class _NoSingleValueErrorLayer(NumpyBatchNorm):
    def forward(self, x, grad_output=None):
        if x.size // x.shape[1] == 1 and self.training:
            return Result(np.zeros_like(x))
        return super().forward(x, grad_output)


class _UnbiasedForwardLayer(NumpyBatchNorm):
    """Normalizes the training output with the unbiased variance (m - 1)."""

    def forward(self, x, grad_output=None):
        if not self.uses_batch_stats():
            return super().forward(x, grad_output)
        m = x.size // x.shape[1]
        x64 = x.astype(np.float64)
        mean = x64.mean(axis=(0,) + tuple(range(2, x.ndim)), keepdims=True)
        scaled = (x64 - mean) * np.sqrt((m - 1) / m)
        return super().forward(scaled.astype(x.dtype), grad_output)


class _StatsConstantGradLayer(NumpyBatchNorm):
    """dL/dx as if the batch statistics did not depend on x."""

    def forward(self, x, grad_output=None):
        res = super().forward(x, grad_output)
        if grad_output is None:
            return res
        axes = (0,) + tuple(range(2, x.ndim))
        bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        r = 1 / np.sqrt(x.astype(np.float64).var(axis=axes, keepdims=True) + self.eps)
        w = self.weight.astype(np.float64).reshape(bshape) if self.weight is not None else 1.0
        return res._replace(grad_input=(r * grad_output * w).astype(x.dtype))


class _EvalTrainingGradLayer(NumpyBatchNorm):
    """In eval mode with running statistics, dL/dx by the training formula (as if the
    statistics were the batch's and depended on x), evaluated at the running statistics:
    what the numba kernel returned before issue #10."""

    def forward(self, x, grad_output=None):
        res = super().forward(x, grad_output)
        if grad_output is None or self.uses_batch_stats():
            return res
        ct = self.ct
        axes, bshape = self._shape(x)
        r = 1 / np.sqrt(self.stats.var.reshape(bshape) + ct.type(self.eps))
        x_hat = (x.astype(ct) - self.stats.mean.reshape(bshape)) * r
        w = self.weight.astype(ct).reshape(bshape) if self.weight is not None else 1
        h = grad_output.astype(ct) * w
        gx = r * (h - h.mean(axis=axes, keepdims=True)
                  - x_hat * (h * x_hat).mean(axis=axes, keepdims=True))
        return res._replace(grad_input=gx.astype(self.dtype))


class _CountsEvalForwardsLayer(NumpyBatchNorm):
    """num_batches_tracked counts every forward, eval ones too, not the training ones."""

    def forward(self, x, grad_output=None):
        if not self.training and self.stats.tracked:
            self.stats.num_batches_tracked += 1
        return super().forward(x, grad_output)


class _GradsAccumulateLayer(NumpyBatchNorm):
    """Returns gradients summed over every forward so far (a framework's .grad that was
    never zeroed)."""

    def forward(self, x, grad_output=None):
        res = super().forward(x, grad_output)
        if grad_output is None or res.grad_weight is None:
            return res
        self._acc = getattr(self, "_acc", 0) + res.grad_weight.astype(np.float64)
        return res._replace(grad_weight=self._acc.astype(res.grad_weight.dtype))


class _IgnoresAffineLayer(NumpyBatchNorm):
    """Always keeps gamma and beta (ones and zeros), whatever affine says."""

    def __init__(self, backend, c, eps, momentum, affine, track, dtype, weight, bias):
        super().__init__(backend, c, eps, momentum, True, track, dtype, weight, bias)


class _LazyUpdateLayer(NumpyBatchNorm):
    """Defers the running-statistics update to every second forward (as if at step())."""

    def update_running(self, mu, sum_sq, m):
        self._pending = getattr(self, "_pending", 0) + 1
        if self._pending % 2 == 0:
            super().update_running(mu, sum_sq, m)


class _CumulativeIgnoredLayer(NumpyBatchNorm):
    def update_running(self, mu, sum_sq, m):
        self.stats.momentum = 0.1 if self.momentum is None else self.momentum
        super().update_running(mu, sum_sq, m)


class _UntrackedEvalUsesInitLayer(NumpyBatchNorm):
    """track_running_stats=False, but eval normalizes with the initial 0 / 1."""

    def forward(self, x, grad_output=None):
        if not self.training and not self.stats.tracked:
            c = x.shape[1]
            self.stats.mean, self.stats.var = np.zeros(c, self.ct), np.ones(c, self.ct)
            try:
                return super().forward(x, grad_output)
            finally:
                self.stats.mean = self.stats.var = None
        return super().forward(x, grad_output)


class _NoGradSkipsLayer(OracleBatchNorm):
    def forward_no_grad(self, x):
        keep = self.training
        self.training = False  # "no_grad means validation"
        try:
            return self.forward(x).output
        finally:
            self.training = keep


class _ChannelLastStatsLayer(NumpyBatchNorm):
    """Statistics over axis 0 only (per channel and position), not over N and L."""

    def _shape(self, x):
        return (0,), (1,) + tuple(x.shape[1:])

    def forward(self, x, grad_output=None):
        if x.ndim > 2 and x.shape[0] == 1 and self.training:
            raise ValueError("Expected more than 1 value per channel when training")
        return super().forward(x, grad_output)


class _ChannelBlockStats(NumpyBackend):
    """Per-channel statistics taken block by block of BLOCK channels, the last, partial
    block never launched: its channels keep the buffers' initial mean 0 and variance 1.
    Right for up to BLOCK channels and for multiples of it."""

    BLOCK = 32

    def _unlaunched(self, stat, fill):
        c = stat.shape[1]  # BatchNorm's statistics: [1, C, 1, ...]
        full = c - c % self.BLOCK
        if c <= self.BLOCK or full == c:
            return stat
        stat = stat.copy()
        stat[:, full:] = fill
        return stat

    def mean(self, v, axes):
        return self._unlaunched(super().mean(v, axes), 0.0)

    def variance(self, v, axes, mu):
        return self._unlaunched(super().variance(v, axes, mu), 1.0)


class ChannelBlocks(NumpyBackend):
    """BatchNorm with _ChannelBlockStats' statistics: BatchNorm(100) normalizes channels
    96..99 with mean 0 and variance 1 (LayerNorm and RMSNorm are numpy's)."""

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return NumpyBatchNorm(_ChannelBlockStats(), num_features, eps, momentum, affine,
                              track_running_stats, np.dtype(dtype), weight, bias)


class _ZeroesParamsLayer(NumpyBatchNorm):
    """Takes gamma and beta by reference and resets the caller's arrays to 1 and 0 (an
    init routine run on the given storage): the layer then ignores what it was given."""

    def __init__(self, backend, c, eps, momentum, affine, track, dtype, weight, bias):
        for p, value in ((weight, 1.0), (bias, 0.0)):
            if p is not None:
                p[...] = value
        super().__init__(backend, c, eps, momentum, affine, track, dtype, weight, bias)


class _ListGradsLayer(NumpyBatchNorm):
    """Returns dL/dgamma and dL/dbeta as Python lists of float64, not arrays of the dtype."""

    def forward(self, x, grad_output=None):
        res = super().forward(x, grad_output)
        if res.grad_weight is None:
            return res
        return res._replace(grad_weight=res.grad_weight.astype(np.float64).tolist(),
                            grad_bias=res.grad_bias.astype(np.float64).tolist())


BiasedRunningVar = _bn_backend(_BiasedVarLayer)
FlippedMomentum = _bn_backend(_FlippedMomentumLayer)
EvalUsesBatchStats = _bn_backend(_EvalBatchStatsLayer)
NoSingleValueError = _bn_backend(_NoSingleValueErrorLayer)
UnbiasedForward = _bn_backend(_UnbiasedForwardLayer)
StatsConstantGrad = _bn_backend(_StatsConstantGradLayer)
GradsAccumulate = _bn_backend(_GradsAccumulateLayer)
EvalTrainingGradient = _bn_backend(_EvalTrainingGradLayer)
CountsEvalForwards = _bn_backend(_CountsEvalForwardsLayer)
LazyUpdate = _bn_backend(_LazyUpdateLayer)
IgnoresAffine = _bn_backend(_IgnoresAffineLayer)
CumulativeIgnored = _bn_backend(_CumulativeIgnoredLayer)
UntrackedEvalUsesInit = _bn_backend(_UntrackedEvalUsesInitLayer)
ChannelLastStats = _bn_backend(_ChannelLastStatsLayer)
ZeroesParams = _bn_backend(_ZeroesParamsLayer)
ListGrads = _bn_backend(_ListGradsLayer)


class NoGradSkipsUpdate(OracleBackend):
    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _NoGradSkipsLayer(num_features, eps, momentum, affine, track_running_stats,
                                 np.dtype(dtype), weight, bias)


class _FrozenAfterEvalLayer(NumpyBatchNorm):
    """A forward compiled with no guard on the mode (pytorch #105653: changing
    nn.Module.training did not trigger a recompilation): once eval() has run, train()
    sets the flag but the eval path keeps running, on the running statistics, with no
    update and num_batches_tracked stuck."""

    _compiled_eval = False

    def eval(self):
        super().eval()
        self._compiled_eval = True

    def uses_batch_stats(self):
        return not self.stats.tracked if self._compiled_eval else super().uses_batch_stats()


class _UntrainedEvalUsesBatchLayer(NumpyBatchNorm):
    """Which statistics eval uses decided by the layer's state, not its mode (the class
    of pytorch #16793, #37823): until a training forward has filled the running
    statistics, eval normalizes with the batch's instead of the initial 0 and 1."""

    def uses_batch_stats(self):
        return super().uses_batch_stats() or self.stats.num_batches_tracked == 0


FrozenAfterEval = _bn_backend(_FrozenAfterEvalLayer)
UntrainedEvalUsesBatch = _bn_backend(_UntrainedEvalUsesBatchLayer)


# ---------------------------------------------------------------- shapes and layouts
GRID_LIMIT = 65535  # CUDA's grid y/z limit: a launch of one block per row stops there


def _rows_of(a, normalized_shape):
    return a.reshape((-1,) + tuple(a.shape[a.ndim - len(normalized_shape):]))


class _CutsNormOutputs(NumpyBackend):
    """numpy's LayerNorm and RMSNorm, their results passed through the subclass's _cut
    (result, x, normalized_shape): what a launch bug leaves unwritten."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._cut(super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output),
                         x, normalized_shape)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._cut(super().rms_norm(x, normalized_shape, weight, eps, grad_output), x,
                         normalized_shape)


class GridStopsAt65535(_CutsNormOutputs):
    """One program per row on a grid capped at 65535: rows past it are never visited and
    keep the zeros of the output buffers (apex #411, pytorch #16998); its BatchNorm
    takes the statistics of the first 65535 samples only (pytorch #19911). QK-norm goes
    through its rms_norm, so its rows past the limit are zero too."""

    def _cut(self, res, x, normalized_shape):
        out = []
        for a in res:
            if a is not None and a.shape == x.shape and _rows_of(a, normalized_shape).shape[0] > GRID_LIMIT:
                a = a.copy()
                _rows_of(a, normalized_shape)[GRID_LIMIT:] = 0
            out.append(a)
        return Result(*out)

    def mean(self, v, axes):
        return super().mean(v[:GRID_LIMIT], axes) if 0 in axes else super().mean(v, axes)

    def variance(self, v, axes, mu):
        return super().variance(v[:GRID_LIMIT], axes, mu) if 0 in axes else \
            super().variance(v, axes, mu)


class EmptyBatchSkipsBackward(NumpyBackend):
    """With no rows (an empty batch) the backward kernel is not launched, as the fixes of
    pytorch PR #28614 and intel/torch-xpu-ops PR #4378 skip a launch of zero blocks, but
    dL/dgamma and dL/dbeta come back in buffers nothing wrote: np.empty's garbage, NaN
    here so that the test is deterministic. The spec's sums of no terms are 0."""

    UNWRITTEN = ("grad_weight", "grad_bias")

    def _unwritten(self, res, x, normalized_shape):
        if _rows_of(x, normalized_shape).shape[0] != 0:
            return res
        return res._replace(**{k: np.full_like(getattr(res, k), np.nan)
                               for k in self.UNWRITTEN if getattr(res, k) is not None})

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._unwritten(super().layer_norm(x, normalized_shape, weight, bias, eps,
                                                  grad_output), x, normalized_shape)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._unwritten(super().rms_norm(x, normalized_shape, weight, eps, grad_output),
                               x, normalized_shape)


class EmptyBatchSkipsDbeta(EmptyBatchSkipsBackward):
    """EmptyBatchSkipsBackward with dL/dgamma written and dL/dbeta not (LayerNorm only has
    one): a finding in dL/dbeta alone, whose repro must show dL/dbeta."""

    UNWRITTEN = ("grad_bias",)


class FastPathFrom256(NumpyBackend):
    """From 256 rows on, dL/dgamma and dL/dbeta take a fast path that reduces the rows
    in blocks of 256 and forgets the last, partial block: right for 256, 4096, 65536
    rows, wrong for 257, 300, 65537 (the launch heuristics of vLLM #48271, the dgamma
    path of pytorch PR #193016)."""

    BLOCK = 256

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        full = self._full_rows(x, normalized_shape, grad_output)
        if full is None:
            return res
        part = super().layer_norm(self._head(x, normalized_shape, full), normalized_shape, weight,
                                  bias, eps, self._head(grad_output, normalized_shape, full))
        return res._replace(grad_weight=part.grad_weight, grad_bias=part.grad_bias)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        res = super().rms_norm(x, normalized_shape, weight, eps, grad_output)
        full = self._full_rows(x, normalized_shape, grad_output)
        if full is None:
            return res
        part = super().rms_norm(self._head(x, normalized_shape, full), normalized_shape, weight,
                                eps, self._head(grad_output, normalized_shape, full))
        return res._replace(grad_weight=part.grad_weight)

    def _full_rows(self, x, normalized_shape, grad_output):
        rows = _rows_of(x, normalized_shape).shape[0]
        if grad_output is None or rows < self.BLOCK or rows % self.BLOCK == 0:
            return None
        return rows // self.BLOCK * self.BLOCK

    @staticmethod
    def _head(a, normalized_shape, full):
        return np.ascontiguousarray(_rows_of(a, normalized_shape)[:full])


class PaddedLanes(NumpyBackend):
    """Pads each row to the next power of two with zeros and does not mask them: each
    padded lane adds mu^2 to LayerNorm's squared deviations (Liger-Kernel #518), and
    RMSNorm divides its sum of squares by the padded width (triton #9838)."""

    @staticmethod
    def _padded(axes, v):
        d = int(np.prod([v.shape[a] for a in axes]))
        return d, 1 << (d - 1).bit_length()

    def variance(self, v, axes, mu):
        d, p = self._padded(axes, v)
        return super().variance(v, axes, mu) + (p - d) * mu * mu / d

    def mean_square(self, v, axes):
        d, p = self._padded(axes, v)
        return super().mean_square(v, axes) * d / p


class Assumes2D(NumpyBackend):
    """A backward that takes M = x.shape[0] rows of x.size / M (FlagGems #5392): right
    for 2-D input and when every axis after the first is normalized, wrong for
    [B, T, d] normalized over d alone. The forward is right."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        if grad_output is None or x.ndim - len(normalized_shape) == 1:
            return res
        flat = x.shape[1:]
        wrong = super().layer_norm(x, flat, None, None, eps,
                                   grad_output * (np.broadcast_to(weight, x.shape).astype(x.dtype)
                                                  if weight is not None else 1))
        return res._replace(grad_input=wrong.grad_input)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        res = super().rms_norm(x, normalized_shape, weight, eps, grad_output)
        if grad_output is None or x.ndim - len(normalized_shape) == 1:
            return res
        flat = x.shape[1:]
        wrong = super().rms_norm(x, flat, None, eps,
                                 grad_output * (np.broadcast_to(weight, x.shape).astype(x.dtype)
                                                if weight is not None else 1))
        return res._replace(grad_input=wrong.grad_input)


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _as_contiguous_memory(a):
    """What a kernel handed only a data pointer reads: a.size elements in order from the
    view's first element, as if the view were C-contiguous (strides ignored)."""
    if a is None or a.flags.c_contiguous:
        return a
    strides = tuple(int(np.prod(a.shape[k + 1:])) * a.itemsize for k in range(a.ndim))
    return np.lib.stride_tricks.as_strided(a, a.shape, strides).copy()


def _from_storage_start(a):
    """What a kernel that drops the view's offset reads: the same strides from the start
    of the underlying buffer (the storage's data pointer, not the view's)."""
    if a is None:
        return a
    root = _root(a)
    if root is a or root.__array_interface__["data"][0] == a.__array_interface__["data"][0]:
        return a
    return np.lib.stride_tricks.as_strided(root, a.shape, a.strides).copy()


def _one_row_stride(a):
    """What a kernel that takes an offset and one row stride reads: with a unit last
    stride it walks row r at r * stride(-2) elements from the view's first element (any
    other last stride: it copies to contiguous first, which is right). Right for every
    view whose leading axes collapse to one stride, wrong for heads split from a fused
    qkv. Read from the view's buffer by index, within it (NaN past its end, where the
    kernel would read whatever lies there)."""
    if a is None or a.ndim < 2 or a.strides[-1] != a.itemsize:
        return None if a is None else np.ascontiguousarray(a)
    root = _root(a)
    flat = root.reshape(-1)  # the layouts' buffers are C-contiguous arrays of their own
    start = (a.__array_interface__["data"][0] - root.__array_interface__["data"][0]) // a.itemsize
    rows, d = int(np.prod(a.shape[:-1])), a.shape[-1]
    index = start + np.arange(rows)[:, None] * (a.strides[-2] // a.itemsize) + np.arange(d)
    inside = index < flat.size
    out = np.full((rows, d), np.nan, a.dtype)
    out[inside] = flat[index[inside]]
    return out.reshape(a.shape)


def _reads(read, *, grad_only=False, qk=False):
    class Broken(NumpyBackend):
        def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
            return super().layer_norm(x if grad_only else read(x), normalized_shape, weight, bias,
                                      eps, read(grad_output))

        def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
            return super().rms_norm(x if grad_only else read(x), normalized_shape, weight, eps,
                                    read(grad_output))

        if qk:
            def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
                return super().qk_norm_scores(read(q), read(k), q_weight, k_weight, eps, scale)
    return Broken


#: x and the upstream gradient read as if contiguous (LightLLM #1467)
IgnoresStrides = _reads(_as_contiguous_memory)
#: x and the upstream gradient read from the start of their buffers (the view's offset lost)
IgnoresOffset = _reads(_from_storage_start)
#: the backward reads the upstream gradient as if contiguous (quack #88)
GradAssumedContiguous = _reads(_as_contiguous_memory, grad_only=True)
#: rows at one stride, QK-norm too (sgl-kernel-xpu #169/#170, vllm-xpu-kernels PR #397)
OneRowStride = _reads(_one_row_stride, qk=True)


class _BatchNormIgnoresStridesLayer(NumpyBatchNorm):
    """Reads x and the upstream gradient as contiguous [N, C, ...] memory: a
    channels-last or strided input is read in the wrong order (pytorch #62594)."""

    def forward(self, x, grad_output=None):
        return super().forward(_as_contiguous_memory(x), _as_contiguous_memory(grad_output))


BatchNormIgnoresStrides = _bn_backend(_BatchNormIgnoresStridesLayer)


def _channels_last(a) -> bool:
    """Whether [N, C, ...] `a` is stored channels-last (and not also contiguous)."""
    return a.ndim > 2 and not a.flags.c_contiguous and np.moveaxis(a, 1, -1).flags.c_contiguous


class _GradInInputStridesLayer(NumpyBatchNorm):
    """The backward picks one memory format, x's, and indexes the upstream gradient with
    x's strides (bug class 14, memory format: pytorch #107199): right when both share a
    format, wrong for x channels-last and the gradient contiguous, or the reverse."""

    def forward(self, x, grad_output=None):
        if grad_output is not None and (x.flags.c_contiguous or _channels_last(x)) and \
                (grad_output.flags.c_contiguous or _channels_last(grad_output)) and \
                x.strides != grad_output.strides:
            memory = np.ascontiguousarray(grad_output.ravel(order="K"))  # in memory order
            grad_output = np.lib.stride_tricks.as_strided(memory, x.shape, x.strides).copy()
        return super().forward(x, grad_output)


class _ChannelsLastTailStatsLayer(NumpyBatchNorm):
    """On channels-last input with more than 4 channels, the running statistics are
    stored in vectors of 4 channels and a partial last vector is skipped: its channels'
    running mean and variance stay as they were (bug classes 14 and 21, channels-last
    kernels and channel counts that are not powers of two: pytorch #62594, apex #1768).
    Outputs and gradients are right."""

    def forward(self, x, grad_output=None):
        self._channels_last = _channels_last(x)
        return super().forward(x, grad_output)

    def update_running(self, mu, sum_sq, m):
        mean, var = self.stats.mean.copy(), self.stats.var.copy()
        super().update_running(mu, sum_sq, m)
        tail = slice(len(mean) - len(mean) % 4, None)
        if self._channels_last and len(mean) > 4:
            self.stats.mean[tail], self.stats.var[tail] = mean[tail], var[tail]


GradInInputStrides = _bn_backend(_GradInInputStridesLayer)
ChannelsLastTailStats = _bn_backend(_ChannelsLastTailStatsLayer)

# ---------------------------------------------------------------- conventions
class DeclaresFloat32Parameters(NumpyBackend):
    """Declares eps held in float32 (as ONNX attributes are) but uses it as given."""

    conventions = Conventions(parameter_dtype="float32")


class Float32EpsUndeclared(NumpyBackend):
    """Holds eps in float32 in float64 too, and does not say so."""

    def inv_std(self, var, eps):
        return 1.0 / np.sqrt(var + var.dtype.type(np.float32(eps)))


class Float32EpsDeclared(Float32EpsUndeclared):
    """The same, declared: the oracle is evaluated at float32(eps) and the records say so."""

    conventions = Conventions(parameter_dtype="float32")


#: the biased running variance, declared as a convention with its reason
BiasedDeclared = _bn_backend(_BiasedVarLayer, conventions=Conventions(
    running_var_estimator="biased",
    reasons={"running_var_estimator": "stores sum (x - mu)^2 / m, as ONNX Runtime does"}))
#: declared biased, and also a real bug the declaration does not explain
BiasedDeclaredFlippedMomentum = _bn_backend(_FlippedBiasedLayer, conventions=Conventions(
    running_var_estimator="biased"))
#: declares that it trains on one value per channel, and does
OneValueDeclared = _bn_backend(_NoSingleValueErrorLayer, conventions=Conventions(
    single_value_batch="accepts"))
#: declares that it trains on one value per channel, but raises
OneValueDeclaredButRaises = _bn_backend(NumpyBatchNorm, conventions=Conventions(
    single_value_batch="accepts"))



# ---------------------------------------------------------------- data parallelism (DP)
class DpLocalUsesGlobalStats(NumpyBackend):
    """'Local' data-parallel BatchNorm that secretly reduces the statistics across
    replicas: the global batch where each replica should normalize its own shard."""

    def data_parallel_batch_norm(self, steps, *, sync, **kwargs):
        return super().data_parallel_batch_norm(steps, sync=True, **kwargs)


class DpSumsGradients(NumpyBackend):
    """The gradient all-reduce sums where DistributedDataParallel averages."""

    def all_reduce_mean(self, values):
        return np.sum(values, axis=0)


class DpSyncAveragesVariances(NumpyBackend):
    """Sync BatchNorm that averages the replicas' means and variances instead of reducing
    sums: it misses the spread between the shards' means (and weighs shards equally)."""

    def merge_summaries(self, summaries):
        n = sum(s[0] for s in summaries)
        mean = np.mean([s[1] for s in summaries], axis=0)
        var = np.mean([s[2] / s[0] for s in summaries], axis=0)
        return n, mean, var * n


class DpSyncIgnoresUnequalShards(NumpyBackend):
    """Sync BatchNorm whose collective assumes every shard has replica 0's size."""

    def all_gather_statistics(self, summaries):
        n0 = summaries[0][0]
        return [(n0, mean, m2) for _, mean, m2 in summaries]


class DpSyncB3PerReplica(NumpyBackend):
    """Sync BatchNorm that applies B3 to each replica's count, not the global one."""

    def global_statistics(self, shards, ct):
        for x in shards:
            if x.size // x.shape[1] <= 1:
                raise ValueError("Expected more than 1 value per channel when training, got "
                                 f"input size {x.shape}")
        return super().global_statistics(shards, ct)


class DpBuffersNotBroadcast(NumpyBackend):
    """Declares DistributedDataParallel's buffer broadcast from replica 0, but every
    replica keeps its own running statistics."""

    conventions = dataclasses.replace(NumpyBackend.conventions,
                                      data_parallel_buffers="broadcast_rank0")

# each broken backend reports under its own name (the class name) in results and reports
for _cls in list(globals().values()):
    if isinstance(_cls, type) and issubclass(_cls, (NumpyBackend, OracleBackend)) \
            and _cls not in (NumpyBackend, OracleBackend) and not _cls.__name__.startswith("_"):
        _cls.name = _cls.__name__
for _alias, _cls in list(globals().items()):
    if isinstance(_cls, type) and _cls.__name__ == "Broken":
        _cls.name = _alias


# ---------------------------------------------------------------- B9: batch invariance
def _rows(v, axes) -> int:
    """How many independent reductions (rows, or channels) `v` holds over `axes`."""
    return v.size // int(np.prod([v.shape[a] for a in axes]))


def _sequential_mean(v, axes):
    """The mean over `axes` (keepdims) with the terms added one after another, in the
    dtype of v: a sequential loop's order, as against NumPy's pairwise tree."""
    ends = tuple(range(v.ndim - len(axes), v.ndim))
    moved = np.moveaxis(v, axes, ends)
    flat = moved.reshape(moved.shape[:v.ndim - len(axes)] + (-1,))
    total = np.add.accumulate(flat, axis=-1)[..., -1] / v.dtype.type(flat.shape[-1])
    keep = [1 if i % v.ndim in {a % v.ndim for a in axes} else n for i, n in enumerate(v.shape)]
    return total.reshape(keep)


class SwitchesStrategyWithBatch(NumpyBackend):
    """Changes its reduction with the number of rows, as kernels do: at most SMALL rows are
    each walked by one sequential loop (float32 partial sums added one by one), more rows
    take NumPy's blocked tree. Both are accurate enough for the value checks on ordinary
    rows; the same row gets different bits alone and in a batch. Its eval-mode BatchNorm
    likewise folds gamma / sqrt(var + eps) into a scale and a shift for batches larger
    than SMALL only."""

    SMALL = 2

    def _small(self, v, axes):
        return _rows(v, axes) <= self.SMALL

    def mean(self, v, axes):
        return _sequential_mean(v, axes) if self._small(v, axes) else super().mean(v, axes)

    def variance(self, v, axes, mu):
        if self._small(v, axes):
            return _sequential_mean((v - mu) ** 2, axes)
        return super().variance(v, axes, mu)

    def mean_square(self, v, axes):
        if self._small(v, axes):
            return _sequential_mean(v * v, axes)
        return super().mean_square(v, axes)

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _FoldsForLargeBatchesLayer(self, num_features, eps, momentum, affine,
                                          track_running_stats, np.dtype(dtype), weight, bias)


class SwitchesStrategyFrom512(SwitchesStrategyWithBatch):
    """SwitchesStrategyWithBatch with its threshold where launch heuristics put one
    (a split reduction from 512 rows on): the same row alone and in 257 rows agrees, in
    1024 rows it does not."""

    SMALL = 511


class SwitchesStrategyFrom2048(SwitchesStrategyWithBatch):
    """SwitchesStrategyWithBatch with its threshold where a launch heuristic takes a
    split-row reduction for large batches (2048 rows on: bug class 22, vLLM #48271, whose
    kernel was chosen by the token count): the sample alone and in batches of up to 1024
    rows agrees, rows of a batch of 4099 do not."""

    SMALL = 2047


class _FoldsForLargeBatchesLayer(NumpyBatchNorm):
    def forward(self, x, grad_output=None):
        if self.uses_batch_stats() or x.shape[0] <= self.backend.SMALL \
                or grad_output is not None or self.weight is None:
            return super().forward(x, grad_output)
        ct = self.ct
        shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        r = self.backend.inv_std(self.stats.var.astype(ct), ct.type(self.eps))
        scale = r * self.weight.astype(ct)
        shift = self.bias.astype(ct) - self.stats.mean.astype(ct) * scale
        return Result((x.astype(ct) * scale.reshape(shape) + shift.reshape(shape))
                      .astype(self.dtype))


class CarriesCompensation(NumpyBackend):
    """A compensated row sum whose compensation register is not reset between rows: each
    row starts with what the previous row's float sum lost. Within a rounding of the
    right sum (every value check passes), but a row's bits depend on its neighbour: the
    first row of a batch is the row alone, the others are not."""

    def _sum(self, v, axes):
        rows = np.moveaxis(v, axes, tuple(range(v.ndim - len(axes), v.ndim)))
        flat = rows.reshape(-1, int(np.prod([v.shape[a] for a in axes])))
        s = flat.sum(axis=1)
        lost = (flat.astype(np.float64).sum(axis=1) - s.astype(np.float64)).astype(v.dtype)
        carried = np.concatenate([np.zeros(1, v.dtype), lost[:-1]])
        keep = [1 if i in axes else n for i, n in enumerate(v.shape)]
        return (s + carried).reshape(keep)

    def mean(self, v, axes):
        return self._sum(v, axes) / v.dtype.type(v.size // _rows(v, axes))

    def mean_square(self, v, axes):
        return self._sum(v * v, axes) / v.dtype.type(v.size // _rows(v, axes))


class RandomOrderSums(NumpyBackend):
    """Adds each row's terms in a different order at every call, as a reduction with
    atomic adds does (whichever thread finishes first): accurate every time, never the
    same bits twice. The order comes from the instance's own call counter, so a test is
    repeatable whatever ran before it in the process."""

    def _permuted(self, v, axes):
        self.calls = getattr(self, "calls", 0) + 1
        rng = np.random.default_rng(self.calls)
        ends = tuple(range(v.ndim - len(axes), v.ndim))
        moved = np.moveaxis(v, axes, ends)
        flat = moved.reshape(moved.shape[:v.ndim - len(axes)] + (-1,))
        shuffled = flat[..., rng.permutation(flat.shape[-1])]
        return np.moveaxis(shuffled.reshape(moved.shape), ends, axes)

    # the terms added one after another in the new order, as atomic adds do (a pairwise
    # sum of a long positive row, such as RMSNorm's squares, can round two orders alike,
    # and the backend would then seem deterministic by chance)
    def mean(self, v, axes):
        return _sequential_mean(self._permuted(v, axes), axes)

    def mean_square(self, v, axes):
        return _sequential_mean(self._permuted(v * v, axes), axes)


class AtomicParamGradSums(NumpyBackend):
    """A correct forward and dL/dx; dL/dgamma and dL/dbeta summed over the rows in a
    different order at every call, as a backward that reduces them with atomic adds does
    (Liger PR #945, llm.c PR #445): accurate every time, not the same bits twice. The
    order comes from the instance's call counter, so a test is repeatable."""

    def _shuffled(self, op, x, normalized_shape, grad_output, *rest):
        res = getattr(super(), op)(x, normalized_shape, *rest, grad_output)
        if grad_output is None:
            return res
        self.calls = getattr(self, "calls", 0) + 1
        shape = tuple(normalized_shape)
        xr, gr = x.reshape((-1,) + shape), grad_output.reshape((-1,) + shape)
        order = np.random.default_rng(self.calls).permutation(xr.shape[0])
        again = getattr(super(), op)(xr[order], shape, *rest, gr[order])
        return res._replace(grad_weight=again.grad_weight, grad_bias=again.grad_bias)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._shuffled("layer_norm", x, normalized_shape, grad_output, weight, bias, eps)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._shuffled("rms_norm", x, normalized_shape, grad_output, weight, eps)


class AtomicParamGradSumsFrom1024(AtomicParamGradSums):
    """AtomicParamGradSums from 1024 rows on only, a deterministic reduction below (a
    backward that takes atomic adds for large batches: bug class 17, Liger PR #945, llm.c
    PR #445): the gradients of 257 rows are the same bits at every call, those of 4099
    rows are not."""

    def _shuffled(self, op, x, normalized_shape, grad_output, *rest):
        if x.size // max(int(np.prod(normalized_shape)), 1) < 1024:
            return getattr(NumpyBackend, op)(self, x, normalized_shape, *rest, grad_output)
        return super()._shuffled(op, x, normalized_shape, grad_output, *rest)


class ReusesOutputBuffer(RandomOrderSums):
    """RandomOrderSums whose LayerNorm and RMSNorm write every output into one buffer per
    shape and dtype, kept between calls (a static output, as a graph runtime's may be):
    a harness that keeps the first call's array sees the second call's bits in it."""

    def _into_buffer(self, res):
        buffers = self.__dict__.setdefault("buffers", {})
        fields = {}
        for k, v in res._asdict().items():
            if isinstance(v, np.ndarray):
                buf = buffers.setdefault((k, v.shape, v.dtype.str), np.empty_like(v))
                buf[...] = v
                fields[k] = buf
        return res._replace(**fields)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._into_buffer(super().layer_norm(x, normalized_shape, weight, bias, eps,
                                                    grad_output))

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._into_buffer(super().rms_norm(x, normalized_shape, weight, eps, grad_output))


class _TrainUsesRunningStatsLayer(NumpyBatchNorm):
    """Normalizes with the running statistics in training mode too (a frozen BatchNorm
    that still updates its statistics): no sample sees the rest of its batch."""

    def forward(self, x, grad_output=None):
        if not self.training:
            return super().forward(x, grad_output)
        self.training = False
        try:
            res = super().forward(x, grad_output)
        finally:
            self.training = True
        super().forward(x)  # the training forward, for its running-statistics update only
        return res


TrainUsesRunningStats = _bn_backend(_TrainUsesRunningStatsLayer)


class DeclaresNotBatchInvariant(SwitchesStrategyWithBatch):
    """SwitchesStrategyWithBatch that says so."""

    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": 1e-6, "batch_norm": 1e-5},
        batch_invariant=False, deterministic=False,
        reasons={"batch_invariant": "small batches take a split reduction",
                 "deterministic": "atomic adds"})


class DeclaresNondeterministic(RandomOrderSums):
    conventions = DeclaresNotBatchInvariant.conventions


class DeclaresButIsInvariant(NumpyBackend):
    """The correct numpy backend, declaring it is neither batch-invariant nor deterministic."""

    conventions = DeclaresNotBatchInvariant.conventions


# ---------------------------------------------------------------- rounding bias
def truncate_to(a32: np.ndarray, dtype) -> np.ndarray:
    """float32 values to a half dtype rounding toward zero: round to nearest, then step
    the magnitude down one (sign-magnitude bits) wherever that rounded away from zero."""
    near = np.asarray(a32, np.float32).astype(dtype)
    away = np.abs(near.astype(np.float32)) > np.abs(a32)
    bits = near.view(np.uint16).copy()
    bits[away] -= 1
    return bits.view(dtype)


class _TruncatingBatchNorm(NumpyBatchNorm):
    """NumpyBatchNorm computing a half-precision layer in float32, its results encoded by
    truncation."""

    def forward(self, x, grad_output=None):
        half = self.dtype
        if half.name not in ("float16", "bfloat16"):
            return super().forward(x, grad_output)
        self.dtype = np.dtype(np.float32)
        try:
            res = super().forward(x, grad_output)
        finally:
            self.dtype = half
        return Result(*(None if a is None else truncate_to(a, half) for a in res))


class TruncatesHalf(NumpyBackend):
    """Computes float16/bfloat16 in float32, as it should, then encodes the result by
    truncation instead of rounding to nearest: within 1 ULP of every element. Every op:
    LayerNorm and RMSNorm, the fused add + norm (through them), the QK-norm scores and
    BatchNorm."""

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        if not self._half(q):
            return super().qk_norm_scores(q, k, q_weight, k_weight, eps, scale)
        d = q.shape[-1]
        # q_hat and k_hat rounded to nearest (numpy's), the scores truncated
        q_hat = NumpyBackend.rms_norm(self, q, (d,), q_weight, eps).output.astype(np.float32)
        k_hat = NumpyBackend.rms_norm(self, k, (d,), k_weight, eps).output.astype(np.float32)
        scores = np.matmul(q_hat, np.swapaxes(k_hat, -1, -2)) * np.float32(scale)
        return truncate_to(scores, q.dtype)

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _TruncatingBatchNorm(self, num_features, eps, momentum, affine,
                                    track_running_stats, np.dtype(dtype), weight, bias)

    @staticmethod
    def _half(x):
        return x.dtype.name in ("float16", "bfloat16")

    def _encode(self, res, dtype):
        return Result(*(None if a is None else truncate_to(a, dtype) for a in res))

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        if not self._half(x):
            return super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        g = None if grad_output is None else grad_output.astype(np.float32)
        res = super().layer_norm(x.astype(np.float32), normalized_shape, weight, bias, eps, g)
        return self._encode(res, x.dtype)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        if not self._half(x):
            return super().rms_norm(x, normalized_shape, weight, eps, grad_output)
        g = None if grad_output is None else grad_output.astype(np.float32)
        res = super().rms_norm(x.astype(np.float32), normalized_shape, weight, eps, g)
        return self._encode(res, x.dtype)


class TruncatesHalfGradients(TruncatesHalf):
    """A forward rounded to nearest; a backward that stores dL/dx, dL/dgamma and dL/dbeta
    in float16/bfloat16 by truncation, as a bfloat16 store `bits >> 16` does (ROCm/aiter
    #5151 in a fused RMSNorm's output, tenstorrent/tt-metal PR #27171 in a training
    stack's conversion): within 1 ULP of every element, every gradient biased toward
    zero. LayerNorm and RMSNorm (the fused add + norm through them); its QK-norm and
    BatchNorm are numpy's."""

    qk_norm_scores = NumpyBackend.qk_norm_scores
    batch_norm = NumpyBackend.batch_norm

    def _encode(self, res, dtype):
        return Result(res.output.astype(dtype),
                      *(None if a is None else truncate_to(a, dtype) for a in res[1:]))


class BackwardFromTheOutput(NumpyBackend):
    """A memory-efficient backward (Apex's memory_efficient LayerNorm and RMSNorm): it
    keeps y, not x, and rebuilds x_hat = (y - beta) / gamma, which is NaN (0 / 0) or inf
    where gamma is 0 (zero-initialized or pruned gains) and loses bits where it is small."""

    def _vjp_from_output(self, op, x, normalized_shape, weight, bias, eps, grad_output):
        args = (x, normalized_shape, weight, bias, eps) if op == "layer_norm" else \
            (x, normalized_shape, weight, eps)
        res = getattr(NumpyBackend, op)(self, *args, grad_output)
        if grad_output is None or weight is None:
            return res
        ct = compute_dtype(x.dtype)
        axes = _axes(x, normalized_shape)
        y, w, g = res.output.astype(ct), weight.astype(ct), grad_output.astype(ct)
        with np.errstate(all="ignore"):
            x_hat = (y - (bias.astype(ct) if bias is not None else 0)) / w
            var = _mean((x.astype(ct) - (_mean(x.astype(ct), axes) if op == "layer_norm" else 0))
                        ** 2, axes)
            r = 1 / np.sqrt(var + ct.type(eps))
            h = g * w
            gx = r * (h - x_hat * _mean(h * x_hat, axes)
                      - (_mean(h, axes) if op == "layer_norm" else 0))
        return res._replace(grad_input=gx.astype(x.dtype))

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._vjp_from_output("layer_norm", x, normalized_shape, weight, bias, eps,
                                     grad_output)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._vjp_from_output("rms_norm", x, normalized_shape, weight, None, eps,
                                     grad_output)


class RoundsBeforeTheGain(NumpyBackend):
    """RMSNorm as Hugging Face's LlamaRMSNorm writes it, weight * x_hat.to(input_dtype):
    the normalized value rounded to float16/bfloat16, then multiplied by gamma and
    rounded again (the catalogue's rms.half_cast_before_weight; TransformerEngine #1132,
    vLLM #42325). Within one ULP of every element and unbiased: about a quarter of the
    elements one step off the oracle's rounding."""

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        res = super().rms_norm(x, normalized_shape, None, eps, grad_output)
        if weight is None or grad_output is not None:
            return super().rms_norm(x, normalized_shape, weight, eps, grad_output)
        ct = compute_dtype(x.dtype)
        # (the product of two values of the dtype is exact in float32: one rounding)
        return Result((res.output.astype(ct) * weight.astype(ct)).astype(x.dtype))


class SwapsLnWiring(OracleBackend):
    """Wires Pre-LN when asked for Post-LN and Post-LN when asked for Pre-LN (F8)."""

    def encoder_layer(self, x, params, num_heads, *, norm_first, **kw):
        return super().encoder_layer(x, params, num_heads, norm_first=not norm_first, **kw)


_FLOAT32_SUM = dataclasses.replace(OracleBackend.conventions, fused_residual_sum="float32")


class MixesFusedContracts(OracleBackend):
    """Declares the float32 contract of fused add + norm (F8) but takes the statistics
    from the residual it has just written back, the sum rounded to the dtype (vLLM's CUDA
    kernel before #52104 fixed it), while normalizing the unrounded sum."""

    conventions = _FLOAT32_SUM

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        res = super().fused_add_norm(x, residual, norm, normalized_shape, weight, bias, eps,
                                     grad_outputs)
        s = x.astype(np.float64) + residual.astype(np.float64)
        stats_of = spec.round_to(s, x.dtype).astype(np.float64)
        axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
        if norm == "layer_norm":
            mu = stats_of.mean(axis=axes, keepdims=True)
            y = (s - mu) / np.sqrt(((stats_of - mu) ** 2).mean(axis=axes, keepdims=True) + eps)
        else:
            y = s / np.sqrt((stats_of * stats_of).mean(axis=axes, keepdims=True) + eps)
        y = y * weight.astype(np.float64) if weight is not None else y
        y = y + bias.astype(np.float64) if bias is not None else y
        return res._replace(output=spec.round_to(y, x.dtype))


class DeclaresFloat32ButRounds(OracleBackend):
    """Follows the rounded contract of fused add + norm (the norm of the sum rounded to the
    dtype) while its conventions declare the float32 one."""

    conventions = _FLOAT32_SUM

    def fused_add_norm(self, x, residual, *args, **kw):
        self.conventions = OracleBackend.conventions  # computes as "rounded" ...
        try:
            return super().fused_add_norm(x, residual, *args, **kw)
        finally:
            self.conventions = _FLOAT32_SUM  # ... and says "float32"


class UnaddedResidual(OracleBackend):
    """Fused add + norm that writes back the residual it was given, not x + residual."""

    def fused_add_norm(self, x, residual, *args, **kw):
        return super().fused_add_norm(x, residual, *args, **kw)._replace(residual=residual.copy())


class DropsResidualGradient(OracleBackend):
    """Fused add + norm whose backward forgets the written-back residual's upstream
    gradient: dL/dx = J_norm^T g_y only."""

    def fused_add_norm(self, x, residual, *args, grad_outputs=None):
        if grad_outputs is not None:
            grad_outputs = (grad_outputs[0], np.zeros_like(grad_outputs[1]))
        return super().fused_add_norm(x, residual, *args, grad_outputs=grad_outputs)


# ---------------------------------------------------------------- a review's blind spots (2)
def _last_axes(v, axes) -> bool:
    return tuple(axes) == tuple(range(v.ndim - len(axes), v.ndim))


class MidSizeLoopedPath(NumpyBackend):
    """Rows of 4096 < d <= 65536 no longer fit one block and a looped kernel (blocks of
    1024) takes them: its LayerNorm averages the blocks' variances (a Welford merge
    without the spread of the block means) and its RMSNorm divides by the padded
    length. Narrower and wider rows take right paths (Llama's d = 5120 hits it)."""

    LO, HI, BLOCK = 4096, 65536, 1024

    def _looped(self, v, axes):
        return _last_axes(v, axes) and len(axes) == 1 and self.LO < v.shape[-1] <= self.HI

    def variance(self, v, axes, mu):
        if not self._looped(v, axes):
            return super().variance(v, axes, mu)
        blocks = [v[..., i:i + self.BLOCK] for i in range(0, v.shape[-1], self.BLOCK)]
        return sum(_mean((b - _mean(b, (-1,))) ** 2, (-1,)) for b in blocks) / \
            v.dtype.type(len(blocks))

    def mean_square(self, v, axes):
        if not self._looped(v, axes):
            return super().mean_square(v, axes)
        padded = -(-v.shape[-1] // self.BLOCK) * self.BLOCK
        return super().mean_square(v, axes) * v.dtype.type(v.shape[-1] / padded)


class TiledParamGradDropsTail(NumpyBackend):
    """With 128 rows or more and 64 columns or more, dL/dgamma and dL/dbeta take a tiled
    column reduction (tiles of 32 columns, picked by M and N as pytorch's
    GammaBetaBackward picks its kernel) whose tile loop runs N // 32 times: the last
    N % 32 columns are left 0."""

    def _drop(self, res, x, normalized_shape):
        n = int(np.prod(normalized_shape))
        if res.grad_weight is None or x.size // max(n, 1) < 128 or n < 64 or n % 32 == 0:
            return res
        out = {}
        for k in ("grad_weight", "grad_bias"):
            v = getattr(res, k)
            if v is not None:
                v = v.copy().reshape(-1)
                v[n // 32 * 32:] = 0
                out[k] = v.reshape(tuple(normalized_shape))
        return res._replace(**out)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        return self._drop(super().layer_norm(x, normalized_shape, weight, bias, eps,
                                             grad_output), x, normalized_shape)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        return self._drop(super().rms_norm(x, normalized_shape, weight, eps, grad_output), x,
                          normalized_shape)


class LargeProblemOnePassVariance(NumpyBackend):
    """Problems of 256 rows or more and 128 columns or more (every LLM prefill) take a
    'fast' kernel whose variance is E[x^2] - E[x]^2 in one pass (onnxruntime #28463,
    pytorch #51102); smaller ones are two-pass, so B1's small cases pass."""

    def variance(self, v, axes, mu):
        d = int(np.prod([v.shape[a] for a in axes]))
        if not _last_axes(v, axes) or _rows(v, axes) < 256 or d < 128:
            return super().variance(v, axes, mu)
        return _mean(v * v, axes) - mu * mu


class _QuadChannelStats(NumpyBackend):
    """BatchNorm statistics of 4096 values per channel or more taken by a two-stage kernel
    that loads 4 channels per vector: for C > 4 not a multiple of 4 the last C % 4
    channels are never reduced and keep mean 0, variance 1."""

    def _unreduced(self, v, stat, fill):
        c, m = stat.shape[1], v.size // v.shape[1]  # statistics: [1, C, 1, ...]
        if m < 4096 or c <= 4 or c % 4 == 0:
            return stat
        stat = stat.copy()
        stat[:, c - c % 4:] = fill
        return stat

    def mean(self, v, axes):
        return self._unreduced(v, super().mean(v, axes), 0.0)

    def variance(self, v, axes, mu):
        return self._unreduced(v, super().variance(v, axes, mu), 1.0)


class LargeBatchTailChannels(NumpyBackend):
    """BatchNorm with _QuadChannelStats' statistics: [4096, 6] normalizes channels 4 and 5
    with mean 0 and variance 1 (LayerNorm and RMSNorm are numpy's)."""

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return NumpyBatchNorm(_QuadChannelStats(), num_features, eps, momentum, affine,
                              track_running_stats, np.dtype(dtype), weight, bias)


class _MomentumZeroLayer(NumpyBatchNorm):
    """`a = momentum or 1 / num_batches_tracked`: momentum 0.0 (statistics frozen) is
    taken for None, and the running statistics become a cumulative average."""

    def update_running(self, mu, sum_sq, m):
        if not self.stats.momentum:
            self.stats.momentum = None
        super().update_running(mu, sum_sq, m)


class MomentumZeroIsNone(NumpyBackend):
    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _MomentumZeroLayer(self, num_features, eps, momentum, affine,
                                  track_running_stats, np.dtype(dtype), weight, bias)


def _affine(y, weight, bias, ct):
    if weight is not None:
        y = y * weight.astype(ct)
    return y + bias.astype(ct) if bias is not None else y


class FusedPaddedLanes(NumpyBackend):
    """A fused add + norm kernel of its own that pads the row to the next power of two
    and does not mask the padding: RMSNorm divides the sum of squares by the padded
    width, LayerNorm's variance gains (P - d) mu^2 / d (Liger-Kernel #518, triton #9838,
    in the fused kernel). The plain norms are numpy's."""

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        res = super().fused_add_norm(x, residual, norm, normalized_shape, weight, bias, eps,
                                     grad_outputs)
        ct = compute_dtype(x.dtype)
        s, axes = res.residual.astype(ct), _axes(x, normalized_shape)
        d = int(np.prod(normalized_shape))
        p = 1 << (d - 1).bit_length()
        if p == d:
            return res
        if norm == "rms_norm":
            y = s / np.sqrt(_mean(s * s, axes) * ct.type(d / p) + ct.type(eps))
        else:
            mu = _mean(s, axes)
            var = _mean((s - mu) ** 2, axes) + ct.type((p - d) / d) * mu * mu
            y = (s - mu) / np.sqrt(var + ct.type(eps))
        return res._replace(output=_affine(y, weight, bias, ct).astype(x.dtype))


class FusedLargeBatchMixes(NumpyBackend):
    """Declares the 'rounded' contract (numpy's); from 256 tokens on, in float16 and
    bfloat16, its large-batch path takes the statistics from the unrounded float32 sum
    while it normalizes the rounded residual it wrote back (vLLM #52104, in a path chosen
    by num_tokens >= 256 as vLLM #48271's heuristic chooses)."""

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        res = super().fused_add_norm(x, residual, norm, normalized_shape, weight, bias, eps,
                                     grad_outputs)
        if x.size // int(np.prod(normalized_shape)) < 256 or compute_dtype(x.dtype) == x.dtype:
            return res
        ct, axes = np.float32, _axes(x, normalized_shape)
        exact, rounded = x.astype(ct) + residual.astype(ct), res.residual.astype(ct)
        if norm == "rms_norm":
            y = rounded / np.sqrt(_mean(exact * exact, axes) + ct(eps))
        else:
            mu = _mean(exact, axes)
            y = (rounded - mu) / np.sqrt(_mean((exact - mu) ** 2, axes) + ct(eps))
        return res._replace(output=_affine(y, weight, bias, ct).astype(x.dtype))


class FusedIgnoresStrides(NumpyBackend):
    """The fused kernel takes data pointers and assumes contiguous rows (vLLM's
    fused_add_rms_norm before it took strides): a strided or transposed x or residual is
    read in memory order. The plain norms handle strides."""

    @staticmethod
    def _in_memory_order(a):
        if a.flags.c_contiguous:
            return a
        strides = tuple(int(np.prod(a.shape[k + 1:])) * a.itemsize for k in range(a.ndim))
        return np.lib.stride_tricks.as_strided(a, a.shape, strides).copy()

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        return super().fused_add_norm(self._in_memory_order(x), self._in_memory_order(residual),
                                      norm, normalized_shape, weight, bias, eps, grad_outputs)


class FusedAssumes2D(NumpyBackend):
    """The fused kernel takes num_tokens = x.shape[0] and hidden = x.size / num_tokens
    (FlagGems #5392, Liger-Kernel #1375, in the fused kernel): right for [tokens, d] and
    when every axis after the first is normalized; [B, T, d] normalized over d has each
    [T, d] slab normalized as one row, gamma tiled T times."""

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        if x.ndim - len(normalized_shape) <= 1:
            return super().fused_add_norm(x, residual, norm, normalized_shape, weight, bias,
                                          eps, grad_outputs)
        slab = x.shape[1:]

        def tiled(p):
            return None if p is None else np.broadcast_to(p, slab).copy()
        res = super().fused_add_norm(x, residual, norm, slab, tiled(weight), tiled(bias), eps,
                                     grad_outputs)
        lead = tuple(range(x.ndim - len(normalized_shape) - 1))

        def summed(g):
            return None if g is None else g.astype(np.float32).sum(axis=lead).astype(x.dtype)
        return res._replace(grad_weight=summed(res.grad_weight), grad_bias=summed(res.grad_bias))


class _SequentialBelow256(SwitchesStrategyWithBatch):
    SMALL = 255


class FusedSwitchesStrategy(NumpyBackend):
    """The fused add + norm kernel picks its reduction by the number of tokens (a
    sequential loop per row below 256 tokens, NumPy's tree from 256 on, as vLLM #48271's
    heuristic picks a kernel): the same row rounds differently alone and in a large
    batch. The plain norms are numpy's, batch-invariant."""

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        return NumpyBackend.fused_add_norm(_SequentialBelow256(), x, residual, norm,
                                           normalized_shape, weight, bias, eps, grad_outputs)


class FusedAtomicParamGradSums(NumpyBackend):
    """The fused add + norm backward reduces dL/dgamma and dL/dbeta with atomic adds (see
    AtomicParamGradSums): new bits at every call, in the fused op only."""

    def __init__(self):
        self._atomic = AtomicParamGradSums()

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        return NumpyBackend.fused_add_norm(self._atomic, x, residual, norm, normalized_shape,
                                           weight, bias, eps, grad_outputs)


class _FusedRmsOnly:
    """The next class's fused add + norm for RMSNorm alone; numpy's for LayerNorm."""

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        fused = super().fused_add_norm if norm == "rms_norm" else \
            partial(NumpyBackend.fused_add_norm, self)
        return fused(x, residual, norm, normalized_shape, weight, bias, eps, grad_outputs)


class FusedRmsSwitchesStrategy(_FusedRmsOnly, FusedSwitchesStrategy):
    """FusedSwitchesStrategy in the fused add + RMSNorm kernel alone, where vLLM #48271's
    was (a sequential loop per row below 256 tokens, a tree from 256 on); its fused add +
    LayerNorm is numpy's, batch-invariant."""


class FusedRmsAtomicParamGradSums(_FusedRmsOnly, FusedAtomicParamGradSums):
    """FusedAtomicParamGradSums in the fused add + RMSNorm backward alone (a fused RMSNorm
    kernel of its own, reducing dL/dgamma with atomic adds: Liger PR #945); the fused add +
    LayerNorm backward is deterministic."""


class FusedTruncatesResidual(NumpyBackend):
    """The fused add + norm normalizes the sum rounded to nearest, as it should, but
    writes the residual back truncated: within 1 ULP of every element, biased toward
    zero."""

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        res = super().fused_add_norm(x, residual, norm, normalized_shape, weight, bias, eps,
                                     grad_outputs)
        if x.dtype.name not in ("float16", "bfloat16"):
            return res
        exact = x.astype(np.float32) + residual.astype(np.float32)
        return res._replace(residual=truncate_to(exact, x.dtype))


# ---------------------------------------------------------------- a third review's blind spots
def _row_count(x, normalized_shape) -> tuple[int, int]:
    """(rows, d) of x normalized over normalized_shape."""
    d = int(np.prod(normalized_shape))
    return (x.size // d if d else 0), d


class MultiRowGridRoundsDown(_CutsNormOutputs):
    """Problems of 32 rows or more with 512 <= d <= 65536 take a kernel of 4 rows a
    program, launched on rows // 4 programs (floor, not ceil): the last rows % 4 rows
    keep the zeros of the output buffer. Kernels of several rows a program shipped wrong
    (FlagGems PR #59 with BLOCK_ROW_SIZE > 1, attorch #17 with BLOCK_SIZE_BATCH > 1); a
    grid that misses rows is bug class 10 (apex #411). Fewer or narrower rows take a
    one-row kernel, launched right."""

    ROWS = 4

    def _cut(self, res, x, normalized_shape):
        rows, d = _row_count(x, normalized_shape)
        if rows < 32 or not 512 <= d <= 65536 or rows % self.ROWS == 0:
            return res
        out = res.output.copy()
        _rows_of(out, normalized_shape)[rows - rows % self.ROWS:] = 0
        return res._replace(output=out)


class TwoStageParamGradDropsTailRows(FastPathFrom256):
    """dL/dgamma and dL/dbeta of rows of d >= 512, from 64 rows on, in two stages: a
    partial sum per block of 32 rows, then a stage 2 that adds rows // 32 of them, so the
    last rows % 32 rows never reach the sums (the two-stage partial-sum path of pytorch
    PRs #192016 / #193016, bug class 10). Narrow rows take a one-stage reduction that is
    right: every row-count case (d = 4) passes."""

    BLOCK = 32

    def _full_rows(self, x, normalized_shape, grad_output):
        rows, d = _row_count(x, normalized_shape)
        if grad_output is None or d < 512 or rows < 64 or rows % self.BLOCK == 0:
            return None
        return rows // self.BLOCK * self.BLOCK


class VectorTailOutsideStats(NumpyBackend):
    """LayerNorm's inference forward (no upstream gradient) for 1024 < d <= 65536 walks
    the row in vectors of 16 and leaves the d % 16 tail out of the mean and variance; the
    tail is still normalized, with the other lanes' statistics. Lanes past the last whole
    vector or block left out: xformers #785 (columns past BLOCK_SIZE_N ignored), bug
    class 1 (Liger-Kernel #518). Its training forward, d <= 1024 and RMSNorm are right."""

    VEC = 16

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        _, d = _row_count(x, normalized_shape)
        if grad_output is not None or not 1024 < d <= 65536 or d % self.VEC == 0 or \
                len(normalized_shape) != 1:
            return super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        ct = compute_dtype(x.dtype)
        xc = x.astype(ct)
        head = xc[..., :d - d % self.VEC]
        mu = _mean(head, (-1,))
        r = 1.0 / np.sqrt(_mean((head - mu) ** 2, (-1,)) + ct.type(eps))
        return Result(_affine((xc - mu) * r, weight, bias, ct).astype(x.dtype))


class FusedSecondPassRereadsX(NumpyBackend):
    """Fused add + norm of rows wider than one block of 1024: pass 1 adds, writes the
    residual back and sums the statistics of the sum; pass 2 reloads the row to
    normalize it from x's pointer instead of the residual it wrote (a pointer mixed up in
    a fused kernel, bug class 15: nano-vllm PR #171's RMSNorm corrupted the residual).
    Rows of one block are one pass, and right."""

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        res = super().fused_add_norm(x, residual, norm, normalized_shape, weight, bias, eps,
                                     grad_outputs)
        if int(np.prod(normalized_shape)) <= 1024:
            return res
        ct = compute_dtype(x.dtype)
        s, xc, axes = res.residual.astype(ct), x.astype(ct), _axes(x, normalized_shape)
        mu = _mean(s, axes) if norm == "layer_norm" else ct.type(0)
        y = (xc - mu) / np.sqrt(_mean((s - mu) ** 2, axes) + ct.type(eps))
        return res._replace(output=_affine(y, weight, bias if norm == "layer_norm" else None,
                                           ct).astype(x.dtype))


class QkHalvesOwnRms(NumpyBackend):
    """QK-norm for head_dim a multiple of 128 above 128 (Gemma's 256): one warp per 128
    lanes, and the cross-warp step of the sum of squares is missing, so each 128-lane
    half is normalized by its own RMS (sglang's kernels take 256 in a warp path of its
    own, PR #20661, and QK-norm's cross-warp sum through shared memory, PR #18073).
    head_dim up to 128, and 160, are right."""

    LANES = 128

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        d = q.shape[-1]
        if d <= self.LANES or d % self.LANES:
            return super().qk_norm_scores(q, k, q_weight, k_weight, eps, scale)
        ct = compute_dtype(q.dtype)

        def normed(a, w):
            warps = a.astype(ct).reshape(a.shape[:-1] + (d // self.LANES, self.LANES))
            y = (warps / np.sqrt(_mean(warps * warps, (-1,)) + ct.type(eps))).reshape(a.shape)
            return y * w.astype(ct) if w is not None else y

        s = np.matmul(normed(q, q_weight), np.swapaxes(normed(k, k_weight), -1, -2))
        return (s * ct.type(scale)).astype(q.dtype)


class QkKeyGridStopsAt65535(NumpyBackend):
    """QK-norm normalizes k in a kernel of its own, one program per key row (batch x
    heads x keys: a long KV cache) on a grid whose y dimension stops at GRID_LIMIT: key
    rows past it keep the zeros of k_hat's buffer and score 0 (a KV cache's length as
    grid.y: llama.cpp PR #19999, ik_llama.cpp PR #2367; bug class 10). Queries take the
    row-count-safe kernel."""

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        s = super().qk_norm_scores(q, k, q_weight, k_weight, eps, scale)
        past = np.arange(k.size // k.shape[-1]).reshape(k.shape[:-1]) >= GRID_LIMIT
        return np.where(past[..., None, :], np.zeros((), s.dtype), s)


# ---------------------------------------------------------------- what the harness trusts
class _HidesItsModeLayer(OracleBatchNorm):
    """The NoGradSkipsUpdate bug (a no-grad forward is validation: it never updates the
    statistics), in a layer whose `training` reads False outside its forwards: a harness
    that asked the layer which mode it is in would expect no update either."""

    mode = True
    _running_as = None

    @property
    def training(self):
        return False if self._running_as is None else self._running_as

    @training.setter
    def training(self, value):  # (set by train(), eval() and the constructor)
        self.mode = value

    def _run(self, mode, x, grad_output):
        self._running_as = mode
        try:
            return super().forward(x, grad_output)
        finally:
            self._running_as = None

    def forward(self, x, grad_output=None):
        return self._run(self.mode, x, grad_output)

    def forward_no_grad(self, x):
        return self._run(False, x, None).output


class HidesItsMode(OracleBackend):
    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _HidesItsModeLayer(num_features, eps, momentum, affine, track_running_stats,
                                  np.dtype(dtype), weight, bias)


class _NoModeAttributeLayer:
    """A correct layer with no `training` attribute (the protocol does not require one)."""

    def __init__(self, inner):
        self._inner = inner

    def train(self):
        self._inner.training = True

    def eval(self):
        self._inner.training = False

    def forward(self, x, grad_output=None):
        return self._inner.forward(x, grad_output)

    def forward_no_grad(self, x):
        return self._inner.forward_no_grad(x)

    running_mean = property(lambda self: self._inner.running_mean)
    running_var = property(lambda self: self._inner.running_var)
    num_batches_tracked = property(lambda self: self._inner.num_batches_tracked)


class NoModeAttribute(OracleBackend):
    """Correct: must pass every BatchNorm check."""

    def batch_norm(self, *args, **kwargs):
        return _NoModeAttributeLayer(super().batch_norm(*args, **kwargs))


class _RewritesItsInputLater(Result):
    """A Result whose attributes, read by the caller after the call returned, write into
    the input the call was given: an asynchronous kernel's late write."""

    __slots__ = ()

    def _asdict(self):
        while _LATE_WRITES:
            x, value = _LATE_WRITES.pop()
            x[...] = value
        return super()._asdict()


_LATE_WRITES: list = []


class RewritesInputLate(NumpyBackend):
    """Normalizes x^3 instead of x, and writes x^3 into x only when its result is read, so
    the input looks untouched when the call returns."""

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        cubed = (x.astype(np.float64) ** 3).astype(x.dtype)
        res = super().layer_norm(cubed, normalized_shape, weight, bias, eps, grad_output)
        _LATE_WRITES.append((x, cubed))
        return _RewritesItsInputLater(*res)


class CachesById(AtomicParamGradSums):
    """AtomicParamGradSums behind a cache of results keyed by the id() of the arrays it is
    given (not holding them: an id may come back for other arrays once they are freed,
    which the harness prevents within a case): the same objects twice give the cached
    answer, not a second nondeterministic one."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def _cached(self, op, args, kwargs):
        key = (op, *(id(a) if isinstance(a, np.ndarray) else repr(a)
                     for a in (*args, *kwargs.values())))
        if key not in self.cache:
            self.cache[key] = getattr(super(), op)(*args, **kwargs)
        return self.cache[key]

    def layer_norm(self, *args, **kwargs):
        return self._cached("layer_norm", args, kwargs)

    def rms_norm(self, *args, **kwargs):
        return self._cached("rms_norm", args, kwargs)

    def fused_add_norm(self, *args, **kwargs):
        return self._cached("fused_add_norm", args, kwargs)


class _CountsFractionsLayer(OracleBatchNorm):
    @property
    def num_batches_tracked(self):
        return None if self.rm is None else self.t + 0.9


class CountsFractions(OracleBackend):
    """num_batches_tracked 0.9 above the count: int() would truncate it to the right one."""

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _CountsFractionsLayer(num_features, eps, momentum, affine, track_running_stats,
                                     np.dtype(dtype), weight, bias)


class DataParallelWritesParams(NumpyBackend):
    """Data-parallel BatchNorm that writes into the caller's gamma and beta (an optimizer
    step taken on the arrays it was given)."""

    def data_parallel_batch_norm(self, steps, **kwargs):
        res = super().data_parallel_batch_norm(steps, **kwargs)
        kwargs["weight"][...] += 1.0
        kwargs["bias"][...] -= 1.0
        return res
