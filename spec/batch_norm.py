"""BatchNorm: training forward (F1) with the running-statistics update (F4), eval (F5),
and the vector-Jacobian products of both forwards. Pure: running statistics go in as
arguments and the new ones come out as return values."""

from __future__ import annotations

import numpy as np

from ._sums import mean_over, sum_over
from ._validate import (
    as_float64,
    check_eps,
    check_momentum,
    check_param_shape,
    check_same_shape,
    ieee,
    optional_float64,
)


class SingleValuePerChannelError(ValueError):
    """B3: training statistics need more than one value per channel."""


def _channel_layout(x: np.ndarray):
    """Channel axis 1; statistics over every other axis ([N,C], [N,C,L], [N,C,H,W])."""
    if x.ndim < 2:
        raise ValueError(f"batch norm needs x of shape [N, C, ...], got shape {tuple(x.shape)}")
    reduce_axes = (0,) + tuple(range(2, x.ndim))
    m = x.size // x.shape[1]
    bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    return reduce_axes, m, bshape


def _batch_stats(x: np.ndarray):
    reduce_axes, m, bshape = _channel_layout(x)
    if m <= 1:
        raise SingleValuePerChannelError(
            f"expected more than 1 value per channel in training, got input of shape "
            f"{tuple(x.shape)} (m = {m} value per channel; B3)"
        )
    # mu_j = (1/m) sum x_ij, refined once by the residuals' mean (see layer_norm);
    # sum_sq_j = sum (x_ij - mu_j)^2
    mu = mean_over(x, reduce_axes, keepdims=True)
    mu = mu + mean_over(x - mu, reduce_axes, keepdims=True)
    sum_sq = sum_over((x - mu) ** 2, reduce_axes, keepdims=True)
    return mu, sum_sq, m, reduce_axes, bshape


def _affine(y, weight, bias, bshape):
    if weight is not None:
        y = y * weight.reshape(bshape)
    if bias is not None:
        y = y + bias.reshape(bshape)
    return y


def _params(x, weight, bias, running_mean, running_var):
    _channel_layout(x)
    c = (x.shape[1],)
    out = []
    for name, p in (("weight", weight), ("bias", bias),
                    ("running_mean", running_mean), ("running_var", running_var)):
        p = optional_float64(name, p)
        check_param_shape(name, p, c)
        out.append(p)
    if (out[2] is None) != (out[3] is None):
        raise ValueError("running_mean and running_var must both be arrays or both be None")
    return out


@ieee
def batch_norm_train(x, running_mean, running_var, weight=None, bias=None,
                     momentum=0.1, eps=1e-5, *, num_batches_tracked=0):
    """F1 + F4: training-mode forward; returns (y, new_running_mean, new_running_var).

    y = gamma (x - mu) / sqrt(v_b + eps) + beta with v_b = sum (x - mu)^2 / m, biased;
    m is the number of values per channel (N times every axis after the channel axis).
    The running variance is updated with the *unbiased* v_u = sum (x - mu)^2 / (m - 1):
    run <- (1 - a) run + a * batch_stat, for mean and variance alike (a weights the new
    batch: PyTorch's meaning, not an optimizer's momentum).

    momentum=None means a cumulative average (PyTorch's meaning): a = 1 / (t + 1) where
    t = `num_batches_tracked` is the number of training forwards already folded in.
    running_mean = running_var = None is track_running_stats=False: nothing is updated and
    (None, None) is returned. A channel with a single value raises (B3).
    """
    x = as_float64("x", x)
    weight, bias, running_mean, running_var = _params(x, weight, bias, running_mean, running_var)
    momentum = check_momentum(momentum)
    eps = check_eps(eps)
    mu, sum_sq, m, _, bshape = _batch_stats(x)
    # v_b = sum (x - mu)^2 / m   (biased: what the forward divides by)
    v_b = sum_sq / m
    # y = gamma (x - mu) / sqrt(v_b + eps) + beta
    y = _affine((x - mu) / np.sqrt(v_b + eps), weight, bias, bshape)
    if running_mean is None:
        return y, None, None
    # v_u = sum (x - mu)^2 / (m - 1)   (unbiased: what the running estimate stores)
    v_u = sum_sq.reshape(-1) / (m - 1)
    a = 1.0 / (num_batches_tracked + 1) if momentum is None else momentum
    # run <- (1 - a) run + a batch_stat
    new_mean = (1.0 - a) * running_mean + a * mu.reshape(-1)
    new_var = (1.0 - a) * running_var + a * v_u
    return y, new_mean, new_var


