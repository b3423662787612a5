"""tolerances.batch_moments gives, bit for bit, what the BatchNorm driver and the
data-parallel comparisons computed from the batch before it (NumPy's variance and
mean |x| over the batch axes, centring_kappa), and the running statistics' scales and
bound built on it are those of the formulas it replaced."""

import numpy as np
import pytest
from normspec.conformance import tolerances as t

EPS = 1e-5


def _batches():
    rng = np.random.default_rng(3)
    yield rng.normal(1.0, 2.0, size=(4096, 2))
    yield rng.normal(1000.0, 0.01, size=(300, 3))  # a badly centred channel
    yield np.moveaxis(rng.normal(size=(4, 5, 6, 3)), -1, 1)  # channels last
    yield rng.normal(size=(6, 8, 5, 7))[::2, :, 1:]  # strided, offset
    c = np.zeros((64, 2))
    c[:, 1] = 7.0  # a constant channel: variance 0
    yield c


def _same_bits(expected, actual):
    expected, actual = np.asarray(expected), np.asarray(actual)
    assert actual.shape == expected.shape
    assert np.array_equal(np.ascontiguousarray(expected).view(np.int64),
                          np.ascontiguousarray(actual).view(np.int64))


@pytest.mark.parametrize("x", list(_batches()), ids=lambda x: str(x.shape))
def test_batch_moments_are_the_formulas_they_replace(x):
    axes = (0,) + tuple(range(2, x.ndim))
    count, a = x.size // x.shape[1], 0.3
    m = t.batch_moments(x, axes, EPS)
    assert m.count == count
    _same_bits(x.var(axis=axes, keepdims=True), m.var)
    _same_bits(np.abs(x).mean(axis=axes, keepdims=True), m.mean_abs)
    _same_bits(t.centring_kappa(x, axes, EPS), m.kappa)
    old_rm, old_rv = np.linspace(-1, 1, x.shape[1]), np.linspace(0.5, 2, x.shape[1])
    # the scales and the bound as written before batch_moments
    v_u = x.var(axis=axes) * count / max(count - 1, 1)
    rm_scale = (1 - a) * np.abs(old_rm) + a * np.abs(x).mean(axis=axes)
    rv_scale = (1 - a) * np.abs(old_rv) + a * v_u
    got_rm, got_rv = t.running_stat_scales(old_rm, old_rv, m, a)
    _same_bits(rm_scale, got_rm)
    _same_bits(rv_scale, got_rv)
    kappa = t.running_var_kappa(t.centring_kappa(x, axes, EPS).reshape(-1), a, v_u, rv_scale)
    _same_bits(t.bound("running_stat", "float16", count, kappa, compute="float16"),
               t.running_var_bound("float16", "float16", m, a, rv_scale))
