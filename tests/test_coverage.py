"""Every parameter of every op is varied by some check (a backend that ignores a parameter
no check varies would conform), and docs/coverage.md is the table the code generates now.
The definition of "varied" is conformance/coverage.py's docstring."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from normspec.conformance import coverage
from normspec.impls.protocol import Backend, BatchNormLayer
from oracle_backend import OracleBackend

DOC = Path(__file__).resolve().parents[1] / "docs" / "coverage.md"
PARAMETERS = [(op, p.name) for op, ps in coverage.protocol_parameters().items() for p in ps]


@pytest.fixture(scope="module")
def measured():
    return coverage.measure(OracleBackend())


def test_every_check_passed_so_nothing_was_cut_short(measured):
    # a failing example ends a Hypothesis search early and would hide variation
    assert [] == measured.problems


@pytest.mark.parametrize("op,name", PARAMETERS, ids=[f"{op}.{name}" for op, name in PARAMETERS])
def test_parameter_is_varied_by_some_check(measured, op, name):
    assert measured.varied_by(op, name), (
        f"no check varies {op}({name}=...): every check passes it "
        f"{coverage._summary(measured.all_values(op, name))}, so a backend that ignores "
        f"{name} conforms; add a case that passes another value")


def test_committed_table_is_what_the_code_generates(measured):
    assert DOC.read_text(encoding="utf-8") == coverage.render(measured), (
        f"docs/coverage.md is stale; regenerate it with `{coverage.COMMAND}`")


def test_parameters_come_from_the_signatures():
    class Extended(Backend):
        def softcap(self, scores, cap, *, mode="tanh"):
            raise NotImplementedError

    class Layer(BatchNormLayer):
        def forward(self, x, grad_output=None, *, step=0):
            raise NotImplementedError

    params = coverage.protocol_parameters(Extended, Layer)
    names = {op: [p.name for p in ps] for op, ps in params.items()}
    assert names["softcap"] == ["scores", "cap", "mode"]
    assert names["BatchNormLayer.forward"] == ["x", "grad_output", "step"]
    assert names["batch_norm"] == ["num_features", "eps", "momentum", "affine",
                                   "track_running_stats", "dtype", "weight", "bias"]
    assert "BatchNormLayer.train" not in names  # no arguments, nothing to vary


def _cov(values):
    return coverage.Coverage(backend="b", parameters={"op": ("p",)}, checks=["A", "B", "C"],
                             values={("op", "p"): values}, problems=[])


@pytest.mark.parametrize("values,varied", [
    ({"A": {"1"}, "B": {"1"}}, []),  # one value everywhere: not varied
    ({"A": {"1", "2"}, "B": {"1"}}, ["A"]),  # two values in one check
    ({"A": {"1"}, "B": {"2"}, "C": {"2"}}, ["A"]),  # a value only A passes, others pass another
    ({"A": {"30"}}, []),  # the only check, one value: unique but not variation
])
def test_the_definition_of_varied(values, varied):
    assert _cov(values).varied_by("op", "p") == varied


def test_values_are_compared_as_a_backend_sees_them():
    q = np.zeros((2, 3, 64))
    v = coverage.value_of
    assert v("qk_norm_scores", "scale", 0.125, {"q": q}) == "1/sqrt(d_k)"
    assert v("qk_norm_scores", "scale", 1.0, {"q": q}) == "8/sqrt(d_k)"
    assert v("layer_norm", "weight", np.ones(4), {}) == v("layer_norm", "weight", None, {})
    assert v("layer_norm", "bias", np.zeros(4), {}) == "None"
    assert v("layer_norm", "x", np.ones(4), {}) != v("layer_norm", "x", np.ones(5), {})
    assert v("layer_norm", "normalized_shape", (3, 5), {}) == "2 axes"
    assert v("batch_norm", "dtype", np.dtype("float32"), {}) == "float32"


def test_a_backend_that_does_not_claim_everything_is_refused():
    from normspec.impls.numpy_ref import NumpyBackend

    with pytest.raises(ValueError, match="no_grad_mode"):
        coverage.measure(NumpyBackend())


def test_only_guarded_calls_count():
    # a call outside Context.call (no check's comparison behind it) records nothing
    rec = coverage.Recording(parameters=coverage.protocol_parameters())
    backend = coverage.RecordingBackend(OracleBackend(), rec)
    backend.softcap(np.ones(3, np.float32), 5.0)
    assert {} == rec.values
