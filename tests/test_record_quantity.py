"""The comparison that failed decides a failing record's quantity (which deviation
entries match), even when a declared convention explained a larger miss before it."""

from __future__ import annotations

import numpy as np
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
