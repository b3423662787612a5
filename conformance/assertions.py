"""Assertion helpers: every comparison a check makes goes through here.

Keyword-only. A failure raises CheckFailure whose message reads
"got X, but the spec says Y [call]" and carries a copy-pasteable repro snippet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from normspec.spec import round_to, ulp

from . import tolerances


class CheckFailure(AssertionError):
    """A backend disagreed with the spec. `measure` holds the worst error found."""

    def __init__(self, message: str, *, repro: str = "", measure: Measure | None = None):
        super().__init__(message)
        self.repro = repro
        self.measure = measure


@dataclass
class Measure:
    """Worst error seen so far in a check: in ULPs at scale (the judged metric), plus
    absolute and relative error for the reader."""

    max_ulp: float = 0.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    bound_ulp: float = 0.0
    comparisons: int = 0
    worst: dict = field(default_factory=dict)

    def absorb(self, other: Measure) -> None:
        self.comparisons += other.comparisons
        if other.max_ulp >= self.max_ulp:
            self.max_ulp, self.bound_ulp, self.worst = other.max_ulp, other.bound_ulp, other.worst
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_rel = max(self.max_rel, other.max_rel)


def _fmt(v) -> str:
    return np.format_float_positional(float(v), precision=9, trim="-") if np.isfinite(v) else str(v)


def error_ulps(*, expected, actual, dtype, scale) -> np.ndarray:
    """|actual - round_T(expected)| in ULPs of T at `scale`; NaN where both are NaN counts
    as agreement, a NaN on one side only or an inf mismatch as inf."""
    ref = round_to(expected, dtype).astype(np.float64)
    got = np.asarray(actual).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got - ref)
        same = (got == ref) | (np.isnan(got) & np.isnan(ref))
        err = np.where(same, 0.0, diff / ulp(np.broadcast_to(scale, ref.shape), dtype))
    return np.where(np.isnan(err), np.inf, err)


def assert_conforms(*, expected, actual, dtype, scale, bound, what: str, call: str,
                    repro: str = "") -> Measure:
    """Pass when every element of `actual` is within `bound` ULPs (at `scale`) of the
    oracle's `expected` rounded to `dtype`; return the measure, raise CheckFailure if not.

    `what` names the quantity ("layer_norm output"), `call` the backend call that
    produced it, both for the message.
    """
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(actual)
    if expected.shape != actual.shape:
        raise CheckFailure(f"got {what} of shape {actual.shape}, but the spec says shape "
                           f"{expected.shape} [{call}]", repro=repro)
    err = error_ulps(expected=expected, actual=actual, dtype=dtype, scale=scale)
    bound_arr = np.broadcast_to(np.asarray(bound, dtype=np.float64), err.shape)
    excess = err - bound_arr
    ref = round_to(expected, dtype).astype(np.float64)
    got = actual.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        abs_err = np.where(np.isnan(err), np.inf, np.abs(got - ref))
        abs_err = np.where(err == 0, 0.0, abs_err)
        rel_err = np.where(err == 0, 0.0, abs_err / np.abs(ref))
    m = Measure(comparisons=1)
    if err.size:
        i = np.unravel_index(int(np.nanargmax(np.where(np.isnan(excess), np.inf, excess))), err.shape)
        m.max_ulp, m.bound_ulp = float(err[i]), float(bound_arr[i])
        m.max_abs = float(np.nanmax(np.where(np.isfinite(abs_err), abs_err, np.inf)))
        m.max_rel = float(np.nanmax(np.where(np.isfinite(rel_err), rel_err, np.inf)))
        m.worst = {"what": what, "index": [int(k) for k in i], "expected": _fmt(ref[i]),
                   "got": _fmt(got[i]), "ulp": m.max_ulp, "bound": m.bound_ulp}
        if not err[i] <= bound_arr[i]:
            raise CheckFailure(
                f"got {what}[{', '.join(map(str, i))}] = {_fmt(got[i])}, but the spec says "
                f"{_fmt(ref[i])} ({m.max_ulp:.3g} ULPs of {np.dtype(dtype).name} at scale, "
                f"bound {m.bound_ulp:.3g}) [{call}]", repro=repro, measure=m)
    return m


def assert_holds(*, condition: bool, got: str, spec_says: str, call: str, repro: str = "") -> None:
    """A yes/no property of the spec (an error raised, a value that must change)."""
    if not condition:
        raise CheckFailure(f"got {got}, but the spec says {spec_says} [{call}]", repro=repro)


def assert_differs(*, first, second, dtype, scale, at_least: float, what: str, call: str,
                   repro: str = "") -> None:
    """The spec says two results differ (B1 for RMSNorm, B4, B7): some element must be
    more than `at_least` ULPs (at scale) apart, so rounding cannot be mistaken for it."""
    err = error_ulps(expected=np.asarray(first, dtype=np.float64), actual=np.asarray(second),
                     dtype=dtype, scale=scale)
    biggest = float(np.max(err)) if err.size else 0.0
    assert_holds(condition=biggest > at_least,
                 got=f"{what} equal up to {biggest:.3g} ULPs",
                 spec_says=f"they differ by more than {at_least:.3g} ULPs", call=call, repro=repro)


__all__ = ["CheckFailure", "Measure", "assert_conforms", "assert_differs", "assert_holds",
           "error_ulps", "tolerances"]
