"""The oracle's closed-form VJPs against central finite differences in float64."""

import normspec.spec as s
import numpy as np
import pytest

RTOL = 1e-7


def numeric_vjp(f, arg, g, h=1e-6):
    """sum(g * df/darg) by central differences, one coordinate at a time."""
    grad = np.zeros_like(arg)
    it = np.nditer(arg, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        plus, minus = arg.copy(), arg.copy()
        plus[idx] += h
        minus[idx] -= h
        grad[idx] = np.sum(g * (f(plus) - f(minus))) / (2 * h)
    return grad


def assert_vjp(expected, actual):
    scale = np.max(np.abs(expected))
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * scale)


@pytest.mark.parametrize("shape,normalized", [((3, 5), (5,)), ((2, 3, 4), (3, 4)), ((4, 1), (1,))])
def test_F2_layer_norm_vjp_matches_finite_differences(shape, normalized):
    rng = np.random.default_rng(2)
    x, g = rng.normal(size=shape) + 0.5, rng.normal(size=shape)
    w, b = rng.normal(size=normalized), rng.normal(size=normalized)
    eps = 1e-3
    gx, gw, gb = s.layer_norm_vjp(x, normalized, g, w, b, eps)
    assert_vjp(numeric_vjp(lambda v: s.layer_norm(v, normalized, w, b, eps), x, g), gx)
    assert_vjp(numeric_vjp(lambda v: s.layer_norm(x, normalized, v, b, eps), w, g), gw)
    assert_vjp(numeric_vjp(lambda v: s.layer_norm(x, normalized, w, v, eps), b, g), gb)


@pytest.mark.parametrize("shape,normalized", [((3, 5), (5,)), ((2, 3, 4), (3, 4)), ((4, 1), (1,))])
def test_F3_rms_norm_vjp_matches_finite_differences(shape, normalized):
    rng = np.random.default_rng(3)
    x, g, w = rng.normal(size=shape) + 0.5, rng.normal(size=shape), rng.normal(size=normalized)
    eps = 1e-3
    gx, gw = s.rms_norm_vjp(x, normalized, g, w, eps)
    assert_vjp(numeric_vjp(lambda v: s.rms_norm(v, normalized, w, eps), x, g), gx)
    assert_vjp(numeric_vjp(lambda v: s.rms_norm(x, normalized, v, eps), w, g), gw)


@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 5), (2, 2, 3, 3)])
def test_F1_batch_norm_train_vjp_matches_finite_differences(shape):
    rng = np.random.default_rng(1)
    x, g = rng.normal(size=shape) * 2 + 1, rng.normal(size=shape)
    c = shape[1]
    w, b = rng.normal(size=c), rng.normal(size=c)
    eps = 1e-3

    def forward(xv=x, wv=w, bv=b):
        return s.batch_norm_train(xv, None, None, wv, bv, eps=eps)[0]

    gx, gw, gb = s.batch_norm_train_vjp(x, g, w, b, eps)
    assert_vjp(numeric_vjp(lambda v: forward(xv=v), x, g), gx)
    assert_vjp(numeric_vjp(lambda v: forward(wv=v), w, g), gw)
    assert_vjp(numeric_vjp(lambda v: forward(bv=v), b, g), gb)


@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 5), (2, 2, 3, 3)])
def test_F5_batch_norm_eval_vjp_matches_finite_differences(shape):
    rng = np.random.default_rng(5)
    x, g = rng.normal(size=shape) * 2 + 1, rng.normal(size=shape)
    c = shape[1]
    w, b = rng.normal(size=c), rng.normal(size=c)
    rm, rv = rng.normal(size=c), rng.uniform(0.5, 3.0, size=c)
    eps = 1e-3

    def forward(xv=x, wv=w, bv=b):
        return s.batch_norm_eval(xv, rm, rv, wv, bv, eps)

    gx, gw, gb = s.batch_norm_eval_vjp(x, g, rm, rv, w, b, eps)
    assert_vjp(numeric_vjp(lambda v: forward(xv=v), x, g), gx)
    assert_vjp(numeric_vjp(lambda v: forward(wv=v), w, g), gw)
    assert_vjp(numeric_vjp(lambda v: forward(bv=v), b, g), gb)
    # no reduction over the batch: dL/dx is gamma g / sqrt(running_var + eps) itself
    np.testing.assert_allclose(gx, g * (w / np.sqrt(rv + eps)).reshape((1, c) + (1,) * (len(shape) - 2)))


def test_F5_untracked_eval_vjp_is_the_training_vjp():
    rng = np.random.default_rng(6)
    x, g, w, b = rng.normal(size=(5, 3)), rng.normal(size=(5, 3)), rng.normal(size=3), rng.normal(size=3)
    for got, want in zip(s.batch_norm_eval_vjp(x, g, None, None, w, b, 1e-3),
                         s.batch_norm_train_vjp(x, g, w, b, 1e-3), strict=True):
        np.testing.assert_array_equal(got, want)


def test_vjps_return_none_for_absent_parameters():
    x, g = np.ones((2, 3)) * [[1.0, 2.0, 4.0]], np.ones((2, 3))
    assert s.layer_norm_vjp(x, (3,), g)[1:] == (None, None)
    assert s.rms_norm_vjp(x, (3,), g)[1] is None
    assert s.batch_norm_train_vjp(x * [[1.0], [3.0]], g)[1:] == (None, None)
    assert s.batch_norm_eval_vjp(x, g, np.zeros(3), np.ones(3))[1:] == (None, None)
