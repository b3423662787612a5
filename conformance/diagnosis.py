"""Diagnosis that names the bug: for a comparison that failed, which of the formula
variants real code ships (spec/variants.py) the backend's output does conform to.

An op routine knows its inputs; it hands `Context.conforms` an `Alternatives` that says
how to recompute the compared quantity under any function with the oracle op's
signature (and, for a normalized output, the inputs that let the statistics the output
implies be fitted: a variant whose rounding noise no emulation reproduces, such as a
one-pass variance summed in a kernel's own order, matches when those statistics lie
within its envelope and explain the output; only when no variant matches outright).
Only when the comparison fails does the context evaluate each variant of that op and
compare the backend's output with it, under the same scale and bound. The answer
("matches: ln.eps_outside_sqrt ..." or "unexplained ...") goes into the record.

This is diagnosis, never a verdict: a record whose output matches a variant is still a
fail (or a deviation, where a declaration or a deviations entry says so).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from normspec.impls.protocol import HALF_DTYPES, compute_dtype
from normspec.spec.rounding import unit_roundoff
from normspec.spec.variants import variants_for

from .assertions import error_ulps

#: A precision variant emulates its narrow arithmetic one addition at a time (a Python
#: loop over the reduced length): longer reductions are not tried, and the diagnosis says
#: so, to keep a failing 131072-sample BatchNorm from costing seconds.
MAX_EMULATED_LENGTH = 8192
#: Precision variants: (keyword, how to set it for the dtype under test). "compute": the
#: compute precision of that dtype (float32 for the half dtypes); "half": the dtype under
#: test itself, and only a half dtype (the variant is about arithmetic in it).
PRECISION = {
    "ln.one_pass_variance": ("compute_dtype", "compute"),
    "bn.one_pass_variance": ("compute_dtype", "compute"),
    "rms.sum_of_squares_in_half": ("compute_dtype", "half"),
    "rms.one_plus_weight_in_half": ("dtype", "half"),
    "rms.half_cast_before_weight": ("dtype", "half"),
}


@dataclass(frozen=True)
class Alternatives:
    """How to recompute one compared quantity under a variant: `recompute(fn)` calls
    `fn` (a function with the signature of the oracle op `op`) on the case's inputs;
    `pick` selects the compared field of a tuple result (the VJPs' (dx, dgamma, dbeta),
    BatchNorm's (y, running_mean, running_var)). `length`: how many values each
    statistic reduces (d, or BatchNorm's m), which bounds what emulation costs."""

    op: str
    recompute: Callable
    pick: int | None = None
    length: int | None = None
    #: for a normalized output: (x, reduced axes, weight, bias, eps), float64, weight
    #: and bias broadcastable to x (None: absent), so the statistics the backend's output
    #: implies can be judged against a variant's envelope
    statistics: tuple | None = None

    def value(self, fn):
        out = self.recompute(fn)
        return out if self.pick is None else out[self.pick]


def _bound_variant(v, dtype):
    """The variant's function with its precision keyword set for `dtype`, or None when
    the variant does not apply to `dtype`."""
    if v.id not in PRECISION:
        return v.fn
    keyword, how = PRECISION[v.id]
    if how == "half":
        if np.dtype(dtype).name not in HALF_DTYPES:
            return None
        return functools.partial(v.fn, **{keyword: np.dtype(dtype)})
    return functools.partial(v.fn, **{keyword: compute_dtype(dtype)})


def _conforms(expected, actual, dtype, scale, bound) -> bool:
    """Within the same bound as the failed comparison, at its scale or, where the
    variant's value is larger than that scale (momentum on the old value gives a running
    mean 9 times the oracle's), at the variant's own magnitude."""
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(actual)
    if expected.shape != actual.shape:
        return False
    with np.errstate(invalid="ignore"):
        scale = np.fmax(np.broadcast_to(np.asarray(scale, dtype=np.float64), expected.shape),
                        np.where(np.isfinite(expected), np.abs(expected), 0.0))
    err = error_ulps(expected=expected, actual=actual, dtype=dtype, scale=scale)
    return bool(np.all(err <= np.broadcast_to(np.asarray(bound, dtype=np.float64), err.shape)))


def implied_statistics(actual, x, axes, weight, bias, eps):
    """Per slice, the mean and variance under which the normalization reproduces
    `actual` best: y - beta = r gamma (x - mean) fitted by least squares in r and
    r * mean (two sums per slice), variance = 1 / r^2 - eps. Returns (mean, var, y_fit);
    NaN where the slice cannot tell them (one value, a zero gain)."""
    y = np.asarray(actual).astype(np.float64)
    w = np.broadcast_to(1.0 if weight is None else weight, x.shape)
    t = y - (0.0 if bias is None else bias)
    mu = np.mean(x, axis=axes, keepdims=True)  # centring first: well-conditioned sums
    a, c = w * (x - mu), w

    def s(u, v):
        return np.sum(u * v, axis=axes, keepdims=True)

    with np.errstate(all="ignore"):
        saa, sac, scc, sat, sct = s(a, a), s(a, c), s(c, c), s(a, t), s(c, t)
        det = saa * scc - sac * sac
        r = (sat * scc - sac * sct) / det
        p = (saa * sct - sac * sat) / det
        mean = mu - p / r
        var = 1.0 / (r * r) - eps
        y_fit = w * (x - mean) * r + (0.0 if bias is None else bias)
    return mean, var, y_fit


def _within_envelope(v, alternatives, actual, dtype, scale, bound) -> bool:
    """The backend's output is a normalization of x with statistics that lie within the
    variant's envelope of the exact ones, off by more than the normalization's own
    rounding in some slice (so the statistics, not the arithmetic after them, are what
    is wrong), and, with those statistics, within the failed comparison's bound: what a
    reordered, unreproducible sum of that variant gives."""
    x, axes, weight, bias, eps = alternatives.statistics
    mean, var, y_fit = implied_statistics(actual, x, axes, weight, bias, eps)
    dm, dv = v.envelope(x, axes, compute_dtype(dtype))
    exact_mean = np.mean(x, axis=axes, keepdims=True)
    exact_var = np.var(x, axis=axes, keepdims=True)
    # the normalization after the statistics rounds too: rsqrt and the products in the
    # compute dtype (a few units, counted generously), the output in the dtype (the
    # fitted scale inherits up to its unit): relative to the variance plus eps
    rel = 16 * unit_roundoff(compute_dtype(dtype)) + 4 * unit_roundoff(dtype)
    slack_v = rel * (exact_var + eps)
    slack_m = rel * np.sqrt(exact_var + eps)
    with np.errstate(invalid="ignore"):
        off_v, off_m = np.abs(var - exact_var), np.abs(mean - exact_mean)
        within = np.all(off_m <= dm + slack_m) and np.all(off_v <= dv + slack_v)
        beyond_rounding = np.any((off_v > slack_v) | (off_m > slack_m))
    return bool(within and beyond_rounding) and _conforms(y_fit, actual, dtype, scale, bound)


def matching_variants(alternatives: Alternatives, *, actual, dtype, scale, bound):
    """(variants whose value the output conforms to, those tried, those too costly, and
    those it is consistent with only within their envelope). Envelopes are consulted
    only when no variant matches outright."""
    matches, tried, skipped = [], [], []
    for v in variants_for(alternatives.op):
        fn = None if v.order_only else _bound_variant(v, dtype)
        if fn is None:
            # (an order-only variant is the spec's formula in one serial order: matching
            # that order outright says little (an overflowing float32 sum of x matches in
            # any order); its envelope, below, is what names it)
            continue
        if v.id in PRECISION and (alternatives.length or 0) > MAX_EMULATED_LENGTH:
            skipped.append(v)
            continue
        try:
            with np.errstate(all="ignore"):
                expected = alternatives.value(fn)
        except (ValueError, TypeError):  # the variant has no value here (d = 1, momentum None)
            continue
        tried.append(v)
        if _conforms(expected, actual, dtype, scale, bound):
            matches.append(v)
    enveloped = []
    if not matches and alternatives.statistics is not None and alternatives.pick in (None, 0):
        enveloped = [v for v in variants_for(alternatives.op) if v.envelope is not None
                     and _within_envelope(v, alternatives, actual, dtype, scale, bound)]
        # the spec's own formula summed in another order (an order-only variant) explains
        # it: then no other formula is named for what the order did
        # (found by a review: a serial two-pass sum was diagnosed as a one-pass variance)
        order_only = [v for v in enveloped if v.order_only]
        enveloped = order_only or enveloped
    return matches, tried, skipped, enveloped


def diagnose(alternatives: Alternatives, *, actual, dtype, scale, bound) -> dict:
    """The record's diagnosis of a failed comparison, as data: the op whose variants were
    tried, the ids that matched and those tried, and each match's description and where
    it is seen. No match is "unexplained" (`summary` says so)."""
    matches, tried, skipped, enveloped = matching_variants(
        alternatives, actual=actual, dtype=dtype, scale=scale, bound=bound)
    return {"op": alternatives.op, "matches": [v.id for v in matches + enveloped],
            "tried": [v.id for v in tried], "skipped": [v.id for v in skipped],
            "within_envelope": [v.id for v in enveloped],
            "details": {v.id: {"description": v.description, "seen_in": v.seen_in}
                        for v in matches + enveloped}}


def summary(diagnosis: dict | None) -> str:
    """One line: "matches: ln.eps_outside_sqrt (eps added to ...)", "unexplained (tried:
    ...)", or "" for a record that was not diagnosed."""
    if not diagnosis:
        return ""
    matches = diagnosis.get("matches") or []
    if matches:
        details = diagnosis.get("details") or {}
        loose = set(diagnosis.get("within_envelope") or ())
        return "matches: " + "; ".join(
            (f"{m} ({details[m]['description']})" if m in details else m)
            + (" [within its rounding envelope: the statistics the output implies lie "
               "within what that formula gives in some summation order]" if m in loose else "")
            for m in matches)
    tried, skipped = diagnosis.get("tried") or [], diagnosis.get("skipped") or []
    text = "unexplained (" + (f"tried {', '.join(tried)}" if tried else
                              f"no variant of {diagnosis.get('op', '?')} in the catalogue "
                              "applies")
    if skipped:
        text += f"; not tried, reductions longer than {MAX_EMULATED_LENGTH}: {', '.join(skipped)}"
    return text + ")"
