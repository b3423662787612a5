"""What a repro snippet prints: `show(got, expected)` compares a backend's array with the
oracle's float64 answer the way a record does, so a snippet run in a fresh interpreter
says what the record said."""

from __future__ import annotations

import numpy as np
from normspec.spec import round_to, ulp

from .assertions import fmt


def show(got, expected, *, name: str = "output", axes=-1) -> float:
    """Print the worst element of `got` against `expected` rounded to got's dtype, with
    the error in ULPs of that dtype at the scale of the element's row: the largest
    |expected| over `axes` (the axes the op normalizes over: a LayerNorm's normalized
    axes, a BatchNorm channel's). The record's scale also counts the weights and the
    terms of the op, so its ULP count can be smaller than this one. Returns that error."""
    got = np.asarray(got)
    dtype = got.dtype
    ref = round_to(np.asarray(expected, dtype=np.float64), dtype).astype(np.float64)
    g = got.astype(np.float64)
    with np.errstate(all="ignore"):
        scale = np.abs(ref).max(axis=axes, keepdims=True) if ref.ndim else np.abs(ref)
        scale = np.broadcast_to(np.where(np.isfinite(scale) & (scale > 0), scale, 1.0), ref.shape)
        same = (g == ref) | (np.isnan(g) & np.isnan(ref))
        err = np.where(same, 0.0, np.abs(g - ref) / ulp(scale, dtype))
    err = np.where(np.isnan(err), np.inf, err)
    if err.size == 0:
        print(f"{name}: empty")
        return 0.0
    i = np.unravel_index(int(np.argmax(err)), err.shape)
    where = f"[{', '.join(map(str, i))}]" if err.ndim else ""
    print(f"{name}{where}: got {fmt(g[i], dtype)}, expected {fmt(ref[i], dtype)} "
          f"({float(err[i]):.3g} ULPs of {dtype.name} at its row's largest |expected|)")
    return float(err[i])
