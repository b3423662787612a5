"""Sums and means over any axes with pairwise accuracy.

NumPy sums pairwise (error growing as log n) only along a contiguous last axis; over any
other axis it adds one slice at a time, and the error grows as n. For BatchNorm's
reduction over N (and H, W) and the parameter gradients' reduction over the rows, that
is ~100 units of roundoff at 10^5 rows: more than a float64 backend is allowed. The
reduced axes are therefore moved last and made contiguous first."""

from __future__ import annotations

import numpy as np


def sum_over(a: np.ndarray, axes, keepdims: bool = False) -> np.ndarray:
    """sum of `a` over `axes`, pairwise."""
    axes = tuple(sorted(ax % a.ndim for ax in np.atleast_1d(axes))) if a.ndim else ()
    rest = [ax for ax in range(a.ndim) if ax not in axes]
    moved = np.ascontiguousarray(np.transpose(a, rest + list(axes)))
    s = moved.reshape(moved.shape[:len(rest)] + (-1,)).sum(axis=-1)
    if keepdims:
        s = s.reshape([1 if ax in axes else n for ax, n in enumerate(a.shape)])
    return s


def mean_over(a: np.ndarray, axes, keepdims: bool = False) -> np.ndarray:
    """mean of `a` over `axes`, pairwise."""
    axes = tuple(np.atleast_1d(axes))
    n = int(np.prod([a.shape[ax] for ax in axes]))
    return sum_over(a, axes, keepdims) / n
