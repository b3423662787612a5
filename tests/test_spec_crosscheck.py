"""An independent second evaluation of the formulas in exact rational arithmetic
(Python `fractions`), with only the final square root taken in `decimal` at 50 digits.
The oracle must agree to float64 accuracy; this guards the oracle itself."""

from decimal import Decimal, getcontext
from fractions import Fraction

import normspec.spec as s
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

getcontext().prec = 50


def exact_sqrt(q: Fraction) -> Decimal:
    return (Decimal(q.numerator) / Decimal(q.denominator)).sqrt()


def to_float(q: Fraction, root: Decimal) -> float:
    return float(Decimal(q.numerator) / Decimal(q.denominator) / root)


def exact_layer_norm(row, eps):
    xs = [Fraction(v) for v in row]
    mu = sum(xs) / len(xs)
    var = sum((v - mu) ** 2 for v in xs) / len(xs)
    root = exact_sqrt(var + Fraction(eps))
    return [to_float(v - mu, root) for v in xs]


def exact_rms_norm(row, eps):
    xs = [Fraction(v) for v in row]
    root = exact_sqrt(sum(v * v for v in xs) / len(xs) + Fraction(eps))
    return [to_float(v, root) for v in xs]


def exact_batch_norm_running_var(column, old, momentum):
    xs = [Fraction(v) for v in column]
    mu = sum(xs) / len(xs)
    unbiased = sum((v - mu) ** 2 for v in xs) / (len(xs) - 1)
    return float((1 - Fraction(momentum)) * Fraction(old) + Fraction(momentum) * unbiased)


rows = st.lists(st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False), min_size=2, max_size=12)
epsilons = st.sampled_from([1e-5, 1e-3, 0.5])


@settings(max_examples=60, deadline=None)
@given(row=rows, eps=epsilons)
def test_F2_layer_norm_agrees_with_exact_arithmetic(row, eps):
    expected = exact_layer_norm(row, eps)
    x = np.array(row)
    # float64 rounding of the centring, amplified by kappa = 1 + mean|x| / sqrt(var + eps)
    kappa = 1 + np.abs(x).mean() / np.sqrt(x.var() + eps)
    np.testing.assert_allclose(s.layer_norm(x, (len(row),), eps=eps), expected,
                               rtol=0, atol=64 * 2.0**-53 * kappa)


@settings(max_examples=60, deadline=None)
@given(row=rows, eps=epsilons)
def test_F3_rms_norm_agrees_with_exact_arithmetic(row, eps):
    expected = exact_rms_norm(row, eps)
    np.testing.assert_allclose(s.rms_norm(np.array(row), (len(row),), eps=eps), expected,
                               rtol=1e-13, atol=0)


@settings(max_examples=60, deadline=None)
@given(column=rows, momentum=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_F4_running_variance_agrees_with_exact_arithmetic(column, momentum):
    x = np.array(column)[:, None]
    _, _, rv = s.batch_norm_train(x, np.zeros(1), np.array([3.0]), momentum=momentum)
    expected = exact_batch_norm_running_var(column, 3.0, momentum)
    np.testing.assert_allclose(rv, [expected], rtol=1e-12, atol=1e-9)
