"""spec._reductions gives NumPy's own reductions bit for bit (signed zeros and inf
included; a NaN as a NaN), folded or not: the oracle and the tolerances' scales call them
in its place."""

import numpy as np
import pytest
from normspec.spec import _reductions as r

REFERENCE = {
    r.fast_sum: lambda a, axes, keepdims: a.sum(axis=axes, keepdims=keepdims),
    r.fast_mean: lambda a, axes, keepdims: a.mean(axis=axes, keepdims=keepdims),
    r.fast_max: lambda a, axes, keepdims: np.max(a, axis=axes, keepdims=keepdims),
    r.fast_var: lambda a, axes, keepdims: a.var(axis=axes, keepdims=keepdims),
}


def _values(rng, shape):
    """Magnitudes over 16 decades, with signed zeros, infinities and NaN among them."""
    a = rng.normal(size=shape) * 10.0 ** rng.integers(-8, 8, size=shape)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan])
    mask = rng.random(shape) < 0.05
    a[mask] = rng.choice(special, size=int(mask.sum()))
    return a


def _same_bits(expected, actual):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    e, a = np.ascontiguousarray(expected), np.ascontiguousarray(actual)
    nan = np.isnan(e)
    assert np.array_equal(nan, np.isnan(a))
    assert np.array_equal(e[~nan].view(np.int64), a[~nan].view(np.int64))


CASES = [((4096, 4), (-1,)), ((4096, 1), (-1,)), ((4096, 7), (-1,)), ((300, 2, 3), (1, 2)),
         ((300, 2, 3), (2,)), ((2, 300, 3), (-1,)), ((4096, 8), (-1,)), ((512, 33), (-1,)), ((3, 4), (-1,)),
         ((4096, 4), (0,)), ((0, 4), (-1,))]


@pytest.mark.parametrize("fn", list(REFERENCE), ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape,axes", CASES, ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
def test_numpy_bits(fn, shape, axes, keepdims):
    rng = np.random.default_rng(len(shape) * 7 + shape[-1])
    with np.errstate(all="ignore"):
        for a in (_values(rng, shape), _values(rng, shape[::-1]).T):  # C and F order
            _same_bits(REFERENCE[fn](a, axes, keepdims), fn(a, axes, keepdims))


def test_strided_rows_are_folded_too():
    """A view with a stride of 2 along the row: still NumPy's bits."""
    rng = np.random.default_rng(3)
    a = _values(rng, (4096, 8))[:, ::2]
    with np.errstate(all="ignore"):
        for fn, ref in REFERENCE.items():
            _same_bits(ref(a, (-1,), True), fn(a, (-1,), True))


def test_short_rows_take_the_fold():
    """The cases the module is for do take the fold (else the tests above would only
    compare NumPy with itself)."""
    assert r._rows(np.zeros((4096, 4)), (-1,)) is not None
    assert r._rows(np.zeros((300, 2, 3)), (2,)) is not None
    assert r._rows(np.zeros((300, 2, 3)), (1, 2)) is None
    assert r._rows(np.zeros((4096, 8)), (-1,)) is None
    assert r._rows(np.zeros((4096, 4), np.float32), (-1,)) is None
    assert r._rows(np.zeros((4096, 4)), (0,)) is None
