"""A red team's backends that break the protocol's promises about what an op returns, or
offer only some ops: each gets the record its behaviour deserves, a protocol fail naming
what came back or an unsupported one, never an error from the harness's own code or a
pass."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from normspec.conformance import runner
from normspec.conformance.checks import all_checks
from normspec.impls.numpy_ref import NumpyBackend
from normspec.impls.protocol import Capabilities, Result
from normspec.impls.registry import LoadedBackend

CHECKS = {c.id: c for c in all_checks()}


def run(backend, check_id, dtype):
    loaded = LoadedBackend(backend.name, "tests", backend=backend)
    return runner.run_check(loaded, CHECKS[check_id], dtype, seed=0, examples=3, timeout=60.0)


class BatchNormOnly(NumpyBackend):
    capabilities = Capabilities(ops={"batch_norm"}, dtypes={"float32", "float64"},
                                gradients={"batch_norm"})


class SoftcapOnly(NumpyBackend):
    capabilities = Capabilities(ops={"softcap"}, dtypes={"float32", "float64"})


@pytest.mark.parametrize("backend, check_id, dtype", [
    (BatchNormOnly(), "protocol.parameter_dtype", "float64"),
    (SoftcapOnly(), "protocol.shape_dtype_inputs", "float32"),
    (SoftcapOnly(), "protocol.eps_zero", "float64"),
])
def test_a_backend_without_the_ops_a_protocol_check_drives_is_unsupported_there(
        backend, check_id, dtype):
    """A correct backend offering only BatchNorm (or softcap) got "the check produced no
    result (a defect in normspec)", an error that failed its run."""
    records = run(backend, check_id, dtype)
    assert [r.status for r in records] == ["unsupported"], [(r.status, r.message) for r in records]
    assert "capabilities do not list" in records[0].message


class BareLayerNorm(NumpyBackend):
    """layer_norm returns its output array, not a Result."""

    def layer_norm(self, *args, **kwargs):
        return super().layer_norm(*args, **kwargs).output


class ResultScores(NumpyBackend):
    """qk_norm_scores returns a Result, not the scores array."""

    def qk_norm_scores(self, *args, **kwargs):
        return Result(super().qk_norm_scores(*args, **kwargs))


class MatrixLayerNorm(NumpyBackend):
    """layer_norm's output as an np.matrix (an ndarray subclass) where it is 2-D."""

    def layer_norm(self, *args, **kwargs):
        res = super().layer_norm(*args, **kwargs)
        out = res.output
        if out.ndim != 2:
            return res
        with warnings.catch_warnings():  # (NumPy discourages the class)
            warnings.simplefilter("ignore", PendingDeprecationWarning)
            return res._replace(output=np.asmatrix(out))


class FirstRowOnly(NumpyBackend):
    """layer_norm and rms_norm return the first row alone for a 2-row float64 input."""

    def layer_norm(self, x, *args, **kwargs):
        res = super().layer_norm(x, *args, **kwargs)
        return res._replace(output=res.output[:1]) if x.shape == (2, 2) else res

    def rms_norm(self, x, *args, **kwargs):
        res = super().rms_norm(x, *args, **kwargs)
        return res._replace(output=res.output[:1]) if x.shape == (2, 2) else res


@pytest.mark.parametrize("backend, check_id, dtype, says", [
    (BareLayerNorm(), "F2.values", "float32", "with no .output, but the protocol says a Result"),
    (ResultScores(), "F6.values", "float32", "got output = a Result, but the protocol says a "
                                             "NumPy array"),
    (MatrixLayerNorm(), "F2.values", "float32", "numpy.matrix"),
    (FirstRowOnly(), "protocol.parameter_dtype", "float64", "of shape (1, 2)"),
])
def test_an_op_returning_the_wrong_kind_is_a_protocol_failure(backend, check_id, dtype, says):
    """Found by a red team: a bare array from layer_norm was an AttributeError error, a
    Result from qk_norm_scores a ValueError, an np.matrix passed the output check and
    broke the checks' arithmetic later, and protocol.parameter_dtype read an output of
    the wrong shape as an answer."""
    records = run(backend, check_id, dtype)
    failed = [r for r in records if r.status == "fail"]
    assert failed and not any(r.status == "error" for r in records), \
        [(r.status, r.message[:120]) for r in records]
    assert all(r.quantity == "protocol" for r in failed), [r.quantity for r in failed]
    assert any(says in r.message for r in failed), failed[0].message
