"""RMSNorm (claim F3) and its vector-Jacobian product."""

from __future__ import annotations

import numpy as np

from ._reductions import fast_mean
from ._sums import sum_over
from ._validate import (
    as_float64,
    check_eps,
    check_param_shape,
    check_same_shape,
    ieee,
    normalized_axes,
    optional_float64,
)

#: The oracle's RMSNorm default. torch.nn.RMSNorm defaults to finfo(dtype).eps and
#: Flax to 1e-6; a dtype-independent value keeps the oracle's answer a function of the
#: numbers alone. Checks always pass eps explicitly, so no backend relies on a default.
RMS_NORM_DEFAULT_EPS = 1e-6


@ieee
def rms_norm(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS):
    """F3: y = gamma * x / sqrt(mean(x^2) + eps) over the trailing `normalized_shape` axes.

    No mean is subtracted and there is no beta: the denominator is the raw second
    moment, not the variance, so this is not "LayerNorm with mean 0" (E2, B1).
    """
    x = as_float64("x", x)
    axes = normalized_axes(x, normalized_shape)
    weight = optional_float64("weight", weight)
    check_param_shape("weight", weight, x.shape[axes[0]:])
    eps = check_eps(eps)
    # ms = (1/d) sum_k x_k^2
    ms = fast_mean(x * x, axes, keepdims=True)
    # y = x / sqrt(ms + eps)
    y = x / np.sqrt(ms + eps)
    # y = gamma * y
    if weight is not None:
        y = y * weight
    return y


@ieee
def rms_norm_vjp(x, normalized_shape, grad_output, weight=None, eps=RMS_NORM_DEFAULT_EPS):
    """Closed-form gradients of F3 for an upstream gradient g = dL/dy.

    With r = 1/sqrt(mean(x^2) + eps) and h = g * gamma:
    dL/dx = r * (h - x * r^2 * mean(h * x)), dL/dgamma = sum over other axes of g * x * r.
    Returns (grad_x, grad_weight).
    """
    x = as_float64("x", x)
    axes = normalized_axes(x, normalized_shape)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    weight = optional_float64("weight", weight)
    check_param_shape("weight", weight, x.shape[axes[0]:])
    eps = check_eps(eps)
    r = 1.0 / np.sqrt(fast_mean(x * x, axes, keepdims=True) + eps)
    h = g * weight if weight is not None else g
    grad_x = r * (h - x * r * r * fast_mean(h * x, axes, keepdims=True))
    grad_weight = sum_over(g * x * r, tuple(range(axes[0]))) if weight is not None else None
    return grad_x, grad_weight
