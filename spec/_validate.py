"""Argument validation shared by every oracle function.

Each helper raises an error that names the offending argument and value, so that a
wrong call into the oracle reads as the caller's mistake, not as a numerical failure.
"""

from __future__ import annotations

import functools
import numbers

import ml_dtypes
import numpy as np

#: The floating dtypes the oracle accepts as input; all arithmetic is then float64.
FLOAT_DTYPES = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
)


def as_float64(name: str, x) -> np.ndarray:
    """Return a float64 copy of a floating array, refusing integers, bools and objects."""
    arr = np.asarray(x)
    if arr.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"{name} must be a floating array ({allowed}), got dtype {arr.dtype}")
    return arr.astype(np.float64)  # astype copies: the caller's array is never touched


def optional_float64(name: str, x) -> np.ndarray | None:
    return None if x is None else as_float64(name, x)


def check_eps(eps) -> float:
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"eps must be a real number, got {eps!r}")
    value = float(eps)
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
    return value


def check_momentum(momentum) -> float | None:
    if momentum is None:
        return None
    if not isinstance(momentum, numbers.Real) or isinstance(momentum, bool):
        raise TypeError(f"momentum must be a real number in [0, 1] or None, got {momentum!r}")
    value = float(momentum)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"momentum must lie in [0, 1], got {momentum!r}")
    return value


def normalized_axes(x: np.ndarray, normalized_shape) -> tuple[int, ...]:
    """Validate `normalized_shape` against x's trailing axes and return those axes (B8)."""
    if isinstance(normalized_shape, numbers.Integral):
        normalized_shape = (int(normalized_shape),)
    shape = tuple(int(n) for n in normalized_shape)
    if len(shape) == 0:
        raise ValueError("normalized_shape must name at least one trailing axis, got ()")
    if any(n < 1 for n in shape):
        raise ValueError(f"normalized_shape entries must be >= 1, got {shape}")
    if x.ndim < len(shape) or tuple(x.shape[-len(shape):]) != shape:
        raise ValueError(
            f"normalized_shape {shape} does not match the trailing shape of x {tuple(x.shape)}"
        )
    return tuple(range(x.ndim - len(shape), x.ndim))


def check_param_shape(name: str, param: np.ndarray | None, expected: tuple[int, ...]) -> None:
    if param is not None and tuple(param.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(param.shape)}")


def check_same_shape(name: str, arr: np.ndarray, expected: tuple[int, ...]) -> None:
    if tuple(arr.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(arr.shape)}")


def ieee(fn):
    """Evaluate the formula in plain IEEE arithmetic: NaN and inf inputs give what the
    formula gives (NaN rows, x / inf = 0), which is the spec, so NumPy's floating-point
    warnings are not raised for them."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return fn(*args, **kwargs)

    return wrapper
