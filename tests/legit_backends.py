"""Correct kernels that compute differently from the numpy reference: the suite must
pass every one of them (a check that fails one fails a backend falsely)."""

from __future__ import annotations

import numpy as np
from normspec.impls.numpy_ref import NumpyBackend, NumpyBatchNorm
from oracle_backend import OracleBackend, OracleBatchNorm


class _RsqrtOneUlp(NumpyBackend):
    """1/sqrt(var + eps) one ULP off in the compute dtype, as an approximate reciprocal
    square root may be (CUDA documents rsqrtf within 2 ULPs): `towards` says which way."""

    towards = np.inf

    def inv_std(self, var, eps):
        r = super().inv_std(var, eps)
        with np.errstate(all="ignore"):
            off = np.nextafter(r, np.asarray(self.towards, dtype=r.dtype))
            return np.where(np.isfinite(r) & (r > 0), off, r)


class RsqrtOneUlpHigh(_RsqrtOneUlp):
    towards = np.inf


class RsqrtOneUlpLow(_RsqrtOneUlp):
    towards = 0.0


class _CountsInFloatsLayer(OracleBatchNorm):
    @property
    def num_batches_tracked(self):
        return None if self.rm is None else np.float32(self.t)


class _StatsInFloat64Layer(NumpyBatchNorm):
    @property
    def running_mean(self):
        return None if self.stats.mean is None else self.stats.mean.astype(np.float64)

    @property
    def running_var(self):
        return None if self.stats.var is None else self.stats.var.astype(np.float64)


class ReportsStatsInFloat64(NumpyBackend):
    """numpy's BatchNorm, its running statistics handed over as float64 copies of the
    buffers it computes in (the protocol does not type them)."""

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _StatsInFloat64Layer(self, num_features, eps, momentum, affine,
                                    track_running_stats, np.dtype(dtype), weight, bias)


class CountsInFloats(OracleBackend):
    """num_batches_tracked as a float32 (the protocol does not type it)."""

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _CountsInFloatsLayer(num_features, eps, momentum, affine, track_running_stats,
                                    np.dtype(dtype), weight, bias)


def one_step(backend, dtype: str, x, *, then_eval=None, momentum=1.0):
    """The records of a BatchNorm layer of x.shape[1] channels trained on the batch `x`
    (float64 values, rounded to `dtype` as inputs are), then, with `then_eval`, in eval
    on that batch."""
    from normspec.conformance.cases import Literal
    from normspec.conformance.context import Context
    from normspec.conformance.ops.batch_norm import BatchNormDriver
    from normspec.impls.protocol import np_dtype

    ctx = Context(backend_name=backend.name, source="tests", backend=backend, check_id="t",
                  claim="F4", op="batch_norm", dtype=np_dtype(dtype), seed=0, examples=1,
                  conventions=backend.conventions)
    with np.errstate(all="ignore"), ctx.case("one training step"):
        driver = BatchNormDriver(ctx, x.shape[1], momentum=momentum)
        driver.step("x", Literal.of(x), mode="train")
        if then_eval is not None:
            driver.set_mode(False)
            driver.step("x_eval", Literal.of(then_eval), mode="eval")
    return ctx.records


def eval_after_train(backend, dtype: str, *, seed: int, spread: float, grad: bool):
    """The record of one case: a BatchNorm layer of 2 channels trained on one batch of
    channel means 0 and 50 (momentum 1: running mean 50), then in eval on another batch
    of spread `spread`, with an upstream gradient if `grad`."""
    from normspec.conformance.cases import Literal
    from normspec.conformance.context import Context
    from normspec.conformance.ops.batch_norm import BatchNormDriver
    from normspec.impls.protocol import np_dtype

    ctx = Context(backend_name=backend.name, source="tests", backend=backend, check_id="t",
                  claim="F5", op="batch_norm", dtype=np_dtype(dtype), seed=0, examples=1,
                  conventions=backend.conventions)
    rng = np.random.default_rng(seed)
    train, test, g = rng.normal(size=(64, 2)), spread * rng.normal(size=(64, 2)), rng.normal(
        size=(64, 2))
    train[:, 1] += 50.0
    test[:, 1] += 50.0
    with np.errstate(all="ignore"), ctx.case("eval after training, channel means 0 and 50"):
        driver = BatchNormDriver(ctx, 2, momentum=1.0)
        driver.step("x", Literal.of(train), mode="train")
        driver.set_mode(False)
        driver.step("x_test", Literal.of(test), mode="eval",
                    grad=Literal.of(g) if grad else None)
    return ctx.records[-1]
