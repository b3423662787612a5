"""A catalogue of named formula variants that real code ships, for diagnosing a failing
backend ("this backend matches ln.eps_outside_sqrt").

Each variant is a pure function with the signature of the oracle op it varies, plus,
where the variant is about precision, a keyword naming the dtype it computes or
accumulates in. Each is registered in VARIANTS with a stable id, the op, a one-line
description, where the pattern is seen in the wild, and `reference`: the oracle answer
the variant is compared against, with the same signature (usually the op itself; for a
variant whose output is in a half dtype, the oracle rounded once to that dtype).

Precision variants emulate the narrow arithmetic exactly: every operation of the
variant is rounded to the compute dtype (`rounding.round_to`, round to nearest even),
and reductions accumulate sequentially, one rounding per addition. A real kernel sums in
another order (vector lanes, trees), and where the variant cancels (one-pass variance)
its rounding noise is not reproducible; such a variant also has an `envelope`: bounds on
how far its statistics can lie from the exact ones in any summation order (rigorous for
a one-pass variance, `one_pass_statistics_error`; probabilistic for the spec's own
formula summed serially, `two_pass_statistics_error`), against which a backend's
implied statistics are judged.
"""

from __future__ import annotations

from collections import namedtuple

import ml_dtypes
import numpy as np

from ._validate import (
    as_float64,
    check_eps,
    check_momentum,
    check_param_shape,
    check_same_shape,
    ieee,
    normalized_axes,
    optional_float64,
)
from .batch_norm import (
    _affine,
    _batch_stats,
    _channel_layout,
    _params,
    batch_norm_train,
    batch_norm_train_vjp,
    train_vjp_inputs,
)
from .layer_norm import _refined_mean, layer_norm, layer_norm_vjp
from .rms_norm import RMS_NORM_DEFAULT_EPS, rms_norm, rms_norm_vjp
from .rounding import _check_dtype, round_to, unit_roundoff

#: `order_only`: the variant is the spec's own formula summed in another order (its
#: statistics differ from the oracle's by rounding alone), so where its envelope explains
#: an output, no formula variant is named for it.
Variant = namedtuple("Variant", "id op description seen_in fn reference envelope order_only",
                     defaults=(None, False))


# --- helpers --------------------------------------------------------------------------

def _rounder(dtype):
    dt = _check_dtype(dtype)

    def rnd(v):
        return round_to(v, dt).astype(np.float64)

    return rnd


def _sequential_sum(a, axes, rnd):
    """Sum over `axes` one element at a time, rounding after every addition."""
    moved = np.moveaxis(a, axes, tuple(range(a.ndim - len(axes), a.ndim)))
    flat = moved.reshape(moved.shape[:a.ndim - len(axes)] + (-1,))
    acc = np.zeros(flat.shape[:-1])
    for k in range(flat.shape[-1]):
        acc = rnd(acc + flat[..., k])
    return acc


def _keep(reduced, a, axes):
    """Put the reduced axes back as size-1 axes so `reduced` broadcasts against a."""
    for ax in sorted(axes):
        reduced = np.expand_dims(reduced, ax)
    return reduced


def _ln_args(x, normalized_shape, weight, bias, eps):
    x = as_float64("x", x)
    axes = normalized_axes(x, normalized_shape)
    weight, bias = optional_float64("weight", weight), optional_float64("bias", bias)
    check_param_shape("weight", weight, x.shape[axes[0]:])
    check_param_shape("bias", bias, x.shape[axes[0]:])
    return x, axes, weight, bias, check_eps(eps)


def _ln_affine(y, weight, bias):
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _rms_args(x, normalized_shape, weight, eps):
    x = as_float64("x", x)
    axes = normalized_axes(x, normalized_shape)
    weight = optional_float64("weight", weight)
    check_param_shape("weight", weight, x.shape[axes[0]:])
    return x, axes, weight, check_eps(eps)


def _d(x, axes):
    return int(np.prod([x.shape[a] for a in axes]))