@ieee
def batch_norm_eval(x, running_mean, running_var, weight=None, bias=None, eps=1e-5):
    """F5: eval-mode forward, y = gamma (x - running_mean) / sqrt(running_var + eps) + beta.

    With running_mean = running_var = None (track_running_stats=False) eval uses the
    current batch's statistics, biased variance, exactly as training does (F1).
    """
    x = as_float64("x", x)
    weight, bias, running_mean, running_var = _params(x, weight, bias, running_mean, running_var)
    eps = check_eps(eps)
    _, _, bshape = _channel_layout(x)
    if running_mean is None:
        y, _, _ = batch_norm_train(x, None, None, weight, bias, eps=eps)
        return y
    mean, var = running_mean.reshape(bshape), running_var.reshape(bshape)
    return _affine((x - mean) / np.sqrt(var + eps), weight, bias, bshape)


@ieee
def train_vjp_inputs(x, grad_output, weight, bias, eps):
    """The validated inputs of a training-mode BatchNorm VJP and the batch statistics it
    needs: (x, g, weight, bias, mu, r = 1/sqrt(v_b + eps), axes, bshape), float64."""
    x = as_float64("x", x)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    weight, bias, _, _ = _params(x, weight, bias, None, None)
    eps = check_eps(eps)
    mu, sum_sq, m, axes, bshape = _batch_stats(x)
    return x, g, weight, bias, mu, 1.0 / np.sqrt(sum_sq / m + eps), axes, bshape


def batch_norm_train_vjp(x, grad_output, weight=None, bias=None, eps=1e-5):
    """Closed-form gradients of the F1 training forward (batch statistics depend on x).

    With x_hat = (x - mu) r, r = 1/sqrt(v_b + eps), h = g gamma and means over the
    per-channel reduction axes: dL/dx = r (h - mean(h) - x_hat mean(h x_hat)),
    dL/dgamma = sum g x_hat, dL/dbeta = sum g. Returns (grad_x, grad_weight, grad_bias).
    """
    x, g, weight, bias, mu, r, axes, bshape = train_vjp_inputs(x, grad_output, weight, bias,
                                                               eps)
    x_hat = (x - mu) * r
    h = g * weight.reshape(bshape) if weight is not None else g
    grad_x = r * (h - mean_over(h, axes, keepdims=True)
                  - x_hat * mean_over(h * x_hat, axes, keepdims=True))
    grad_weight = sum_over(g * x_hat, axes) if weight is not None else None
    grad_bias = sum_over(g, axes) if bias is not None else None
    return grad_x, grad_weight, grad_bias


@ieee
def batch_norm_eval_vjp(x, grad_output, running_mean, running_var, weight=None, bias=None,
                        eps=1e-5):
    """Closed-form gradients of the F5 eval forward. Returns (grad_x, grad_weight, grad_bias).

    With running statistics the mean and variance are constants, not functions of x, so
    the VJP has no reduction over the batch in dL/dx: with r = 1/sqrt(running_var + eps)
    and x_hat = (x - running_mean) r, dL/dx = gamma g r, dL/dgamma = sum g x_hat,
    dL/dbeta = sum g (sums over the batch and spatial axes).

    With running_mean = running_var = None (track_running_stats=False) eval normalizes
    with the batch's statistics (see batch_norm_eval), so its gradient is the training
    one, batch_norm_train_vjp.
    """
    x = as_float64("x", x)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    weight, bias, running_mean, running_var = _params(x, weight, bias, running_mean, running_var)
    eps = check_eps(eps)
    if running_mean is None:
        return batch_norm_train_vjp(x, g, weight, bias, eps)
    axes, _, bshape = _channel_layout(x)
    # r = 1 / sqrt(running_var + eps);  x_hat = (x - running_mean) r
    r = 1.0 / np.sqrt(running_var.reshape(bshape) + eps)
    x_hat = (x - running_mean.reshape(bshape)) * r
    # dL/dx = gamma g r: y is affine in x once the statistics are fixed
    h = g * weight.reshape(bshape) if weight is not None else g
    grad_x = h * r
    grad_weight = sum_over(g * x_hat, axes) if weight is not None else None
    grad_bias = sum_over(g, axes) if bias is not None else None
    return grad_x, grad_weight, grad_bias
