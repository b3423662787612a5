"""What the op routines share: float64 views of the built inputs, the output shapes the
protocol requires, and the dL/dgamma, dL/dbeta comparison."""

from __future__ import annotations

import math
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
                        kappa, stats_count, variants=None, held=None) -> None:
    """dL/dgamma, dL/dbeta: per parameter element, sums over `sum_axes` of g x_hat and
    of g. dL/dgamma's terms carry the forward's error, so its growth covers both
    reductions: n = the terms summed times `stats_count`, the values each term's
    statistics reduce over (LayerNorm and RMSNorm: the row's d; BatchNorm: 1, its sum and
    its training statistics reducing over the same m values, whose growth per halving
    covers both), at the kappa of the statistics its
    terms were normalized by (`kappa`, broadcast like g), the worst of them: every row's
    for a LayerNorm gain, the channel's own for BatchNorm's (the largest over every
    channel let a channel's error 15 times its bound through beside a channel of mean
    1000: a review). dL/dbeta is the reduction alone: n = the terms summed, kappa 1 (no
    statistic of x enters it). `prefix` names the quantities ("layer_norm",
    "batch_norm.train"). `variants(i)`: the Alternatives of the VJP's field i (1: dgamma,
    2: dbeta), for diagnosis. `held(w_scale)`: ULPs dL/dgamma is allowed on top, at its
    scale (BatchNorm eval's reported statistics, tolerances.reported_stats_ulps)."""
    params = math.prod(s for i, s in enumerate(g64.shape) if i not in sum_axes)
    terms = g64.size // max(1, params)
    # kappa >= 1 always; no rows (an empty batch) have none, and their sums are exact 0s
    kappa = np.max(np.broadcast_to(kappa, g64.shape), axis=sum_axes, initial=1.0)
    w_scale, b_scale = param_grad_scales(g64, x_hat, sum_axes)
    if expected_w is not None:
        # the repro shows the quantity before it is compared, so a failure's shows it too
        ctx.oracle("show(result.grad_weight, expected_grads[1], name='grad_weight')")
        ctx.conforms(expected=expected_w, actual=res.grad_weight, scale=w_scale,
                     bound=bound("param_gradient", ctx.dtype, terms * stats_count, kappa)
                     + (held(w_scale) if held is not None else 0.0),
                     quantity=f"{prefix}.grad_weight", call=code,
                     variants=variants(1) if variants else None)
    if expected_b is not None:
        ctx.oracle("show(result.grad_bias, expected_grads[2], name='grad_bias')")
        ctx.conforms(expected=expected_b, actual=res.grad_bias, scale=b_scale,
                     bound=bound("bias_gradient", ctx.dtype, terms),
                     quantity=f"{prefix}.grad_bias", call=code,
                     variants=variants(2) if variants else None)