# --- LayerNorm ------------------------------------------------------------------------

@ieee
def ln_one_pass_variance(x, normalized_shape, weight=None, bias=None, eps=1e-5, *,
                         compute_dtype=np.float32):
    """var = E[x^2] - E[x]^2 with x, both sums and the subtraction in `compute_dtype`.

    When |mean| is large against the spread, E[x^2] and E[x]^2 agree in their leading
    digits and the difference is rounding noise (even negative: NaN once eps is small).
    Not clamped. The normalization after the statistics is exact.
    """
    x, axes, weight, bias, eps = _ln_args(x, normalized_shape, weight, bias, eps)
    rnd, d = _rounder(compute_dtype), _d(x, axes)
    xc = rnd(x)
    mu = rnd(_sequential_sum(xc, axes, rnd) / d)
    msq = rnd(_sequential_sum(rnd(xc * xc), axes, rnd) / d)
    var = rnd(msq - rnd(mu * mu))
    mu, var = _keep(mu, x, axes), _keep(var, x, axes)
    return _ln_affine((x - mu) / np.sqrt(var + eps), weight, bias)


#: lambda of the probabilistic bound of the statistics' envelopes: with it, a sum of n <= 2^17
#: terms exceeds lambda sqrt(n) u sum|terms| with probability below 1e-5 (Higham and
#: Mary's model, n 2 exp(-lambda^2 / 2)).
SERIAL_LAMBDA = 7.0
#: The longest reduction that bound is claimed for.
SERIAL_MAX_N = 1 << 17


def one_pass_statistics_error(x, axes, compute_dtype=np.float32):
    """(mean bound, variance bound), per reduced slice (kept dims): how far the mean and
    the variance E[x^2] - E[x]^2 computed in `compute_dtype` (unit roundoff u) can lie from
    the exact ones in any summation order, with all but a negligible probability. With n
    values, g_k = min(k u / (1 - k u), lambda sqrt(k) u): the sum of k terms in any order
    is off by at most g_k sum |terms|, the first the worst case (Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., lemma 3.1 and section 4.2), the second
    Higham and Mary's probabilistic bound as two_pass_statistics_error takes it (for k up
    to SERIAL_MAX_N): the worst case, n u, let a LayerNorm that left 15 of its 2050
    values out of its statistics read as a one-pass variance where the mean is large
    (found by a review). Each square and each division adds one rounding, so
      |mean' - mean| <= dm = g_(n+1) E|x|   (x itself rounded to compute_dtype: one more)
      |E[x^2]' - E[x^2]| <= g_(n+2) E[x^2]
      |mean'^2' - mean^2| <= (2 |mean| + dm) dm + u (|mean| + dm)^2
    and the subtraction rounds once more (u times the result's size). A clamp at 0 only
    moves a negative result closer."""
    x = np.asarray(x, dtype=np.float64)
    u = unit_roundoff(compute_dtype)
    n = _d(x, axes)

    def g(k):
        worst = k * u / (1.0 - k * u)
        return min(worst, SERIAL_LAMBDA * np.sqrt(k) * u) if k <= SERIAL_MAX_N else worst

    mean_abs = np.mean(np.abs(x), axis=axes, keepdims=True)
    mean = np.mean(x, axis=axes, keepdims=True)
    msq = np.mean(x * x, axis=axes, keepdims=True)
    dm = g(n + 1) * mean_abs
    d_msq = g(n + 2) * msq
    d_sq = (2 * np.abs(mean) + dm) * dm + u * (np.abs(mean) + dm) ** 2
    var_size = msq + d_msq + (np.abs(mean) + dm) ** 2
    return dm, d_msq + d_sq + u * var_size


