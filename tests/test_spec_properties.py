"""Hypothesis properties of the oracle: B1 shift, B2 scale (eps accounted for exactly),
the E7 bound, and the rounding/ULP helpers."""

import ml_dtypes
import normspec.spec as s
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from normspec.conformance import strategies as ns


@given(data=st.data())
def test_B1_layer_norm_is_shift_invariant(data):
    shape = data.draw(ns.normalized_shapes(max_size=512), label="normalized_shape")
    x = data.draw(ns.feature_vectors((3, *shape)), label="x").values64()
    c = data.draw(ns.shifts, label="shift")
    eps = data.draw(st.sampled_from([0.0, 1e-5, 1e-2]), label="eps")
    if eps == 0.0 and np.prod(shape) == 1:
        eps = 1e-5  # a single feature has zero variance: eps = 0 would divide by zero
    expected = s.layer_norm(x, shape, eps=eps)
    shifted = s.layer_norm(x + c, shape, eps=eps)
    # float64 rounding of x + c loses |c| * 2^-53 per value; relative to the spread
    spread = np.sqrt(np.var(x, axis=tuple(range(1, x.ndim)), keepdims=True) + eps)
    atol = float(np.max(64 * 2**-53 * (abs(c) + np.abs(x).max()) / spread))
    np.testing.assert_allclose(shifted, expected, atol=atol)


@given(data=st.data())
def test_B1_rms_norm_is_not_shift_invariant(data):
    d = data.draw(st.integers(2, 64), label="d")
    x = data.draw(ns.feature_vectors((d,), spread=1.0), label="x").values64()
    c = data.draw(st.floats(0.5, 1e3), label="shift")
    before, after = s.rms_norm(x, (d,), eps=0.0), s.rms_norm(x + c, (d,), eps=0.0)
    # after the shift the row is x + c over sqrt(mean((x + c)^2)) and nothing else
    np.testing.assert_allclose(after, (x + c) / np.sqrt(np.mean((x + c) ** 2)), rtol=1e-12)
    assert not np.allclose(before, after, rtol=1e-6, atol=1e-9)


@given(data=st.data())
def test_B2_scale_invariance_with_eps_rescaled_exactly(data):
    shape = data.draw(ns.normalized_shapes(max_size=512), label="normalized_shape")
    x = data.draw(ns.feature_vectors((2, *shape)), label="x").values64()
    a = data.draw(ns.positive_scales, label="scale")
    eps = data.draw(st.sampled_from([1e-6, 1e-3, 1.0]), label="eps")
    # norm(a x; eps) == norm(x; eps / a^2) exactly: eps is rescaled, not ignored
    np.testing.assert_allclose(s.layer_norm(a * x, shape, eps=eps),
                               s.layer_norm(x, shape, eps=eps / a**2), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(s.rms_norm(a * x, shape, eps=eps),
                               s.rms_norm(x, shape, eps=eps / a**2), rtol=1e-12)
    # negative scaling flips the sign
    np.testing.assert_allclose(s.rms_norm(-a * x, shape, eps=eps),
                               -s.rms_norm(x, shape, eps=eps / a**2), rtol=1e-12)


def test_B2_eps_breaks_plain_scale_invariance():
    x = np.array([0.01, 0.03])
    assert not np.allclose(s.layer_norm(x, (2,), eps=1e-5), s.layer_norm(100 * x, (2,), eps=1e-5))


@given(pair=ns.qk_pairs())
def test_E7_scores_are_bounded_by_sqrt_head_dim(pair):
    q, k = (recipe.values64() for recipe in pair)
    d = q.shape[-1]
    scores = s.qk_norm_scores(q, k, eps=0.0)
    assert np.all(np.abs(scores) <= np.sqrt(d) * (1 + 1e-12))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_round_to_is_correct_rounding(dtype):
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.normal(size=2000) * 10.0 ** rng.integers(-8, 5, 2000), [0.0, -0.0]])
    r = s.round_to(v, dtype).astype(np.float64)
    up = np.nextafter(r.astype(dtype), np.array(np.inf, dtype=dtype)).astype(np.float64)
    down = np.nextafter(r.astype(dtype), np.array(-np.inf, dtype=dtype)).astype(np.float64)
    # no neighbour is strictly closer to the exact value
    assert np.all(np.abs(v - r) <= np.abs(v - up))
    assert np.all(np.abs(v - r) <= np.abs(v - down))


def test_round_to_ties_to_even_and_overflow():
    one_and_half_ulp = 1.0 + 2.0**-8  # halfway between 1 and the next bfloat16
    assert s.round_to(np.array([one_and_half_ulp]), ml_dtypes.bfloat16)[0] == 1.0
    assert np.isinf(s.round_to(np.array([70000.0]), np.float16)[0])
    assert s.round_to(np.array([65519.0]), np.float16)[0] == 65504.0


def test_ulp_distance_counts_representable_values():
    one = np.array([1.0])
    nxt = np.nextafter(np.float32(1.0), np.float32(2.0)).astype(np.float64)
    assert s.ulp_distance(one, [nxt], np.float32)[0] == 1
    assert s.ulp_distance([-0.0], [0.0], np.float16)[0] == 0
    smallest = float(np.finfo(np.float16).smallest_subnormal)
    assert s.ulp_distance([-smallest], [smallest], np.float16)[0] == 2
    assert s.ulp_distance([np.nan], [np.nan], np.float32)[0] == 0
    assert s.ulp_distance([np.nan], [1.0], np.float32)[0] == np.inf
    assert s.ulp([1.0], ml_dtypes.bfloat16)[0] == 2.0**-7
