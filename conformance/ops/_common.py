"""What the op routines share: float64 views of the built inputs, the output shapes the
protocol requires, and the dL/dgamma, dL/dbeta comparison."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..tolerances import bound, param_grad_scales


class Judged(NamedTuple):
    """An op's output as it was compared: what the backend returned, the oracle's
    value, the scale and the bound's n and kappa it was judged at (for the checks that
    go on to ask more of it: checks/rounding.py)."""

    got: np.ndarray
    expected: np.ndarray
    scale: np.ndarray
    n: int
    kappa: np.ndarray | float


def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def outputs_like(x, *, grads: bool, param_shape=None, weight=False, bias=False) -> dict:
    """The (shape, dtype) of each Result field the call must return."""
    out = {"output": (x.shape, x.dtype)}
    if grads:
        out["grad_input"] = (x.shape, x.dtype)
        if weight:
            out["grad_weight"] = (param_shape, x.dtype)
        if bias:
            out["grad_bias"] = (param_shape, x.dtype)
    return out


def compare_param_grads(ctx, code, prefix, g64, x_hat, sum_axes, expected_w, expected_b, res,
                        kappa, variants=None, held=None) -> None:
    """dL/dgamma, dL/dbeta: sums over `sum_axes` of g x_hat (whose terms carry the
    forward's error, so its growth covers both reductions) and of g (the reduction
    alone, at kappa 1: no statistic of x enters it); n = every element of g. `prefix`
    names the quantities ("layer_norm", "batch_norm.train"). `variants(i)`: the
    Alternatives of the VJP's field i (1: dgamma, 2: dbeta), for diagnosis.
    `held(w_scale)`: ULPs dL/dgamma is allowed on top, at its scale (BatchNorm eval's
    reported statistics, tolerances.reported_stats_ulps)."""
    n = g64.size
    # kappa >= 1 always; no rows (an empty batch) have none, and their sums are exact 0s
    kappa = np.max(kappa, initial=1.0)
    w_scale, b_scale = param_grad_scales(g64, x_hat, sum_axes)
    if expected_w is not None:
        # the repro shows the quantity before it is compared, so a failure's shows it too
        ctx.oracle("show(result.grad_weight, expected_grads[1], name='grad_weight')")
        ctx.conforms(expected=expected_w, actual=res.grad_weight, scale=w_scale,
                     bound=bound("param_gradient", ctx.dtype, n, kappa)
                     + (held(w_scale) if held is not None else 0.0),
                     quantity=f"{prefix}.grad_weight", call=code,
                     variants=variants(1) if variants else None)
    if expected_b is not None:
        ctx.oracle("show(result.grad_bias, expected_grads[2], name='grad_bias')")
        ctx.conforms(expected=expected_b, actual=res.grad_bias, scale=b_scale,
                     bound=bound("bias_gradient", ctx.dtype, n),
                     quantity=f"{prefix}.grad_bias", call=code,
                     variants=variants(2) if variants else None)