@ieee
def ln_serial_sum(x, normalized_shape, weight=None, bias=None, eps=1e-5, *,
                  compute_dtype=np.float32):
    """The spec's LayerNorm with the mean, then the mean of (x - mean)^2, each summed one
    element at a time in `compute_dtype` (a serial loop's order and precision). The
    normalization after the statistics is exact."""
    x, axes, weight, bias, eps = _ln_args(x, normalized_shape, weight, bias, eps)
    rnd, d = _rounder(compute_dtype), _d(x, axes)
    xc = rnd(x)
    mu = _keep(rnd(_sequential_sum(xc, axes, rnd) / d), x, axes)
    centred = rnd(xc - mu)
    var = _keep(rnd(_sequential_sum(rnd(centred * centred), axes, rnd) / d), x, axes)
    return _ln_affine((x - mu) / np.sqrt(var + eps), weight, bias)


def two_pass_statistics_error(x, axes, compute_dtype=np.float32):
    """(mean bound, variance bound), per reduced slice (kept dims): how far the spec's own
    statistics, the mean and then the mean of (x - mean')^2, computed in `compute_dtype`
    in some order other than a tree (a serial loop, a few lanes), lie from the exact ones
    with all but a negligible probability: Higham and Mary's probabilistic bound ("A New
    Approach to Probabilistic Rounding Error Analysis", SISC 2019), lambda sqrt(n) u where
    the worst case is n u. Not the worst case: with it, dm^2 (below) reaches any variance
    once n^2 u exceeds 1, and a real one-pass variance or a kernel that drops elements
    fitted in it (found by a review); the typical serial error does not.
      |mean' - mean| <= dm = lambda sqrt(n + 1) u E|x|
      sum (x - mean')^2 / n = var + (mean' - mean)^2 exactly, each term rounds four times
      (the difference, twice in its square, the square, its addition) and the division
      once: |var' - var| <= dm^2 + lambda sqrt(n + 5) u (var + dm^2).
    Past SERIAL_MAX_N values the probability is not claimed (and dm^2 nears a one-pass
    variance's error): no envelope there, (0, 0)."""
    x = np.asarray(x, dtype=np.float64)
    u = unit_roundoff(compute_dtype)
    n = _d(x, axes)
    mean_abs = np.mean(np.abs(x), axis=axes, keepdims=True)
    if n > SERIAL_MAX_N:
        return np.zeros_like(mean_abs), np.zeros_like(mean_abs)
    dm = SERIAL_LAMBDA * np.sqrt(n + 1) * u * mean_abs
    var = np.var(x, axis=axes, keepdims=True)
    return dm, dm * dm + SERIAL_LAMBDA * np.sqrt(n + 5) * u * (var + dm * dm)


