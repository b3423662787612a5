"""The numba BatchNorm's per-channel sums are pairwise over pieces (_numba_bn): a channel
of millions of values stays within the tolerance table's bounds, where sums in row order
(the kernels before) did not: at [131072, 1, 32] float64, dL/dbeta erred by 256 ULPs
against a bound of 93 and running_mean by 65 against 47. And a float32 piece whose
partial sums overflow is summed again in float64, as a LayerNorm row is."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from normspec import spec  # noqa: E402
from normspec.conformance.assertions import error_ulps  # noqa: E402
from normspec.conformance.tolerances import (  # noqa: E402
    bound,
    centred_output_scale,
    centring_kappa,
    grad_input_scale,
    param_grad_scales,
    running_stat_scales,
)
from normspec.impls import numba_kernels  # noqa: E402
from normspec.impls._numba_bn import PIECE, pairwise  # noqa: E402

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
    rm_scale, rv_scale = running_stat_scales(np.zeros(c), np.ones(c), x64, m, MOMENTUM, axes)
    measured = {
        "output": (y, got.output, centred_output_scale(x_hat, w64.reshape(bshape),
                                                       b64.reshape(bshape), axes),
                   bound("output", dtype, m, kappa)),
        "grad_input": (gx, got.grad_input,
                       grad_input_scale(r, np.abs(g64 * w64.reshape(bshape)), x_hat, axes,
                                        centre=True), bound("gradient", dtype, m, kappa)),
        "grad_weight": (gw, got.grad_weight, w_scale,
                        bound("param_gradient", dtype, x.size, kappa)),
        "grad_bias": (gb, got.grad_bias, b_scale, bound("param_gradient", dtype, x.size, 1.0)),
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


def test_float32_partial_sums_that_overflow_are_summed_again_in_float64():
    """Two terms of 2e38 in one float32 lane of a row make its partial sum inf; two of
    -2e38 in the next lane cancel them. The sums must come out finite, as the spec's,
    and within the table's bounds."""
    shape = (64, 2, 32)
    rng = np.random.default_rng(1)
    x = rng.normal(3.0, 2.0, shape).astype(np.float32)
    g = rng.normal(0.5, 1.0, shape).astype(np.float32)
    for j, v in ((5, 2e38), (21, 2e38), (6, -2e38), (22, -2e38)):
        g[0, 0, j] = v
        x[0, 0, j] = 3.0  # x_hat near 0: g x_hat stays a float32 too
    layer = numba_kernels.make_backend().batch_norm(
        2, eps=EPS, momentum=MOMENTUM, affine=True, track_running_stats=True,
        dtype="float32")
    got = layer.forward(x, g)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    expected = spec.batch_norm_train_vjp(x64, g64, np.ones(2), np.zeros(2), EPS)
    axes = (0, 2)
    r = 1.0 / np.sqrt(x64.var(axis=axes, keepdims=True) + EPS)
    x_hat = (x64 - x64.mean(axis=axes, keepdims=True)) * r
    kappa = np.max(centring_kappa(x64, axes, EPS))
    scales = (grad_input_scale(r, np.abs(g64), x_hat, axes, centre=True),
              *param_grad_scales(g64, x_hat, axes))
    bounds = (bound("gradient", "float32", 64 * 32, kappa),
              bound("param_gradient", "float32", g.size, kappa),
              bound("param_gradient", "float32", g.size, 1.0))
    for name, e, scale, bd in zip(("grad_input", "grad_weight", "grad_bias"), expected,
                                  scales, bounds, strict=True):
        value = np.asarray(getattr(got, name))
        err = np.max(error_ulps(expected=e, actual=value, dtype="float32", scale=scale))
        assert np.isfinite(value).all() and err <= np.max(bd), (
            f"got {name} {value.ravel()[:4]} ({err:.3g} ULPs, bound {np.max(bd):.3g}), but "
            f"the spec says {e.ravel()[:4]} [batch_norm(2).forward(x, g), float32]")
