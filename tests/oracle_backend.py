"""A backend that *is* the oracle: float64 formulas, rounded once to the dtype. It is the
best answer a backend can give, so every check must pass on it. It lives in the tests
(a product backend must never consult the oracle: it would be checking itself)."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np
from normspec.impls.protocol import (
    DTYPES,
    OPS,
    Backend,
    BatchNormLayer,
    Capabilities,
    Conventions,
    Result,
)


def _r(a, dtype):
    return None if a is None else spec.round_to(a, dtype)


class OracleBackend(Backend):
    name = "oracle"
    version = "float64 oracle, rounded once"
    capabilities = Capabilities(ops=OPS, dtypes=DTYPES,
                                gradients={"layer_norm", "rms_norm", "batch_norm"},
                                no_grad_mode=True, cumulative_momentum=True, untracked_stats=True)
    conventions = Conventions(default_eps={"layer_norm": 1e-5, "rms_norm": 1e-6,
                                           "batch_norm": 1e-5})

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        y = spec.layer_norm(x, normalized_shape, weight, bias, eps)
        if grad_output is None:
            return Result(_r(y, x.dtype))
        grads = spec.layer_norm_vjp(x, normalized_shape, grad_output, weight, bias, eps)
        return Result(_r(y, x.dtype), *(_r(g, x.dtype) for g in grads))

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        y = spec.rms_norm(x, normalized_shape, weight, eps)
        if grad_output is None:
            return Result(_r(y, x.dtype))
        gx, gw = spec.rms_norm_vjp(x, normalized_shape, grad_output, weight, eps)
        return Result(_r(y, x.dtype), _r(gx, x.dtype), _r(gw, x.dtype))

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        return _r(spec.qk_norm_scores(q, k, q_weight, k_weight, eps, scale), q.dtype)

    def softcap(self, scores, cap):
        return _r(spec.softcap(scores, cap), scores.dtype)

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return OracleBatchNorm(num_features, eps, momentum, affine, track_running_stats,
                               np.dtype(dtype), weight, bias)


class OracleBatchNorm(BatchNormLayer):
    def __init__(self, c, eps, momentum, affine, track, dtype, weight, bias):
        self.eps, self.momentum, self.dtype = eps, momentum, dtype
        self.w = (np.ones(c) if weight is None else np.asarray(weight, np.float64)) if affine else None
        self.b = (np.zeros(c) if bias is None else np.asarray(bias, np.float64)) if affine else None
        self.rm = np.zeros(c) if track else None
        self.rv = np.ones(c) if track else None
        self.t = 0
        self.training = True

    @property
    def running_mean(self):
        return _r(self.rm, self.dtype)

    @property
    def running_var(self):
        return _r(self.rv, self.dtype)

    @property
    def num_batches_tracked(self):
        return None if self.rm is None else self.t

    def forward(self, x, grad_output=None):
        if self.training:
            y, rm, rv = spec.batch_norm_train(x, self.rm, self.rv, self.w, self.b, self.momentum,
                                              self.eps, num_batches_tracked=self.t)
            if rm is not None:
                self.rm, self.rv, self.t = rm, rv, self.t + 1
        else:
            y = spec.batch_norm_eval(x, self.rm, self.rv, self.w, self.b, self.eps)
        if grad_output is None:
            return Result(_r(y, x.dtype))
        if self.training:
            grads = spec.batch_norm_train_vjp(x, grad_output, self.w, self.b, self.eps)
        else:
            grads = spec.batch_norm_eval_vjp(x, grad_output, self.rm, self.rv, self.w, self.b,
                                             self.eps)
        return Result(_r(y, x.dtype), *(_r(g, x.dtype) for g in grads))

    def forward_no_grad(self, x):
        return self.forward(x).output


def make_backend():
    return OracleBackend()
