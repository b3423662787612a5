"""What a repro snippet prints: `show(got, expected)` compares a backend's array with the
oracle's float64 answer the way a record does, so a snippet run in a fresh interpreter
says what the record said."""

from __future__ import annotations

import numpy as np
from normspec.spec import round_to, ulp

from .assertions import fmt


def show(got, expected, *, name: str = "output") -> float:
    """Print the worst element of `got` against `expected` rounded to got's dtype, with
    the error in ULPs of that dtype at the scale of the element's last-axis row (the
    largest |expected| there; the record's scale also counts weights and terms, so its
    ULP count can be smaller). Returns that error."""
    got = np.asarray(got)
    dtype = got.dtype
    ref = round_to(np.asarray(expected, dtype=np.float64), dtype).astype(np.float64)
    g = got.astype(np.float64)
    with np.errstate(all="ignore"):
        scale = np.abs(ref).max(axis=-1, keepdims=True) if ref.ndim else np.abs(ref)
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
          f"({float(err[i]):.3g} ULPs of {dtype.name} at the row's scale)")
    return float(err[i])
