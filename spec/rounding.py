"""Rounding the oracle's float64 answer to a backend's dtype, and distances in ULPs.

A backend computing in dtype T cannot do better than the exact answer rounded to T, so
errors are measured against `round_to(oracle, T)` in units in the last place of T.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ._validate import FLOAT_DTYPES

_ORDERED_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def _check_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dt}")
    return dt


def _format(dt: np.dtype):
    fi = ml_dtypes.finfo(dt) if dt == np.dtype(ml_dtypes.bfloat16) else np.finfo(dt)
    # precision p (significand bits incl. the implicit one), smallest normal exponent
    return fi.nmant + 1, int(np.log2(float(fi.smallest_normal))), float(fi.max)


def unit_roundoff(dtype) -> float:
    """u = 2^-p of `dtype` (p significand bits, the implicit one included): the largest
    relative error of one correctly rounded operation."""
    return 2.0 ** -_format(_check_dtype(dtype))[0]


def largest_finite(dtype) -> float:
    """The largest finite value of `dtype` (65504 for float16, ~3.39e38 for bfloat16)."""
    return _format(_check_dtype(dtype))[2]


def ulp(values, dtype) -> np.ndarray:
    """The spacing of `dtype` at |values| (subnormal spacing below the normal range), float64."""
    dt = _check_dtype(dtype)
    p, emin, _ = _format(dt)
    v = np.abs(np.asarray(values, dtype=np.float64))
    _, e = np.frexp(v)  # v = m 2^e, m in [0.5, 1): the leading bit is 2^(e-1)
    return np.ldexp(1.0, np.maximum(e - p, emin - p + 1))


def round_to(values, dtype) -> np.ndarray:
    """Round float64 values to `dtype` correctly (nearest, ties to even), in one step.

    Casting float64 to bfloat16 through float32 could round twice; this rounds the
    significand directly at the target's spacing, so the result is the representable
    value nearest to the exact input.
    """
    dt = _check_dtype(dtype)
    v = np.asarray(values, dtype=np.float64)
    if dt == np.float64:
        return v.copy()
    if dt in (np.float32, np.float16):
        # NumPy's float64 -> float32/float16 casts are single correctly rounded IEEE
        # conversions (overflow to inf, subnormals kept), the same answer as below, ~30x
        # sooner; the bfloat16 cast is not relied on to round once
        with np.errstate(over="ignore", invalid="ignore"):
            return v.astype(dt)
    _, _, fmax = _format(dt)
    with np.errstate(invalid="ignore"):
        step = ulp(np.where(np.isfinite(v), v, 0.0), dt)
        r = np.where(np.isfinite(v), np.rint(v / step) * step, v)  # rint: ties to even
    # values past the largest finite one round to inf (IEEE round-to-nearest overflow)
    r = np.where(np.isfinite(r) & (np.abs(r) > fmax), np.copysign(np.inf, r), r)
    return r.astype(dt)


def _ordered(a: np.ndarray) -> np.ndarray:
    """Map floats to integers that count representable values from zero (+0 == -0)."""
    bits = a.view(_ORDERED_INT[a.dtype.itemsize]).astype(np.int64)
    sign_mask = np.int64(1) << (8 * a.dtype.itemsize - 1)
    magnitude = bits & (sign_mask - 1)
    return np.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a, b, dtype) -> np.ndarray:
    """How many representable values of `dtype` lie between a and b (0 when equal).

    Both are first rounded to `dtype`. NaN against NaN counts as 0 (agreement); NaN
    against a number is inf. Returned as float64 so inf can be expressed.
    """
    dt = _check_dtype(dtype)
    a_t = round_to(np.asarray(a, dtype=np.float64), dt)
    b_t = round_to(np.asarray(b, dtype=np.float64), dt)
    a_t, b_t = np.broadcast_arrays(a_t, b_t)
    dist = np.abs(_ordered(np.ascontiguousarray(a_t)) - _ordered(np.ascontiguousarray(b_t)))
    dist = dist.astype(np.float64)
    na, nb = np.isnan(a_t.astype(np.float64)), np.isnan(b_t.astype(np.float64))
    dist = np.where(na & nb, 0.0, np.where(na | nb, np.inf, dist))
    return dist
