"""LayerNorm (claim F2) and its vector-Jacobian product."""

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


def _refined_mean(x, axes):
    mu = fast_mean(x, axes, keepdims=True)
    return mu + fast_mean(x - mu, axes, keepdims=True)


@ieee
def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """F2: y = gamma * (x - mu) / sqrt(var + eps) + beta, per sample.

    mu and the *biased* var (divide by d, not d - 1) are taken over the trailing
    `normalized_shape` axes, one or more (B8: those axes, not the layer's name, decide
    what is mixed). eps sits inside the square root. Computed in float64; returns float64.
    """
    x = as_float64("x", x)
    axes = normalized_axes(x, normalized_shape)
    weight, bias = optional_float64("weight", weight), optional_float64("bias", bias)
    check_param_shape("weight", weight, x.shape[axes[0]:])
    check_param_shape("bias", bias, x.shape[axes[0]:])
    eps = check_eps(eps)
    # mu = (1/d) sum_j x_j, refined once by the mean of the residuals, so the oracle's
    # own rounding of mu is ~u * spread, not ~u * |mu|
    mu = _refined_mean(x, axes)
    # var = (1/d) sum_j (x_j - mu)^2, two-pass so the oracle itself does not cancel
    var = fast_mean((x - mu) ** 2, axes, keepdims=True)
    # x_hat = (x - mu) / sqrt(var + eps)
    y = (x - mu) / np.sqrt(var + eps)
    # y = gamma * x_hat + beta
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


@ieee
def layer_norm_vjp(x, normalized_shape, grad_output, weight=None, bias=None, eps=1e-5):
    """Closed-form gradients of F2 for an upstream gradient g = dL/dy.

    With x_hat = (x - mu) * r, r = 1/sqrt(var + eps) and h = g * gamma:
    dL/dx = r * (h - mean(h) - x_hat * mean(h * x_hat)) over the normalized axes,
    dL/dgamma = sum over the other axes of g * x_hat, dL/dbeta = sum of g.
    Returns (grad_x, grad_weight, grad_bias); a gradient is None where its parameter is.
    """
    x = as_float64("x", x)
    axes = normalized_axes(x, normalized_shape)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    weight = optional_float64("weight", weight)
    check_param_shape("weight", weight, x.shape[axes[0]:])
    check_param_shape("bias", optional_float64("bias", bias), x.shape[axes[0]:])
    eps = check_eps(eps)
    batch_axes = tuple(range(axes[0]))
    mu = _refined_mean(x, axes)
    r = 1.0 / np.sqrt(fast_mean((x - mu) ** 2, axes, keepdims=True) + eps)
    x_hat = (x - mu) * r
    h = g * weight if weight is not None else g
    grad_x = r * (h - fast_mean(h, axes, keepdims=True)
                  - x_hat * fast_mean(h * x_hat, axes, keepdims=True))
    grad_weight = sum_over(g * x_hat, batch_axes) if weight is not None else None
    grad_bias = sum_over(g, batch_axes) if bias is not None else None
    return grad_x, grad_weight, grad_bias
