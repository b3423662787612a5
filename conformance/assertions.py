"""Assertion helpers: every comparison a check makes goes through here.

Keyword-only. A failure raises CheckFailure whose message reads
"got X, but the spec says Y [call]"; values print with as many digits as round-trip in
the dtype compared (the context adds the repro snippet to the record).

Every compared quantity has a stable id, "<op>.<field>" (e.g. "layer_norm.grad_input",
"batch_norm.eval.output", "batch_norm.running_var"): records carry it, and deviation
entries match on it, so rewording a message never changes what a deviation covers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from normspec.spec import round_to, ulp

from . import tolerances


class CheckFailure(AssertionError):
    """A backend disagreed with the spec. `measure` holds the worst error found."""

    def __init__(self, message: str, *, measure: Measure | None = None, protocol: bool = False):
        super().__init__(message)
        self.measure = measure
        self.diagnosis: dict = {}  # the formula variants that explain it (diagnosis.py)
        #: a breach of the call's contract (an input written into, an output that is not
        #: an array of the shape and dtype asked), which no deviation entry excuses
        self.protocol = protocol


@dataclass
class Measure:
    """Worst error seen so far in a case: in ULPs at scale (the judged metric), plus
    absolute and relative error for the reader. "Worst" is the comparison closest to (or
    furthest past) its bound, so the record shows the quantity that decided it, not a
    passing one with a looser bound."""

    max_ulp: float = 0.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    bound_ulp: float = 0.0
    comparisons: int = 0
    worst: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """The error as a fraction of its bound (inf past any bound of 0)."""
        if self.bound_ulp > 0:
            return self.max_ulp / self.bound_ulp
        return float("inf") if self.max_ulp > 0 else 0.0

    def absorb(self, other: Measure) -> None:
        self.comparisons += other.comparisons
        if other.comparisons and (not self.worst or not other.ratio < self.ratio):
            self.max_ulp, self.bound_ulp, self.worst = other.max_ulp, other.bound_ulp, other.worst
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_rel = max(self.max_rel, other.max_rel)


def fmt(v, dtype) -> str:
    """`v` as the shortest text that reads back as the same value of `dtype` (NumPy's
    own rule, whatever print options a backend set: legacy="1.13" printed float32 with 8
    digits, and values an ULP apart read alike: a red team)."""
    v = float(v)
    if not np.isfinite(v):
        return str(v)
    if np.get_printoptions()["legacy"] is False:
        return str(np.dtype(dtype).type(v))
    with np.printoptions(legacy=False):
        return str(np.dtype(dtype).type(v))


def _errors(*, expected, actual, dtype, scale, ref=None):
    """(ULP error at `scale`, |actual - ref|, ref, actual as float64), see error_ulps."""
    # (round_to's answer is a new array: a float64 one is used as it is, not copied again)
    ref = round_to(expected, dtype).astype(np.float64, copy=False) if ref is None else ref
    got = np.asarray(actual, dtype=np.float64)
    # the spacing at the scale's own shape (one per row or channel), broadcast after
    spacing = ulp(np.asarray(scale, dtype=np.float64), dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got - ref)
        err = np.broadcast_to(diff / spacing, ref.shape)
        odd = np.isnan(err)  # a NaN, or inf - inf: agreement only where both sides match
        if odd.any():
            same = (got == ref) | (np.isnan(got) & np.isnan(ref))
            err = np.where(odd, np.where(same, 0.0, np.inf), err)
    return err, diff, ref, got


def error_ulps(*, expected, actual, dtype, scale, ref=None) -> np.ndarray:
    """|actual - round_T(expected)| in ULPs of T at `scale`; NaN where both are NaN counts
    as agreement, a NaN on one side only or an inf mismatch as inf. `ref`: expected
    already rounded to T (float64), where the caller has it."""
    return _errors(expected=expected, actual=actual, dtype=dtype, scale=scale, ref=ref)[0]


def _largest(a: np.ndarray) -> float:
    """max(a), inf when any element is NaN or inf."""
    biggest = float(a.max())
    return biggest if np.isfinite(biggest) else float("inf")


def assert_conforms(*, expected, actual, dtype, scale, bound, quantity: str, call: str,
                    what: str | None = None) -> Measure:
    """Pass when every element of `actual` is within `bound` ULPs (at `scale`) of the
    oracle's `expected` rounded to `dtype`; return the measure, raise CheckFailure if not.

    `quantity` is the stable id of what is compared; `what` a longer description for
    the message where the id alone would not say it; `call` the backend call.
    """
    what = what or quantity
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(actual)
    if expected.shape != actual.shape:
        raise CheckFailure(f"got {what} of shape {actual.shape}, but the spec says shape "
                           f"{expected.shape} [{call}]")
    err, diff, ref, got = _errors(expected=expected, actual=actual, dtype=dtype, scale=scale)
    bound_arr = np.broadcast_to(np.asarray(bound, dtype=np.float64), err.shape)
    # arrays of no elements (an empty batch) agree in shape and compare nothing: the
    # record then carries no ULPs, as one that measured nothing does
    m = Measure(comparisons=1 if err.size else 0)
    if err.size:
        with np.errstate(invalid="ignore", divide="ignore"):
            excess = err - bound_arr  # NaN only for an infinite error past an infinite bound
            i = np.unravel_index(int(np.argmax(np.where(np.isnan(excess), np.inf, excess))),
                                 err.shape)
            agree = err == 0
            abs_err = np.where(agree, 0.0, diff)
            m.max_abs = _largest(abs_err)
            m.max_rel = _largest(np.where(agree, 0.0, abs_err / np.abs(ref)))
        m.max_ulp, m.bound_ulp = float(err[i]), float(bound_arr[i])
        m.worst = {"quantity": quantity, "what": what, "index": [int(k) for k in i],
                   "expected": fmt(ref[i], dtype), "got": fmt(got[i], dtype),
                   "ulp": m.max_ulp, "bound": m.bound_ulp}
        if not err[i] <= bound_arr[i]:
            raise CheckFailure(
                f"got {what}[{', '.join(map(str, i))}] = {fmt(got[i], dtype)}, but the spec "
                f"says {fmt(ref[i], dtype)} ({m.max_ulp:.3g} ULPs of {np.dtype(dtype).name} "
                f"at scale, bound {m.bound_ulp:.3g}) [{call}]", measure=m)
    return m


def assert_holds(*, condition: bool, got: str, spec_says: str, call: str) -> None:
    """A yes/no property of the spec (an error raised, a value that must change)."""
    if not condition:
        raise CheckFailure(f"got {got}, but the spec says {spec_says} [{call}]")


def assert_differs(*, first, second, dtype, scale, at_least: float, what: str, call: str) -> None:
    """The spec says two results differ (B1 for RMSNorm, B4, B7): some element must be
    more than `at_least` ULPs (at scale) apart, so rounding cannot be mistaken for it."""
    err = error_ulps(expected=np.asarray(first, dtype=np.float64), actual=np.asarray(second),
                     dtype=dtype, scale=scale)
    biggest = float(np.max(err)) if err.size else 0.0
    assert_holds(condition=biggest > at_least,
                 got=f"{what} equal up to {biggest:.3g} ULPs",
                 spec_says=f"they differ by more than {at_least:.3g} ULPs", call=call)


__all__ = ["CheckFailure", "Measure", "assert_conforms", "assert_differs", "assert_holds",
           "error_ulps", "fmt", "tolerances"]
