"""Deliberately broken backends, one defect each, derived from the correct `numpy`
backend (or the oracle backend where a capability is needed). test_harness_catches.py
shows which check catches which."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from normspec.impls.numpy_ref import NumpyBackend, NumpyBatchNorm, compute_dtype
from normspec.impls.protocol import Conventions, Result
from oracle_backend import OracleBackend, OracleBatchNorm


class NaiveVariance(NumpyBackend):
    """var = E[x^2] - E[x]^2: catastrophic cancellation for a large mean."""

    def variance(self, v, axes, mu):
        return np.maximum((v * v).mean(axis=axes, keepdims=True) - mu * mu, 0)


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


class NoGradSkipsUpdate(OracleBackend):
    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _NoGradSkipsLayer(num_features, eps, momentum, affine, track_running_stats,
                                 np.dtype(dtype), weight, bias)



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
