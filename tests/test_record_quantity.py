"""The comparison that failed decides a failing record's quantity (which deviation
entries match), even when a declared convention explained a larger miss before it."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
from normspec.conformance import deviations
from normspec.conformance.context import Context
from normspec.impls.numpy_ref import NumpyBackend
from normspec.impls.protocol import Conventions, np_dtype


def test_the_failed_comparison_decides_the_quantity():
    backend = NumpyBackend()
    ctx = Context(backend_name="b", source="tests", backend=backend, check_id="c", claim="F5",
                  op="batch_norm", dtype=np_dtype("float32"), seed=0, examples=1,
                  conventions=Conventions(running_var_estimator="biased"))
    one = np.ones(4)
    with ctx.case("explained miss, then a real one"):
        ctx.conforms(expected=one, actual=np.full(4, 2.0, np.float32), scale=one, bound=1.0,
                     quantity="batch_norm.running_var", call="c",
                     explained=[(np.full(4, 2.0), "running_var_estimator")])
        ctx.conforms(expected=one, actual=np.full(4, 1.001, np.float32), scale=one, bound=1.0,
                     quantity="batch_norm.eval.grad_bias", call="c")
    rec = ctx.records[-1]
    assert rec.status == "fail" and rec.quantity == "batch_norm.eval.grad_bias"
    assert rec.worst["quantity"] == "batch_norm.eval.grad_bias"


def test_a_yes_no_failure_takes_no_quantity_from_a_comparison_before_it():
    """A property that fails after a comparison passed: the record names no quantity and
    no ULPs, so a deviation entry scoped to the passing comparison's quantity cannot
    match it (an op/dtype-wide entry still can: its scope is everything)."""
    ctx = Context(backend_name="b", source="tests", backend=NumpyBackend(), check_id="c",
                  claim="B6", op="batch_norm", dtype=np_dtype("float16"), seed=0, examples=1,
                  conventions=Conventions())
    one = np.ones(4)
    with ctx.case("an output that agrees, then running statistics that moved in eval()"):
        ctx.conforms(expected=one, actual=np.ones(4, np.float16), scale=one, bound=1.0,
                     quantity="batch_norm.eval.output", call="c")
        ctx.holds(condition=False, got="running_mean changed", spec_says="unchanged", call="c")
    rec = ctx.records[-1]
    assert (rec.status, rec.quantity, rec.max_ulp) == ("fail", "", None)
    scoped = {"op": "batch_norm", "dtype": "float16", "quantity": "batch_norm.eval",
              "reason": "eval arithmetic in float16"}
    wide = {"op": "batch_norm", "dtype": "float16", "reason": "all of float16 BatchNorm"}
    assert not deviations.matches(scoped, asdict(rec))
    assert deviations.matches(wide, asdict(rec))
