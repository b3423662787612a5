"""The numba BatchNorm's per-channel sums are pairwise over pieces (_numba_bn): a channel
of millions of values stays within the tolerance table's bounds, where sums in row order
(the kernels before) did not: at [131072, 1, 32] float64, dL/dbeta erred by 256 ULPs
against a bound of 236 and running_mean by 65 against 47. And inputs whose backward terms
are beyond float32, or whose sum g is beyond float64, give what the spec gives."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from normspec import spec  # noqa: E402
from normspec.conformance.assertions import error_ulps  # noqa: E402
from normspec.conformance.tolerances import (  # noqa: E402
    batch_moments,
    bound,
    centred_output_scale,
    centring_kappa,
    grad_input_scale,
    param_grad_scales,
    running_stat_scales,
)
from normspec.impls import numba_kernels  # noqa: E402
from normspec.impls._numba_bn import PIECE, SHORT_CHANNEL, pairwise  # noqa: E402

EPS, MOMENTUM = 1e-5, 0.1


def _pairwise_reference(values):
    """The documented order: neighbours added, then neighbours of those sums, ..."""
    level = list(values)
    while len(level) > 1:
        level = [level[k] + level[k + 1] for k in range(0, len(level) - 1, 2)] + (
            [level[-1]] if len(level) % 2 else [])
    return level[0] if level else 0.0


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 13, 64, 1000])
def test_pairwise_adds_in_the_documented_order(n):
    # values over many decades, so that another order rounds differently
    rng = np.random.default_rng(n)
    values = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 9, n)
    expected = _pairwise_reference(values)
    assert pairwise(values.copy(), n) == expected, (n, pairwise(values.copy(), n), expected)


def _worst(shape, dtype="float64"):
    """{quantity: (worst ULP error, its bound)} of a training forward+backward."""
    c = shape[1]
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, shape).astype(dtype)
    g = rng.normal(0.5, 1.0, shape).astype(dtype)
    w, b = rng.normal(1.0, 0.3, c).astype(dtype), rng.normal(0.0, 0.3, c).astype(dtype)
    layer = numba_kernels.make_backend().batch_norm(
        c, eps=EPS, momentum=MOMENTUM, affine=True, track_running_stats=True, dtype=dtype,
        weight=w, bias=b)
    got = layer.forward(x, g)
    x64, g64, w64, b64 = (a.astype(np.float64) for a in (x, g, w, b))
    axes, bshape, m = (0, *range(2, x.ndim)), (1, c) + (1,) * (x.ndim - 2), x.size // c
    y, rm, rv = spec.batch_norm_train(x64, np.zeros(c), np.ones(c), w64, b64, MOMENTUM, EPS)
    gx, gw, gb = spec.batch_norm_train_vjp(x64, g64, w64, b64, EPS)
    mean = x64.mean(axis=axes, keepdims=True)  # for the scales only
    r = 1.0 / np.sqrt(x64.var(axis=axes, keepdims=True) + EPS)
    x_hat = (x64 - mean) * r
    kappa = np.max(centring_kappa(x64, axes, EPS))
    w_scale, b_scale = param_grad_scales(g64, x_hat, axes)
    rm_scale, rv_scale = running_stat_scales(np.zeros(c), np.ones(c),
                                             batch_moments(x64, axes, EPS), MOMENTUM)
    measured = {
        "output": (y, got.output, centred_output_scale(x_hat, w64.reshape(bshape),
                                                       b64.reshape(bshape), axes),
                   bound("output", dtype, m, kappa)),
        "grad_input": (gx, got.grad_input,
                       grad_input_scale(r, np.abs(g64 * w64.reshape(bshape)), x_hat, axes,
                                        centre=True), bound("gradient", dtype, m, kappa)),
        "grad_weight": (gw, got.grad_weight, w_scale,
                        bound("param_gradient", dtype, x.size, kappa)),
        # (the harness's training bound for dL/dbeta carries kappa too)
        "grad_bias": (gb, got.grad_bias, b_scale, bound("param_gradient", dtype, x.size, kappa)),
        "running_mean": (rm, layer.running_mean, rm_scale, bound("running_stat", dtype, m)),
        "running_var": (rv, layer.running_var, rv_scale, bound("running_stat", dtype, m)),
    }
    return {name: (float(np.max(error_ulps(expected=e, actual=np.asarray(a), dtype=dtype,
                                           scale=s))), float(np.max(bd)))
            for name, (e, a, s, bd) in measured.items()}


@pytest.mark.parametrize("shape", [
    (131072, 1, 32),      # rows of 32: PIECE // 32 rows share a piece's lanes
    (3, 2, 3 * PIECE + 7),  # rows longer than a piece, cut into pieces
    (50000, 2, 3),        # rows shorter than SHORT_ROWS: one row per channel
])
def test_long_channels_stay_within_the_bounds(shape):
    worst = _worst(shape)
    over = {name: f"{err:.3g} ULPs, bound {bd:.3g}" for name, (err, bd) in worst.items()
            if not err <= bd}
    assert not over, f"numba BatchNorm {list(shape)} float64: got {over}, but the spec says " \
                     f"within the tolerance table's bounds"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(1, 3, SHORT_CHANNEL), (2, 5, 1), (3, 4, 5), (5, 2, 3)])
def test_short_channels_sum_their_terms_pairwise(shape, dtype):
    """A channel of at most SHORT_CHANNEL values (the kernels' layout [n, C, length])
    sums its terms in the documented order, the lanes skipped: mean = pairwise(x) / m,
    the sum of squared deviations pairwise((x - mean)^2), and the backward's four sums
    pairwise over their terms, each term computed as the lanes compute it."""
    kernels = numba_kernels.make_backend().k
    n, c, length = shape
    m = n * length
    assert m <= SHORT_CHANNEL
    rng = np.random.default_rng(m)
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 7, shape)).astype(dtype)
    g = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 7, shape)).astype(dtype)
    w = np.array([1.0, 0.75, -2.5, 3.0, 0.1][:c])
    mean, sumsq, sums = np.empty(c), np.empty(c), np.empty((4, c))
    kernels["bn_stats"](x, mean, sumsq)
    var = sumsq / m
    kernels["bn_grad_sums"](x, g, w, mean, var, EPS, np.ones(PIECE), sums)
    for ch in range(c):
        xc, gc = (a[:, ch, :].ravel().astype(np.float64) for a in (x, g))  # terms in float64
        mu = _pairwise_reference(xc) / m
        x_hat = (xc - mean[ch]) * (1.0 / np.sqrt(var[ch] + EPS))
        h = gc * w[ch]
        expected = {"mean": mu, "sum of squares": _pairwise_reference((xc - mu) ** 2),
                    "sum g": _pairwise_reference(gc), "sum g x_hat": _pairwise_reference(gc * x_hat),
                    "sum h": _pairwise_reference(h), "sum h x_hat": _pairwise_reference(h * x_hat)}
        got = dict(zip(expected, (mean[ch], sumsq[ch], *sums[:, ch]), strict=True))
        differ = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
        assert not differ, f"{list(shape)} channel {ch}: (got, documented order) {differ}"


def _extreme_x_and_g(case):
    """[64, 1, 32] float32 rows whose backward terms are beyond float32 in one way each."""
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 1.0, (64, 1, 32)).astype(np.float32)
    g = rng.normal(0.0, 1.0, (64, 1, 32)).astype(np.float32)
    xf, gf = x.reshape(-1), g.reshape(-1)
    if case == "g x_hat beyond float32":
        z = (xf - xf.mean()) / xf.std()
        gf[np.argmax(z)] = gf[np.argmin(z)] = 2e38
        gf[np.argsort(np.abs(z))[:2]] = -2e38
    else:  # "x - mean beyond float32"
        xf[0], xf[1:5] = 3.4e38, -3.4e38
    return x, g


@pytest.mark.parametrize(("case", "dtype"), [
    ("g x_hat beyond float32", "float32"), ("g x_hat beyond float32", "bfloat16"),
    # (bfloat16 cannot hold 3.4e38, and x - mean of its largest, 3.39e38, fits float32)
    ("x - mean beyond float32", "float32")])
def test_terms_beyond_float32_are_summed_in_float64(case, dtype):
    """The spec's sums of these are finite (a float32 term g x_hat or x - mean would be
    inf): the kernels compute the terms in float64, as a float32 kernel must not let an
    intermediate overflow where the result is representable. Found by a review: dL/dgamma
    NaN or inf and dL/dx NaN or inf across the channel."""
    from normspec.impls.protocol import np_dtype

    x, g = (a.astype(np_dtype(dtype)) for a in _extreme_x_and_g(case))
    layer = numba_kernels.make_backend().batch_norm(
        1, eps=EPS, momentum=MOMENTUM, affine=True, track_running_stats=True, dtype=dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        got = layer.forward(x, g)
    expected = spec.batch_norm_train_vjp(x.astype(np.float64), g.astype(np.float64),
                                         np.ones(1), np.zeros(1), EPS)
    for name, e in zip(("grad_input", "grad_weight", "grad_bias"), expected, strict=True):
        value = np.asarray(getattr(got, name)).astype(np.float64)
        finite = np.isfinite(e) & (np.abs(e) < float(np.finfo(np.float32).max))
        assert np.isfinite(value[finite]).all(), (
            f"got {name} {value[finite & ~np.isfinite(value)][:3]}, but the spec says "
            f"{e[finite & ~np.isfinite(value)][:3]} [{dtype} batch_norm, {case}]")


@pytest.mark.parametrize(("gamma", "big"), [(0.0, (1e308, 1e308)), (1e-3, (1e308, 1e308)),
                                           (10.0, (1e308, -1e308))])
def test_sum_g_gamma_is_summed_term_by_term(gamma, big):
    """float64 g with two entries of 1e308: sum g overflows where sum g gamma does not
    (gamma 1e-3; gamma 0: every term 0), or, with opposite signs at equal x, sum g is
    finite where the terms g gamma overflow (gamma 10: the spec's mean(h) is inf - inf,
    NaN, and so is every dL/dx of the channel). mean(g gamma) must be the mean of the
    terms, as the spec takes it, not gamma sum g."""
    rng = np.random.default_rng(2)
    x, g = rng.normal(size=(4, 1, 40)), rng.normal(size=(4, 1, 40))
    x[0, 0, 0] = x[1, 0, 0] = 0.1
    g[0, 0, 0], g[1, 0, 0] = big
    w = np.array([gamma])
    layer = numba_kernels.make_backend().batch_norm(
        1, eps=EPS, momentum=MOMENTUM, affine=True, track_running_stats=True,
        dtype="float64", weight=w, bias=np.zeros(1))
    with np.errstate(over="ignore", invalid="ignore"):
        got = layer.forward(x, g)
        expected = spec.batch_norm_train_vjp(x, g, w, np.zeros(1), EPS)[0]
    for what, where in (("NaN", np.isnan), ("inf", np.isinf), ("finite", np.isfinite)):
        assert np.array_equal(where(got.grad_input), where(expected)), (
            f"got dL/dx {what} at {int(where(got.grad_input).sum())} of 160, but the spec "
            f"says at {int(where(expected).sum())} [batch_norm(1, weight=[{gamma}]), g of "
            f"{big}, float64]")


def test_eval_gradients_of_an_empty_axis():
    """[4, 3, 0] in eval mode: no values, so dL/dx is empty and dL/dgamma, dL/dbeta are
    0, as the spec's (found by a review: a division by zero)."""
    layer = numba_kernels.make_backend().batch_norm(
        3, eps=EPS, momentum=MOMENTUM, affine=True, track_running_stats=True,
        dtype="float32")
    layer.eval()
    x = np.zeros((4, 3, 0), np.float32)
    got = layer.forward(x, x)
    expected = spec.batch_norm_eval_vjp(x.astype(np.float64), x.astype(np.float64),
                                        np.zeros(3), np.ones(3), np.ones(3), np.zeros(3), EPS)
    assert got.grad_input.shape == (4, 3, 0)
    for name, e in (("grad_weight", expected[1]), ("grad_bias", expected[2])):
        assert np.array_equal(np.asarray(getattr(got, name)), e), (
            f"got {name} {getattr(got, name)}, but the spec says {e}")


def test_an_empty_batch():
    """[0, 5]: eval gives an empty output and empty gradients as the spec does; training
    refuses, as the spec does (no value per channel; found by a review: a reshape error
    in both)."""
    layer = numba_kernels.make_backend().batch_norm(
        5, eps=EPS, momentum=MOMENTUM, affine=True, track_running_stats=True,
        dtype="float32")
    x = np.zeros((0, 5), np.float32)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer.forward(x)
    layer.eval()
    got = layer.forward(x, x)
    expected = spec.batch_norm_eval_vjp(x.astype(np.float64), x.astype(np.float64),
                                        np.zeros(5), np.ones(5), np.ones(5), np.zeros(5), EPS)
    assert got.output.shape == got.grad_input.shape == (0, 5)
    for name, e in (("grad_weight", expected[1]), ("grad_bias", expected[2])):
        assert np.array_equal(np.asarray(getattr(got, name)), e), (
            f"got {name} {getattr(got, name)}, but the spec says {e}")
