"""Every Hypothesis strategy normspec uses, in one module.

Plural names, one per kind of thing drawn. Values are drawn as float64 and then rounded
to the dtype under test, so the backend and the oracle see the same representable input.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .cases import ArraySpec

#: Hidden sizes: d = 1, small odd sizes, sizes that are not powers of two, and powers of two.
HIDDEN_SIZES = (1, 2, 3, 5, 7, 31, 64, 100, 127, 384, 1000, 1023)


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


#: Batch axes in front of the normalized ones. A small pool: compiled backends (XLA,
#: Triton) compile once per shape, and values, not batch layouts, are what vary the error.
LEADING_SHAPES = ((), (1,), (3,), (2, 3))


@st.composite
def leading_shapes(draw):
    """Batch axes in front of the normalized ones ([B], [B, T], or none)."""
    return draw(st.sampled_from(LEADING_SHAPES), label="leading shape")


@st.composite
def feature_vectors(draw, shape, spread=None, mean=None):
    """An ArraySpec (a printable recipe for a seeded normal array) of `shape`, with mean
    and spread drawn too, so rows range from centred to offset far from zero."""
    seed = draw(seeds, label="seed")
    mu = mean if mean is not None else draw(st.floats(-10, 10), label="mean")
    sigma = spread if spread is not None else draw(st.floats(1e-2, 1e2), label="spread")
    return ArraySpec(shape=tuple(shape), seed=seed, mean=mu, spread=sigma)


#: head_dim pool: 1, odd sizes, powers of two and the document's 128. Pools (not ranges)
#: keep the number of distinct shapes small, which compiled backends pay for per shape.
HEAD_DIMS = (1, 2, 7, 16, 48, 64, 100, 128, 160, 256)


@st.composite
def qk_pairs(draw, max_head_dim: int = 256, max_magnitude: float = 1e6):
    """(q, k) recipes of shape [heads, tokens, head_dim], with magnitudes up to
    `max_magnitude` (1e6) to stand for projections that have grown large."""
    heads = draw(st.sampled_from([1, 2]), label="heads")
    tq = draw(st.sampled_from([1, 3]), label="query tokens")
    tk = draw(st.sampled_from([1, 4]), label="key tokens")
    d = draw(st.sampled_from([h for h in HEAD_DIMS if h <= max_head_dim]), label="head_dim")
    seed = draw(seeds, label="seed")
    magnitudes = [m for m in (1e-2, 1.0, 1e3, 1e6) if m <= max_magnitude]
    magnitude = draw(st.sampled_from(magnitudes), label="projection magnitude")
    return (ArraySpec((heads, tq, d), seed, 0.0, magnitude),
            ArraySpec((heads, tk, d), seed + 1, 0.0, magnitude))

epsilons = st.sampled_from([1e-6, 1e-5, 1e-2])

#: The QK score scale: None is the usual 1/sqrt(d_k); the others are scales a model may
#: pass instead (no scaling, a temperature), which the backend must use as given.
qk_scales = st.sampled_from([None, 1.0, 0.1, 2.0])


@st.composite
def layer_norm_cases(draw, *, with_grad=False, with_bias=True, max_size=4096):
    """Recipes for one LayerNorm/RMSNorm call: x of [leading..., normalized...], optional
    gain and bias of the normalized shape, eps, and an upstream gradient."""
    shape = draw(normalized_shapes(max_size=max_size), label="normalized_shape")
    lead = draw(leading_shapes(), label="leading shape")
    full = (*lead, *shape) if lead else (1, *shape)
    x = draw(feature_vectors(full), label="x")
    affine = draw(st.booleans(), label="affine")
    weight = ArraySpec(shape, draw(seeds, label="weight seed"), 1.0, 0.5) if affine else None
    bias = (ArraySpec(shape, draw(seeds, label="bias seed"), 0.0, 0.5)
            if affine and with_bias else None)
    eps = draw(epsilons, label="eps")
    grad = ArraySpec(full, draw(seeds, label="grad seed")) if with_grad else None
    return {"x": x, "normalized_shape": shape, "weight": weight, "bias": bias, "eps": eps,
            "grad": grad}


@st.composite
def batch_norm_inputs(draw, *, min_values_per_channel=2):
    """A BatchNorm input recipe [N, C], [N, C, L] or [N, C, H, W] with >= 2 values per
    channel, its gain/bias recipes, eps and momentum."""
    rank = draw(st.sampled_from([2, 3, 4]), label="rank")
    n = draw(st.sampled_from([1, 2, 5]), label="N")
    c = draw(st.sampled_from([1, 3, 16]), label="C")
    rest = tuple(draw(st.sampled_from([1, 3, 5]), label=f"spatial axis {i}")
                 for i in range(rank - 2))
    if n * int(np.prod(rest, dtype=int)) < min_values_per_channel:
        n = min_values_per_channel
    shape = (n, c, *rest)
    x = draw(feature_vectors(shape), label="x")
    weight = ArraySpec((c,), draw(seeds, label="weight seed"), 1.0, 0.5)
    bias = ArraySpec((c,), draw(seeds, label="bias seed"), 0.0, 0.5)
    eps = draw(epsilons, label="eps")
    momentum = draw(st.sampled_from([0.1, 0.3, 1.0]), label="momentum")
    grad = ArraySpec(shape, draw(seeds, label="grad seed"))
    return {"x": x, "weight": weight, "bias": bias, "eps": eps, "momentum": momentum,
            "grad": grad}
