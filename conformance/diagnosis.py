"""Diagnosis that names the bug: for a comparison that failed, which of the formula
variants real code ships (spec/variants.py) the backend's output does conform to.

An op routine knows its inputs; it hands `Context.conforms` an `Alternatives` that says
how to recompute the compared quantity under any function with the oracle op's
signature. Only when the comparison fails does the context evaluate each variant of that
op and compare the backend's output with it, under the same scale and bound. The answer
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


def matching_variants(alternatives: Alternatives, *, actual, dtype, scale, bound):
    """(variants whose value the output conforms to, those tried, those too costly)."""
    matches, tried, skipped = [], [], []
    for v in variants_for(alternatives.op):
        fn = _bound_variant(v, dtype)
        if fn is None:
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
    return matches, tried, skipped


def diagnose(alternatives: Alternatives, *, actual, dtype, scale, bound) -> dict:
    """The record's diagnosis of a failed comparison, as data: the op whose variants were
    tried, the ids that matched and those tried, and each match's description and where
    it is seen. No match is "unexplained" (`summary` says so)."""
    matches, tried, skipped = matching_variants(alternatives, actual=actual, dtype=dtype,
                                                scale=scale, bound=bound)
    return {"op": alternatives.op, "matches": [v.id for v in matches],
            "tried": [v.id for v in tried], "skipped": [v.id for v in skipped],
            "details": {v.id: {"description": v.description, "seen_in": v.seen_in}
                        for v in matches}}


def summary(diagnosis: dict | None) -> str:
    """One line: "matches: ln.eps_outside_sqrt (eps added to ...)", "unexplained (tried:
    ...)", or "" for a record that was not diagnosed."""
    if not diagnosis:
        return ""
    matches = diagnosis.get("matches") or []
    if matches:
        details = diagnosis.get("details") or {}
        return "matches: " + "; ".join(
            f"{m} ({details[m]['description']})" if m in details else m for m in matches)
    tried, skipped = diagnosis.get("tried") or [], diagnosis.get("skipped") or []
    text = "unexplained (" + (f"tried {', '.join(tried)}" if tried else
                              f"no variant of {diagnosis.get('op', '?')} in the catalogue "
                              "applies")
    if skipped:
        text += f"; not tried, reductions longer than {MAX_EMULATED_LENGTH}: {', '.join(skipped)}"
    return text + ")"
