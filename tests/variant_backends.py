"""One broken backend per named formula variant (spec/variants.py): the numpy backend
with one op's formula replaced by the variant's, evaluated in float64 on the backend's
inputs and rounded once to the dtype (a precision variant does its narrow arithmetic
itself). test_diagnosis.py shows the diagnosis names each one."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np
from normspec.impls.numpy_ref import NumpyBackend
from normspec.impls.protocol import Result
from normspec.spec.variants import variant
from oracle_backend import OracleBatchNorm


def _r(a, dtype):
    return None if a is None else spec.round_to(np.asarray(a, dtype=np.float64), dtype)


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


class _VariantBatchNorm(OracleBatchNorm):
    """The oracle's layer, with the training forward (or its VJP) replaced by the variant."""

    def __init__(self, v, kwargs, *args):
        super().__init__(*args)
        self.v, self.kwargs = v, kwargs

    def forward(self, x, grad_output=None):
        if self.v.op == "batch_norm_train" and self.training:
            y, new_rm, new_rv = self.v.fn(_f64(x), self.rm, self.rv, self.w, self.b,
                                          self.momentum, self.eps, **self.kwargs)
            if self.rm is not None:
                self.rm, self.rv, self.t = new_rm, new_rv, self.t + 1
            return Result(_r(y, x.dtype))
        res = super().forward(x, grad_output)
        if self.v.op == "batch_norm_train_vjp" and self.training and grad_output is not None:
            grads = self.v.fn(_f64(x), _f64(grad_output), self.w, self.b, self.eps, **self.kwargs)
            res = Result(res.output, *(_r(g, x.dtype) for g in grads))
        return res


def variant_backend(variant_id: str, **kwargs):
    """The numpy backend with `variant_id`'s formula in place of its op's; `kwargs` set a
    precision variant's dtype keyword."""
    v = variant(variant_id)

    class Variant(NumpyBackend):
        name = f"variant:{variant_id}"

        def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
            res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
            args = (_f64(x), tuple(normalized_shape))
            if v.op == "layer_norm":
                res = res._replace(output=_r(v.fn(*args, _f64(weight), _f64(bias), eps, **kwargs),
                                             x.dtype))
            elif v.op == "layer_norm_vjp" and grad_output is not None:
                gx, gw, gb = v.fn(*args, _f64(grad_output), _f64(weight), _f64(bias), eps, **kwargs)
                res = res._replace(grad_input=_r(gx, x.dtype), grad_weight=_r(gw, x.dtype),
                                   grad_bias=_r(gb, x.dtype))
            return res

        def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
            res = super().rms_norm(x, normalized_shape, weight, eps, grad_output)
            args = (_f64(x), tuple(normalized_shape))
            if v.op == "rms_norm":
                res = res._replace(output=_r(v.fn(*args, _f64(weight), eps, **kwargs), x.dtype))
            elif v.op == "rms_norm_vjp" and grad_output is not None:
                gx, gw = v.fn(*args, _f64(grad_output), _f64(weight), eps, **kwargs)
                res = res._replace(grad_input=_r(gx, x.dtype), grad_weight=_r(gw, x.dtype))
            return res

        def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                       weight=None, bias=None):
            return _VariantBatchNorm(v, kwargs, num_features, eps, momentum, affine,
                                     track_running_stats, np.dtype(dtype), weight, bias)

    Variant.__name__ = Variant.__qualname__ = "Variant_" + variant_id.replace(".", "_")
    return Variant


class RandomError(NumpyBackend):
    """Every output off by a seeded random relative error of about 1%: no formula variant
    explains it."""

    name = "RandomError"

    def _noisy(self, a):
        rng = np.random.default_rng(1)
        return _r(a.astype(np.float64) * (1 + 0.01 * rng.standard_normal(a.shape)), a.dtype)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        return res._replace(output=self._noisy(res.output))

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        res = super().rms_norm(x, normalized_shape, weight, eps, grad_output)
        return res._replace(output=self._noisy(res.output))


class _StatisticsLayerNorm(NumpyBackend):
    """The numpy backend's LayerNorm with the row statistics taken from `_stats`, the
    normalization done exactly in float64 and rounded once."""

    def _stats(self, x, axes):
        raise NotImplementedError

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        res = super().layer_norm(x, normalized_shape, weight, bias, eps, grad_output)
        axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
        mean, var = self._stats(x, axes)
        y = (_f64(x) - mean) / np.sqrt(var + eps)
        y = y * (1.0 if weight is None else _f64(weight)) + (0.0 if bias is None else _f64(bias))
        return res._replace(output=_r(y, x.dtype))


class ReorderedOnePass(_StatisticsLayerNorm):
    """var = max(0, E[x^2] - E[x]^2) in float32 with NumPy's own (pairwise, unrolled)
    sums: the one-pass variance in a summation order the catalogue's sequential
    emulation does not reproduce, as XLA's vectorized reductions do (Flax's
    use_fast_variance)."""

    name = "ReorderedOnePass"

    def _stats(self, x, axes):
        x32 = x.astype(np.float32)
        mean = np.mean(x32, axis=axes, keepdims=True, dtype=np.float32)
        msq = np.mean(x32 * x32, axis=axes, keepdims=True, dtype=np.float32)
        return mean.astype(np.float64), np.maximum(np.float32(0), msq - mean * mean).astype(np.float64)


class RowScaleError(_StatisticsLayerNorm):
    """Every row's variance `factor` times too large: a per-row error beyond any
    rounding of a one-pass variance (on centred data, 0.1% is; at mean 300 and spread 1,
    where float32's E[x^2] - E[x]^2 in some summation order can be off by up to 4.2
    times the variance itself, a factor 8), so it must stay unexplained."""

    name = "RowScaleError"

    def __init__(self, factor=1.001):
        super().__init__()
        self.factor = factor

    def _stats(self, x, axes):
        x64 = _f64(x)
        return x64.mean(axis=axes, keepdims=True), self.factor * x64.var(axis=axes, keepdims=True)
