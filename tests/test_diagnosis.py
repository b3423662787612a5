"""Diagnosis names the bug: each named formula variant, run as a broken backend, fails
and is diagnosed by its id; a random error is "unexplained"; a passing case is never
diagnosed; the diagnosis reaches the record, the results file, the console line and the
report's finding."""

from __future__ import annotations

import io

import broken_backends as bb
import numpy as np
import pytest
from normspec.conformance import cli, results
from normspec.conformance.cases import ArraySpec
from normspec.conformance.context import Context
from normspec.conformance.diagnosis import summary
from normspec.conformance.ops import BatchNormDriver, layer_norm_case, rms_norm_case
from normspec.impls.numpy_ref import NumpyBackend
from normspec.impls.protocol import np_dtype
from normspec.spec.variants import VARIANTS
from variant_backends import RandomError, ReorderedOnePass, RowScaleError, variant_backend


def _ln(x, d, **kw):
    return lambda ctx: layer_norm_case(ctx, x=x, normalized_shape=(d,),
                                       weight=ArraySpec((d,), 11, 1.0, 0.5),
                                       bias=ArraySpec((d,), 12, 0.0, 0.5), **kw)


def _rms(x, d, weight=None, **kw):
    return lambda ctx: rms_norm_case(ctx, x=x, normalized_shape=(d,),
                                     weight=weight or ArraySpec((d,), 11, 1.0, 0.5), **kw)


def _bn(x, *, grad=None):
    def body(ctx):
        c = x.shape[1]
        driver = BatchNormDriver(ctx, c, momentum=0.1, weight=ArraySpec((c,), 7, 1.0, 0.5),
                                 bias=ArraySpec((c,), 8, 0.0, 0.5))
        driver.step("x", x, mode="train", grad=grad)
    return body


GRAD64 = ArraySpec((3, 64), 5, 0.0, 1.0)
#: variant id -> (dtype, precision keywords, a case on which it misses the oracle)
CASES = {
    "ln.one_pass_variance": ("float32", {"compute_dtype": np.float32},
                             _ln(ArraySpec((3, 256), 0, 300.0, 0.05), 256)),
    "ln.eps_outside_sqrt": ("float32", {}, _ln(ArraySpec((3, 64), 0, 0.0, 0.01), 64, eps=1e-2)),
    "ln.unbiased_std": ("float32", {}, _ln(ArraySpec((3, 64), 0, 0.0, 0.01), 64, eps=1e-2)),
    "ln.unbiased_var": ("float32", {}, _ln(ArraySpec((3, 8), 0, 0.0, 1.0), 8)),
    "ln.padded_lanes_in_variance": ("float32", {}, _ln(ArraySpec((3, 17), 0, 3.0, 1.0), 17)),
    "ln.vjp_constant_statistics": ("float32", {},
                                   _ln(ArraySpec((3, 64), 0, 1.0, 2.0), 64, grad=GRAD64)),
    "rms.centred": ("float32", {}, _rms(ArraySpec((3, 64), 0, 2.0, 1.0), 64)),
    "rms.one_plus_weight": ("float32", {}, _rms(ArraySpec((3, 64), 0, 0.0, 1.0), 64)),
    "rms.one_plus_weight_in_half": ("bfloat16", {},
                                    _rms(ArraySpec((3, 64), 0, 0.0, 1.0), 64,
                                         weight=ArraySpec((64,), 11, 15.0, 2.0))),
    "rms.sum_of_squares_in_half": ("float16", {"compute_dtype": np.float16},
                                   _rms(ArraySpec((3, 512), 0, 1000.0, 30.0), 512)),
    "rms.vjp_weight_twice": ("float32", {}, _rms(ArraySpec((3, 64), 0, 0.0, 1.0), 64,
                                                 grad=GRAD64)),
    "bn.biased_running_var": ("float32", {}, _bn(ArraySpec((4, 3), 0, 1.0, 2.0))),
    "bn.momentum_on_old": ("float32", {}, _bn(ArraySpec((4, 3), 0, 1.0, 2.0))),
    "bn.one_pass_variance": ("float32", {"compute_dtype": np.float32},
                             _bn(ArraySpec((64, 3), 0, 300.0, 0.05))),
    "bn.vjp_constant_statistics": ("float32", {},
                                   _bn(ArraySpec((4, 3, 5), 0, 1.0, 2.0),
                                       grad=ArraySpec((4, 3, 5), 1, 0.0, 1.0))),
}
#: variants no comparison can fail on: their error is within the tolerance by
#: construction, so there is never a failure to diagnose
WITHIN_BOUND = {
    "rms.half_cast_before_weight": (
        "bfloat16", {}, _rms(ArraySpec((3, 64), 0, 0.0, 1.0), 64,
                             weight=ArraySpec((64,), 11, 1.0, 0.5)),
        "one extra rounding of x_hat to bfloat16 moves the output by at most one ULP, "
        "which the bound (1 ULP plus the compute error) allows"),
}


