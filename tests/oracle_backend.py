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
    DataParallelResult,
    FusedAddNormResult,
    Result,
)


def _r(a, dtype):
    return None if a is None else spec.round_to(a, dtype)


class OracleBackend(Backend):
    name = "oracle"
    version = "float64 oracle, rounded once"
    capabilities = Capabilities(ops=OPS, dtypes=DTYPES,
                                gradients={"layer_norm", "rms_norm", "batch_norm",
                                           "encoder_layer", "fused_add_norm"},
                                no_grad_mode=True, cumulative_momentum=True, untracked_stats=True,
                                data_parallel={"local", "sync"})
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

    def encoder_layer(self, x, params, num_heads, *, norm_first, activation, eps, num_layers=1,
                      final_norm=None, grad_output=None):
        """spec.transformer_encoder_layer for one plain layer, spec.transformer_encoder
        (num_layers copies of the layer, final LN) otherwise; input gradient only."""
        kw = {"norm_first": norm_first, "activation": activation, "eps": eps}
        stacked = num_layers > 1 or final_norm is not None
        if stacked:
            y = spec.transformer_encoder(x, [params] * num_layers, num_heads, final_norm, **kw)
        else:
            y = spec.transformer_encoder_layer(x, params, num_heads, **kw)
        if grad_output is None:
            return Result(_r(y, x.dtype))
        if stacked:
            gx = spec.transformer_encoder_vjp(x, grad_output, [params] * num_layers, num_heads,
                                              final_norm, **kw)[0]
        else:
            gx = spec.transformer_encoder_layer_vjp(x, grad_output, params, num_heads, **kw)[0]
        return Result(_r(y, x.dtype), _r(gx, x.dtype))

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        """spec.fused_add_norm(_vjp) under the declared contract (conventions)."""
        kw = {"contract": self.conventions.fused_residual_sum}
        args = (norm, normalized_shape, weight, bias, eps)
        y, res = spec.fused_add_norm(x, residual, *args, **kw)
        if grad_outputs is None:
            return FusedAddNormResult(_r(y, x.dtype), _r(res, x.dtype))
        grads = spec.fused_add_norm_vjp(x, residual, *grad_outputs, *args, **kw)
        return FusedAddNormResult(_r(y, x.dtype), _r(res, x.dtype),
                                  *(_r(g, x.dtype) for g in grads))

    def data_parallel_batch_norm(self, steps, *, sync, eps, momentum, dtype, weight, bias,
                                 grad_outputs=None):
        """spec.local_/sync_batch_norm_train(_vjp) step by step; buffers per replica."""
        world, c = len(steps[0]), weight.shape[0]
        w, b = np.asarray(weight, np.float64), np.asarray(bias, np.float64)
        rms, rvs = [np.zeros(c)] * world, [np.ones(c)] * world
        out = {f: [] for f in DataParallelResult._fields}
        for t, shards in enumerate(steps):
            xs = [np.asarray(x, np.float64) for x in shards]
            if sync:
                ys, rm, rv = spec.sync_batch_norm_train(xs, rms[0], rvs[0], w, b, momentum, eps)
                rms, rvs = [rm] * world, [rv] * world
            else:
                ys, rms, rvs = spec.local_batch_norm_train(xs, rms, rvs, w, b, momentum, eps)
            out["output"].append([_r(y, dtype) for y in ys])
            out["running_mean"].append([_r(v, dtype) for v in rms])
            out["running_var"].append([_r(v, dtype) for v in rvs])
            if grad_outputs is None:
                continue
            gs = [np.asarray(g, np.float64) for g in grad_outputs[t]]
            vjp = spec.sync_batch_norm_train_vjp if sync else spec.local_batch_norm_train_vjp
            gxs, gw, gb = vjp(xs, gs, w, b, eps, reduction="mean")
            mine = [vjp(xs, [g if q == r else 0 * g for q, g in enumerate(gs)], w, b, eps)
                    for r in range(world)]  # replica r's own gradient: its shard's part
            out["grad_input"].append([_r(g, dtype) for g in gxs])
            out["replica_grad_weight"].append([_r(m[1], dtype) for m in mine])
            out["replica_grad_bias"].append([_r(m[2], dtype) for m in mine])
            out["grad_weight"].append([_r(gw, dtype)] * world)
            out["grad_bias"].append([_r(gb, dtype)] * world)
        if grad_outputs is None:
            for f in DataParallelResult._fields[1:6]:
                out[f] = None
        return DataParallelResult(**out)

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
