"""Every Hypothesis strategy normspec uses, in one module.

Plural names, one per kind of thing drawn. Values are drawn as float64 and then rounded
to the dtype under test, so the backend and the oracle see the same representable input.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

#: Hidden sizes: d = 1, small odd sizes, sizes that are not powers of two, and powers of two.
HIDDEN_SIZES = (1, 2, 3, 5, 7, 31, 64, 100, 127, 384, 1000, 1023)

float_dtypes = st.sampled_from(
    [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64)]
)

finite_scalars = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)

positive_scales = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)

shifts = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False)

seeds = st.integers(min_value=0, max_value=2**32 - 1)


@st.composite
def normalized_shapes(draw, max_axes: int = 3, max_size: int = 4096):
    """1 to `max_axes` trailing axes whose product stays below `max_size`."""
    n_axes = draw(st.integers(1, max_axes), label="number of normalized axes")
    shape: list[int] = []
    budget = max_size
    for i in range(n_axes):
        choices = [n for n in HIDDEN_SIZES if n <= budget] or [1]
        n = draw(st.sampled_from(choices), label=f"normalized axis {i}")
        shape.append(n)
        budget = max(1, budget // n)
    return tuple(shape)


@st.composite
def leading_shapes(draw, max_axes: int = 2):
    """Batch axes in front of the normalized ones ([B], [B, T], or none)."""
    n_axes = draw(st.integers(0, max_axes), label="number of leading axes")
    return tuple(draw(st.integers(1, 4), label=f"leading axis {i}") for i in range(n_axes))


@st.composite
def feature_vectors(draw, shape, spread=None):
    """A float64 array of `shape` from a seeded normal: mean and spread drawn too, so
    rows range from centred to offset far from zero."""
    seed = draw(seeds, label="seed")
    mean = draw(st.floats(-10, 10), label="mean")
    sigma = spread if spread is not None else draw(st.floats(1e-2, 1e2), label="spread")
    rng = np.random.default_rng(seed)
    return rng.normal(mean, sigma, size=shape)


@st.composite
def qk_pairs(draw, max_head_dim: int = 256):
    """(q, k) as [heads, tokens, head_dim] float64 arrays, with magnitudes up to 1e6 to
    stand for projections that have grown large."""
    heads = draw(st.integers(1, 3), label="heads")
    tq = draw(st.integers(1, 5), label="query tokens")
    tk = draw(st.integers(1, 5), label="key tokens")
    d = draw(st.integers(1, max_head_dim), label="head_dim")
    seed = draw(seeds, label="seed")
    magnitude = draw(st.sampled_from([1e-2, 1.0, 1e3, 1e6]), label="projection magnitude")
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(heads, tq, d)) * magnitude, rng.normal(size=(heads, tk, d)) * magnitude)