def _record(backend, dtype, body, name="case"):
    ctx = Context(backend_name=backend.name, source="tests", backend=backend,
                  check_id="diagnosis", claim="F2", op="op", dtype=np_dtype(dtype), seed=0,
                  examples=1, conventions=backend.conventions)
    with np.errstate(all="ignore"), ctx.case(name):
        body(ctx)
    return ctx.records[-1]


#: the spec's own formula summed serially: within the bound below the emulation's limit
#: (MAX_EMULATED_LENGTH), so shown where it is not, by its envelope
SERIAL = {
    "ln.serial_sum": _ln(ArraySpec((2, 131072), 1, 1.0, 1.0), 131072),
    "bn.serial_sum": _bn(ArraySpec((131072, 2), 0, 1.0, 1.0)),
}


def test_every_variant_is_covered():
    assert not set(CASES) & set(WITHIN_BOUND)
    assert set(CASES) | set(WITHIN_BOUND) | set(SERIAL) == {v.id for v in VARIANTS}


@pytest.mark.parametrize(("body", "variant_id"), [
    (_bn(ArraySpec((8192, 2), 0, 30.0, 1.0)), "bn.one_pass_variance"),
    (_ln(ArraySpec((2, 8192), 0, 300.0, 1.0), 8192), "ln.one_pass_variance"),
    (_bn(ArraySpec((65536, 2), 0, 1000.0, 1.0)), "bn.one_pass_variance")])
def test_a_one_pass_variance_is_never_called_a_summation_order(body, variant_id):
    """With the worst-case serial envelope (n u), whose dm^2 reaches any variance at
    n^2 u > 1, these real one-pass variances were diagnosed as serial sums (found by a
    review); the serial envelope is the probabilistic one now."""
    import broken_backends as bb

    rec = _record(bb.NaiveVariance(), "float32", body)
    assert rec.status == "fail"
    assert variant_id in rec.diagnosis["matches"], rec.diagnosis
    assert not any(m.endswith("serial_sum") for m in rec.diagnosis["matches"]), rec.diagnosis


@pytest.mark.parametrize("variant_id", sorted(SERIAL))
def test_a_serial_sum_is_diagnosed_as_the_order_not_as_another_formula(variant_id):
    """A kernel that sums a long row or channel serially misses the tree-reduction bound;
    its implied statistics lie within the one-pass variance's envelope too, which was
    what the diagnosis named (found by a review)."""
    rec = _record(variant_backend(variant_id, compute_dtype=np.float32)(), "float32",
                  SERIAL[variant_id])
    assert rec.status == "fail", rec.message
    assert rec.diagnosis["matches"] == [variant_id], rec.diagnosis
    assert rec.diagnosis["within_envelope"] == [variant_id]


@pytest.mark.parametrize("variant_id", sorted(CASES))
def test_each_variant_is_diagnosed_by_name(variant_id):
    dtype, kwargs, body = CASES[variant_id]
    rec = _record(variant_backend(variant_id, **kwargs)(), dtype, body)
    assert rec.status == "fail", rec.message  # a matched variant is still a fail
    assert variant_id in rec.diagnosis["matches"], (rec.message, rec.diagnosis)
    assert summary(rec.diagnosis).startswith("matches: ")