@ieee
def ln_eps_outside_sqrt(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """y = gamma (x - mu) / (sqrt(var) + eps) + beta, biased var: eps added to the
    standard deviation instead of the variance."""
    x, axes, weight, bias, eps = _ln_args(x, normalized_shape, weight, bias, eps)
    mu = _refined_mean(x, axes)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    return _ln_affine((x - mu) / (np.sqrt(var) + eps), weight, bias)


@ieee
def ln_unbiased_std(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """y = gamma (x - mu) / (std + eps) + beta with std = sqrt(sum (x - mu)^2 / (d - 1)):
    Bessel-corrected standard deviation, eps outside the root. Needs d >= 2."""
    x, axes, weight, bias, eps = _ln_args(x, normalized_shape, weight, bias, eps)
    d = _d(x, axes)
    if d < 2:
        raise ValueError(f"the unbiased standard deviation needs d >= 2 normalized values, got {d}")
    mu = _refined_mean(x, axes)
    std = np.sqrt(((x - mu) ** 2).sum(axis=axes, keepdims=True) / (d - 1))
    return _ln_affine((x - mu) / (std + eps), weight, bias)


@ieee
def ln_unbiased_var(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """y = gamma (x - mu) / sqrt(var_u + eps) + beta with var_u = sum (x - mu)^2 / (d - 1):
    Bessel's correction, eps inside the root (what a LayerNorm written with a variance
    function whose default is the unbiased estimator computes). Needs d >= 2."""
    x, axes, weight, bias, eps = _ln_args(x, normalized_shape, weight, bias, eps)
    d = _d(x, axes)
    if d < 2:
        raise ValueError(f"the unbiased variance needs d >= 2 normalized values, got {d}")
    mu = _refined_mean(x, axes)
    var = ((x - mu) ** 2).sum(axis=axes, keepdims=True) / (d - 1)
    return _ln_affine((x - mu) / np.sqrt(var + eps), weight, bias)


@ieee
def ln_padded_lanes_in_variance(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Statistics of a kernel that pads the row to P = the next power of two with zeros
    and forgets to mask the centred values: mu = sum(x) / d is right, but each of the
    P - d padded lanes adds (0 - mu)^2 to the squared-deviation sum, still divided by d:
    var = (sum (x - mu)^2 + (P - d) mu^2) / d. Same as the oracle when d is a power of 2
    or mu = 0."""
    x, axes, weight, bias, eps = _ln_args(x, normalized_shape, weight, bias, eps)
    d = _d(x, axes)
    pad = (1 << (d - 1).bit_length()) - d
    mu = _refined_mean(x, axes)
    var = (((x - mu) ** 2).sum(axis=axes, keepdims=True) + pad * mu * mu) / d
    return _ln_affine((x - mu) / np.sqrt(var + eps), weight, bias)


@ieee
def ln_vjp_constant_statistics(x, normalized_shape, grad_output, weight=None, bias=None, eps=1e-5):
    """LayerNorm backward that treats mu and var as constants (no gradient through the
    statistics): dL/dx = gamma g / sqrt(var + eps); dgamma, dbeta as the oracle."""
    x, axes, weight, bias, eps = _ln_args(x, normalized_shape, weight, bias, eps)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    mu = _refined_mean(x, axes)
    r = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=axes, keepdims=True) + eps)
    batch_axes = tuple(range(axes[0]))
    grad_x = (g * weight if weight is not None else g) * r
    grad_weight = (g * (x - mu) * r).sum(axis=batch_axes) if weight is not None else None
    grad_bias = g.sum(axis=batch_axes) if bias is not None else None
    return grad_x, grad_weight, grad_bias


# --- RMSNorm --------------------------------------------------------------------------

@ieee
def rms_centred(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS):
    """y = gamma x / sqrt(mean((x - mu)^2) + eps): the denominator is the standard
    deviation (centred), the numerator is not centred."""
    x, axes, weight, eps = _rms_args(x, normalized_shape, weight, eps)
    mu = _refined_mean(x, axes)
    y = x / np.sqrt(((x - mu) ** 2).mean(axis=axes, keepdims=True) + eps)
    return y * weight if weight is not None else y


@ieee
def rms_one_plus_weight(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS):
    """y = (1 + w) x / sqrt(mean(x^2) + eps): the stored weight is an offset from 1."""
    x, axes, weight, eps = _rms_args(x, normalized_shape, weight, eps)
    y = x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    return y * (1.0 + weight) if weight is not None else y


@ieee
def rms_one_plus_weight_in_half(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS, *,
                                dtype=ml_dtypes.bfloat16):
    """y = round_dtype(1 + w) x / sqrt(mean(x^2) + eps): the gain 1 + w is formed in the
    half dtype, which drops bits of w once |1 + w| >= 2 (bfloat16: 15.8125 + 1 = 16.75).
    The rest is exact, so only the rounding of the gain is exercised."""
    x, axes, weight, eps = _rms_args(x, normalized_shape, weight, eps)
    y = x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    return y * _rounder(dtype)(1.0 + weight) if weight is not None else y


@ieee
def rms_half_cast_before_weight(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS, *,
                                dtype=ml_dtypes.bfloat16):
    """y = round(round(x_hat) * w): the normalized x_hat is cast to the half dtype, then
    multiplied by the (half) weight and rounded again. Two roundings; the oracle's
    answer in that dtype is the exact gamma x_hat rounded once, which is what a kernel
    that multiplies in float32 and casts at the end gets. Returns an array of `dtype`."""
    x, axes, weight, eps = _rms_args(x, normalized_shape, weight, eps)
    rnd = _rounder(dtype)
    y = rnd(x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps))
    if weight is not None:
        y = rnd(y * weight)
    return round_to(y, dtype)


@ieee
def rms_sum_of_squares_in_half(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS, *,
                               compute_dtype=np.float16):
    """mean(x^2) accumulated in `compute_dtype` (the half input dtype): x, every square
    and every partial sum rounded to it, so the sum overflows to inf above the dtype's
    maximum (float16: 65504; the output is then 0) and loses bits as it grows. The rest
    is exact."""
    x, axes, weight, eps = _rms_args(x, normalized_shape, weight, eps)
    rnd = _rounder(compute_dtype)
    xc = rnd(x)
    ms = _keep(_sequential_sum(rnd(xc * xc), axes, rnd) / _d(x, axes), x, axes)
    y = x / np.sqrt(ms + eps)
    return y * weight if weight is not None else y


@ieee
def rms_vjp_weight_twice(x, normalized_shape, grad_output, weight=None, eps=RMS_NORM_DEFAULT_EPS):
    """RMSNorm backward that applies the gain twice to the input gradient
    (h = g gamma^2 instead of g gamma); dgamma as the oracle."""
    x, axes, weight, eps = _rms_args(x, normalized_shape, weight, eps)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    r = 1.0 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    h = g * weight * weight if weight is not None else g
    grad_x = r * (h - x * r * r * (h * x).mean(axis=axes, keepdims=True))
    grad_weight = (g * x * r).sum(axis=tuple(range(axes[0]))) if weight is not None else None
    return grad_x, grad_weight


# --- BatchNorm ------------------------------------------------------------------------

def _bn_args(x, running_mean, running_var, weight, bias, momentum, eps):
    x = as_float64("x", x)
    weight, bias, running_mean, running_var = _params(x, weight, bias, running_mean, running_var)
    momentum = check_momentum(momentum)
    if momentum is None:
        raise ValueError("momentum=None (cumulative average) has no variant here; pass a number")
    return x, running_mean, running_var, weight, bias, momentum, check_eps(eps)


@ieee
def bn_biased_running_var(x, running_mean, running_var, weight=None, bias=None, momentum=0.1,
                          eps=1e-5):
    """F1 forward as the oracle, but the running variance is updated with the biased
    batch variance sum (x - mu)^2 / m instead of / (m - 1)."""
    x, rm, rv, weight, bias, a, eps = _bn_args(x, running_mean, running_var, weight, bias,
                                               momentum, eps)
    mu, sum_sq, m, _, bshape = _batch_stats(x)
    y = _affine((x - mu) / np.sqrt(sum_sq / m + eps), weight, bias, bshape)
    if rm is None:
        return y, None, None
    return y, (1 - a) * rm + a * mu.reshape(-1), (1 - a) * rv + a * sum_sq.reshape(-1) / m


@ieee
def bn_momentum_on_old(x, running_mean, running_var, weight=None, bias=None, momentum=0.1,
                       eps=1e-5):
    """run <- a run + (1 - a) batch_stat: momentum weights the old value (the Keras/Flax
    meaning), so PyTorch's 0.1 keeps only 10% of the history. Forward and the unbiased
    variance as the oracle."""
    y, _, _ = batch_norm_train(x, None, None, weight, bias, momentum, eps)
    _, rm, rv, _, _, a, _ = _bn_args(x, running_mean, running_var, weight, bias, momentum, eps)
    if rm is None:
        return y, None, None
    _, new_m, new_v = batch_norm_train(x, np.zeros_like(rm), np.zeros_like(rv), None, None, 1.0, eps)
    return y, a * rm + (1 - a) * new_m, a * rv + (1 - a) * new_v


def _bn_with_statistics(x, running_mean, running_var, weight, bias, momentum, eps,
                        compute_dtype, statistics):
    """Training BatchNorm whose batch mean and variance are `statistics(xc, axes, m,
    bshape, rnd)`, taken from x rounded to `compute_dtype` with `rnd` rounding to it; the
    normalization after them exact, the running variance that variance times
    m / (m - 1)."""
    x, rm, rv, weight, bias, a, eps = _bn_args(x, running_mean, running_var, weight, bias,
                                               momentum, eps)
    axes, m, bshape = _channel_layout(x)
    _batch_stats(x)  # B3 as the oracle
    rnd = _rounder(compute_dtype)
    mu, var = statistics(rnd(x), axes, m, bshape, rnd)
    y = _affine((x - mu.reshape(bshape)) / np.sqrt(var.reshape(bshape) + eps), weight, bias, bshape)
    if rm is None:
        return y, None, None
    return y, (1 - a) * rm + a * mu, (1 - a) * rv + a * var * m / (m - 1)


@ieee
def bn_one_pass_variance(x, running_mean, running_var, weight=None, bias=None, momentum=0.1,
                         eps=1e-5, *, compute_dtype=np.float32):
    """Batch statistics as var = max(0, E[x^2] - E[x]^2), with x, the sums and the
    subtraction in `compute_dtype` (the clamp stops negative variances but not the lost
    digits). The running variance is that variance times m / (m - 1)."""
    def one_pass(xc, axes, m, bshape, rnd):
        mu = rnd(_sequential_sum(xc, axes, rnd) / m)
        msq = rnd(_sequential_sum(rnd(xc * xc), axes, rnd) / m)
        return mu, np.maximum(0.0, rnd(msq - rnd(mu * mu)))
    return _bn_with_statistics(x, running_mean, running_var, weight, bias, momentum, eps,
                               compute_dtype, one_pass)


@ieee
def bn_serial_sum(x, running_mean, running_var, weight=None, bias=None, momentum=0.1,
                  eps=1e-5, *, compute_dtype=np.float32):
    """The spec's training BatchNorm with the batch mean, then the mean of (x - mean)^2,
    each summed one element at a time in `compute_dtype` (a serial loop's order and
    precision); the running variance is that variance times m / (m - 1)."""
    def two_pass(xc, axes, m, bshape, rnd):
        mu = rnd(_sequential_sum(xc, axes, rnd) / m)
        centred = rnd(xc - mu.reshape(bshape))
        return mu, rnd(_sequential_sum(rnd(centred * centred), axes, rnd) / m)
    return _bn_with_statistics(x, running_mean, running_var, weight, bias, momentum, eps,
                               compute_dtype, two_pass)


@ieee
def bn_vjp_constant_statistics(x, grad_output, weight=None, bias=None, eps=1e-5):
    """Training-mode BatchNorm backward that treats the batch mean and variance as
    constants (the eval-mode formula applied to a training forward):
    dL/dx = gamma g / sqrt(v_b + eps); dgamma, dbeta as the oracle."""
    x, g, weight, bias, mu, r, axes, bshape = train_vjp_inputs(x, grad_output, weight, bias,
                                                               eps)
    grad_x = (g * weight.reshape(bshape) if weight is not None else g) * r
    grad_weight = (g * (x - mu) * r).sum(axis=axes) if weight is not None else None
    grad_bias = g.sum(axis=axes) if bias is not None else None
    return grad_x, grad_weight, grad_bias


# --- references with the variants' signatures -----------------------------------------

def _ln_reference(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, compute_dtype=None):
    return layer_norm(x, normalized_shape, weight, bias, eps)


def _rms_reference(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS, *,
                   compute_dtype=None):
    return rms_norm(x, normalized_shape, weight, eps)


def _rms_one_plus_reference(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS, *,
                            dtype=None):
    """Gemma's formula done exactly: the oracle's RMSNorm with the gain 1 + w."""
    w = None if weight is None else 1.0 + as_float64("weight", weight)
    return rms_norm(x, normalized_shape, w, eps)


def _rms_rounded_once(x, normalized_shape, weight=None, eps=RMS_NORM_DEFAULT_EPS, *,
                      dtype=ml_dtypes.bfloat16):
    """The oracle rounded once to `dtype`: the best a half-precision output can be."""
    return round_to(rms_norm(x, normalized_shape, weight, eps), dtype)


def _bn_reference(x, running_mean, running_var, weight=None, bias=None, momentum=0.1, eps=1e-5,
                  *, compute_dtype=None):
    return batch_norm_train(x, running_mean, running_var, weight, bias, momentum, eps)


# --- the table ------------------------------------------------------------------------

VARIANTS = (
    Variant("ln.one_pass_variance", "layer_norm",
            "variance as E[x^2] - E[x]^2 in a narrow compute dtype; cancels for a large mean",
            "onnxruntime #28463 ([40000..40003] gives NaN) and #21935; pytorch #51102; "
            "flax.nnx.LayerNorm use_fast_variance=True (the default)",
            ln_one_pass_variance, _ln_reference, one_pass_statistics_error),
    Variant("ln.serial_sum", "layer_norm",
            "the spec's formula with serial sums (one accumulator or a few lanes), not a tree",
            "CPU loops that sum a row in one accumulator or a few SIMD lanes: up to (n - 1) u "
            "of the sum where a tree errs by (log2 n + 1) u (Higham, 'The accuracy of floating "
            "point summation', SISC 1993); below normspec's accuracy bar, not a wrong formula",
            ln_serial_sum, _ln_reference, two_pass_statistics_error, True),
    Variant("ln.eps_outside_sqrt", "layer_norm",
            "eps added to the standard deviation, (x - mu) / (sqrt(var) + eps)",
            "CNTK #3816 (eps outside the square root)",
            ln_eps_outside_sqrt, layer_norm),
    Variant("ln.unbiased_std", "layer_norm",
            "(x - mu) / (std_unbiased + eps): Bessel-corrected std, eps outside the root",
            "The Annotated Transformer (Harvard NLP): its LayerNorm uses x.std(-1), unbiased "
            "by default in PyTorch, plus eps",
            ln_unbiased_std, layer_norm),
    Variant("ln.unbiased_var", "layer_norm",
            "(x - mu) / sqrt(var_unbiased + eps): Bessel-corrected variance, eps inside the root",
            "LBANN PR #2024 (its LayerNorm and InstanceNorm used the unbiased variance); "
            "cudnn-frontend PR #432 (a LayerNorm test reference written with torch.var, whose "
            "default is unbiased)",
            ln_unbiased_var, layer_norm),
    Variant("ln.padded_lanes_in_variance", "layer_norm",
            "unmasked zero lanes (row padded to a power of two) each add mu^2 to the variance",
            "Liger-Kernel #518 (fix PR #519); triton #9838 (83% error at d = 17); unsloth PR #1867",
            ln_padded_lanes_in_variance, layer_norm),
    Variant("ln.vjp_constant_statistics", "layer_norm_vjp",
            "backward with no gradient through mu and var: dL/dx = gamma g / sqrt(var + eps)",
            "Xu et al. 2019, 'Understanding and Improving Layer Normalization' (DetachNorm "
            "detaches mean and variance on purpose); as a bug, a hand-written backward that "
            "drops the statistics terms",
            ln_vjp_constant_statistics, layer_norm_vjp),
    Variant("rms.centred", "rms_norm",
            "denominator from centred x, x / sqrt(mean((x - mu)^2) + eps)",
            "pattern: an RMSNorm built on a LayerNorm variance routine (no project named)",
            rms_centred, rms_norm),
    Variant("rms.one_plus_weight", "rms_norm",
            "gain 1 + w: the stored weight is an offset from 1",
            "Gemma (Hugging Face GemmaRMSNorm multiplies by 1 + weight); Transformer Engine's "
            "zero-centred gamma; a checkpoint loaded into the wrong convention",
            rms_one_plus_weight, rms_norm),
    Variant("rms.one_plus_weight_in_half", "rms_norm",
            "Gemma's gain 1 + w formed in bfloat16, dropping low bits of w",
            "llama.cpp PR #5810; Liger-Kernel PR #1462; vLLM PR #29810 (15.8125 + 1 rounds)",
            rms_one_plus_weight_in_half, _rms_one_plus_reference),
    Variant("rms.half_cast_before_weight", "rms_norm",
            "x_hat cast to the half dtype before the weight multiply: two roundings",
            "Hugging Face LlamaRMSNorm (weight * x_hat.to(input_dtype)) and vLLM's reference "
            "(x.to(weight.dtype) * weight), versus Gemma / Transformer Engine casting after; "
            "TransformerEngine #1132, lmdeploy PR #2842, vLLM #42325",
            rms_half_cast_before_weight, _rms_rounded_once),
    Variant("rms.sum_of_squares_in_half", "rms_norm",
            "sum of squares accumulated in the half input dtype: overflow to inf, lost bits",
            "onnxruntime #29034 (silent zeros); pytorch #66707; Liger-Kernel PR #1309; "
            "sglang PR #27540",
            rms_sum_of_squares_in_half, _rms_reference),
    Variant("rms.vjp_weight_twice", "rms_norm_vjp",
            "input gradient with the gain applied twice (g gamma^2)",
            "Megatron-LM PR #6859 (dx multiplied by the weight twice)",
            rms_vjp_weight_twice, rms_norm_vjp),
    Variant("bn.biased_running_var", "batch_norm_train",
            "running variance updated with the biased batch variance (/ m, not / (m - 1))",
            "pytorch #3122, #19902; mlx PR #3817; flax.nnx.BatchNorm stores the biased variance",
            bn_biased_running_var, batch_norm_train),
    Variant("bn.momentum_on_old", "batch_norm_train",
            "momentum weights the old running value: run <- a run + (1 - a) batch",
            "Keras and flax.nnx.BatchNorm (momentum 0.99 on the old value); fastestimator PR "
            "#1201, scvi-tools PR #2309 (conventions mixed up)",
            bn_momentum_on_old, batch_norm_train),
    Variant("bn.serial_sum", "batch_norm_train",
            "the spec's statistics with serial sums (one accumulator or a few lanes), not a tree",
            "CPU loops that sum a channel in one accumulator or a few SIMD lanes: up to "
            "(n - 1) u of the sum where a tree errs by (log2 n + 1) u (Higham, 'The accuracy "
            "of floating point summation', SISC 1993); below normspec's accuracy bar, not a "
            "wrong formula",
            bn_serial_sum, _bn_reference, two_pass_statistics_error, True),
    Variant("bn.one_pass_variance", "batch_norm_train",
            "batch variance as max(0, E[x^2] - E[x]^2) in a narrow compute dtype",
            "flax #1491 (negative variance); flax.nnx.BatchNorm use_fast_variance=True (the "
            "default) clamps at 0; equinox PR #314 clips it",
            bn_one_pass_variance, _bn_reference, one_pass_statistics_error),
    Variant("bn.vjp_constant_statistics", "batch_norm_train_vjp",
            "training backward with the batch statistics treated as constants (eval formula)",
            "pattern: the eval-mode backward used after a training-mode forward (no project named)",
            bn_vjp_constant_statistics, batch_norm_train_vjp),
)

_BY_ID = {v.id: v for v in VARIANTS}


def variant(variant_id):
    """The registered Variant with this id."""
    try:
        return _BY_ID[variant_id]
    except KeyError:
        raise KeyError(f"unknown variant id {variant_id!r}; known: {sorted(_BY_ID)}") from None


def variants_for(op):
    """Every registered variant of the oracle op named `op` (e.g. "layer_norm")."""
    return tuple(v for v in VARIANTS if v.op == op)