@pytest.mark.parametrize("variant_id", sorted(WITHIN_BOUND))
def test_variants_within_the_bound_never_fail(variant_id):
    dtype, kwargs, body, _why = WITHIN_BOUND[variant_id]
    rec = _record(variant_backend(variant_id, **kwargs)(), dtype, body)
    assert rec.status == "pass" and rec.diagnosis == {}


def test_a_random_error_is_unexplained():
    rec = _record(RandomError(), "float32", CASES["ln.padded_lanes_in_variance"][2])
    assert rec.status == "fail"
    assert rec.diagnosis["matches"] == [] and "ln.eps_outside_sqrt" in rec.diagnosis["tried"]
    assert summary(rec.diagnosis).startswith("unexplained")


def test_a_one_pass_variance_summed_in_another_order_matches_within_its_envelope():
    """The rounding noise of a cancelling E[x^2] - E[x]^2 depends on the summation order,
    which no emulation reproduces; the statistics the output implies still lie within the
    variant's envelope, and the diagnosis says that is how it matched."""
    rec = _record(ReorderedOnePass(), "float32", CASES["ln.one_pass_variance"][2])
    assert rec.status == "fail"
    assert rec.diagnosis["matches"] == ["ln.one_pass_variance"] == rec.diagnosis["within_envelope"]
    assert "within its rounding envelope" in summary(rec.diagnosis)


@pytest.mark.parametrize(("mean", "factor"), [(0.0, 1.001), (300.0, 8.0)])
def test_a_per_row_error_beyond_the_envelope_is_unexplained(mean, factor):
    rec = _record(RowScaleError(factor), "float32", _ln(ArraySpec((3, 256), 0, mean, 1.0), 256))
    assert rec.status == "fail"
    assert rec.diagnosis["matches"] == [] and summary(rec.diagnosis).startswith("unexplained")


def test_the_existing_broken_backends_are_named():
    """Broken backends written by hand (not from the catalogue) are recognised too."""
    rec = _record(bb.PaddedLanes(), "float32", CASES["ln.padded_lanes_in_variance"][2])
    assert rec.diagnosis["matches"] == ["ln.padded_lanes_in_variance"]
    rec = _record(bb.StatsConstantGrad(), "float32", CASES["bn.vjp_constant_statistics"][2])
    assert rec.diagnosis["matches"] == ["bn.vjp_constant_statistics"]


def test_a_passing_case_is_not_diagnosed():
    rec = _record(NumpyBackend(), "float32", CASES["ln.eps_outside_sqrt"][2])
    assert rec.status == "pass" and rec.diagnosis == {}


def test_diagnosis_reaches_the_file_the_console_and_the_report(tmp_path):
    rec = _record(variant_backend("ln.eps_outside_sqrt")(), "float32",
                  CASES["ln.eps_outside_sqrt"][2])
    doc = results.new_document()
    doc["backends"].append({"name": rec.backend, "available": True, "run": "r", "version": "0"})
    doc["runs"].append({"run": "r"})
    doc["records"].append(rec.to_json())
    back = results.read(results.write(doc, tmp_path / "r.json"))["records"][0]
    assert back["diagnosis"]["matches"][0] == "ln.eps_outside_sqrt"
    out = io.StringIO()
    cli.print_summary(back and results.read(tmp_path / "r.json"), out)
    line = [ln for ln in out.getvalue().splitlines() if "[fail]" in ln][0]
    assert "diagnosis: matches: ln.eps_outside_sqrt (eps added to the standard deviation" in line
    from normspec.reports import html
    page = html.render([results.read(tmp_path / "r.json")])
    assert "Diagnosis" in page and "ln.eps_outside_sqrt" in page and "CNTK #3816" in page


def test_old_files_without_diagnosis_read():
    old = {"backend": "b", "check": "c", "claim": "F2", "op": "o", "dtype": "float32",
           "case": "x", "status": "fail"}
    assert results.record_from_json(old).diagnosis == {}
