"""B9's declarations, both ways round, and the broken backends' own mechanics: a declared
`batch_invariant = False` / `deterministic = False` turns the records it explains into
deviations with the reason; declared False where the bits agree passes and says so; the
truncating encoder really truncates."""

from __future__ import annotations

import broken_backends as bb
import ml_dtypes
import numpy as np
import pytest
from test_harness_catches import run


def test_declared_not_batch_invariant_is_a_deviation_with_its_reason():
    records = run(bb.DeclaresNotBatchInvariant(), "B9.layer_norm", "float32")
    long_row = [r for r in records if "70003" in r.case]
    assert {"deviation"} == {r.status for r in long_row}
    assert "split reduction" in long_row[0].reason
    assert "first differing batch size" in long_row[0].message


def test_undeclared_batch_dependence_fails_and_says_where():
    records = run(bb.SwitchesStrategyWithBatch(), "B9.batch_norm_eval", "float32")
    assert [r.status for r in records] == ["fail"]
    assert "a batch of 3 (the first differing batch size)" in records[0].message
    assert records[0].max_ulp > 0 and records[0].bound_ulp == 0


def test_declared_false_but_invariant_passes_and_says_so():
    for check_id in ("B9.layer_norm", "B9.deterministic"):
        records = run(bb.DeclaresButIsInvariant(), check_id, "float32")
        assert {"pass"} == {r.status for r in records}
        assert all("declaration is not needed" in r.message for r in records)


def test_declared_nondeterministic_is_a_deviation():
    records = run(bb.DeclaresNondeterministic(), "B9.deterministic", "float32")
    assert {"deviation"} == {r.status for r in records}
    assert all("atomic adds" in r.reason for r in records)


def test_the_first_row_of_a_batch_is_the_row_alone_for_a_carried_compensation():
    records = run(bb.CarriesCompensation(), "B9.rms_norm", "float32")
    assert {"fail"} == {r.status for r in records}
    assert all("row 0 " not in r.message for r in records)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_truncate_to_rounds_toward_zero(dtype):
    a = np.random.default_rng(0).normal(0, 3, 10_000).astype(np.float32)
    t = bb.truncate_to(a, dtype).astype(np.float32)
    near = a.astype(dtype).astype(np.float32)
    assert np.all(np.abs(t) <= np.abs(a))
    assert np.all(np.sign(t) * np.sign(a) >= 0)
    # one step below the nearest wherever the nearest rounded away, the nearest elsewhere
    assert np.all((t == near) | (np.abs(near) > np.abs(a)))
    assert 0.3 < np.mean(t != near) < 0.7


@pytest.mark.parametrize("check_id", ["B9.rms_norm", "B9.batch_norm_eval"])
def test_a_strategy_switch_at_512_rows_shows_in_the_batch_of_1024_alone(check_id):
    """(LayerNorm's probe row happens to round alike both ways at d = 100: its switch at 2
    rows is what test_harness_catches shows B9.layer_norm catching. Among the sample's
    cases, that is: the rows of a batch of 4099 differ from the same rows in the batches
    of 1024 and 3 that it is compared with.)"""
    records = [r for r in run(bb.SwitchesStrategyFrom512(), check_id, "float32")
               if r.status != "pass" and r.case.startswith("one sample")]
    assert len(records) == 1 and "batch sizes that differ: 1024," in records[0].message


def test_a_reused_output_buffer_cannot_hide_nondeterminism():
    """The harness keeps copies of what a call returned: the second call's bits written
    into the first's buffer do not make the two agree."""
    records = run(bb.ReusesOutputBuffer(), "B9.deterministic", "float32")
    failing = {r.op for r in records if r.status == "fail"}
    assert {"layer_norm", "rms_norm"} <= failing


@pytest.mark.parametrize("check_id", ["B9.layer_norm", "B9.rms_norm"])
def test_a_split_reduction_from_2048_rows_shows_in_every_row_of_4099(check_id):
    """A switch at 2048 rows leaves the sample alone and in batches of up to 1024 alike;
    the batch of 4099 shows it, in many of its rows (a red team's split-row reduction
    left the one sample's float32 bits alone at that size)."""
    records = [r for r in run(bb.SwitchesStrategyFrom2048(), check_id, "float32")
               if r.status != "pass"]
    assert [r.case.split(" against")[0] for r in records] == ["every row of a batch of 4099"]
    assert records[0].max_ulp > 0 and records[0].bound_ulp == 0
    rows = int(records[0].message.split("got not batch-invariant: ")[1].split(" of")[0])
    assert rows > 100, records[0].message


def test_atomics_from_1024_rows_show_in_the_gradients_of_4099_rows():
    failing = [r.case for r in run(bb.AtomicParamGradSumsFrom1024(), "B9.deterministic",
                                   "float32") if r.status != "pass"]
    assert failing and all("a batch of 4099" in case for case in failing)
    assert {c.split(":")[0] for c in failing} == {
        "layer_norm", "rms_norm", "fused_add_norm with layer_norm",
        "fused_add_norm with rms_norm"}


@pytest.mark.parametrize(("broken", "check_id"), [
    (bb.FusedRmsSwitchesStrategy, "B9.fused_add_norm"),
    (bb.FusedRmsAtomicParamGradSums, "B9.deterministic")])
def test_the_fused_add_rms_norm_is_run_on_its_own(broken, check_id):
    """vLLM #48271's switch, and atomic dL/dgamma, in the fused add + RMSNorm kernel
    alone: its cases fail, the fused add + LayerNorm's pass."""
    records = [r for r in run(broken(), check_id, "float32") if r.op == "fused_add_norm"]
    failing = {r.case.split(":")[0] for r in records if r.status != "pass"}
    assert failing in ({"rms_norm"}, {"fused_add_norm with rms_norm"}), failing
    assert any("layer_norm" in r.case and r.status == "pass" for r in records)


def test_a_backend_with_fewer_max_rows_records_the_large_batch_unsupported():
    """The Triton interpreter declares max_rows = 4096: the 4099-row cases are recorded
    unsupported with its reason, and the rest still run."""
    import dataclasses

    from normspec.impls.numpy_ref import NumpyBackend

    class FewRows(NumpyBackend):
        capabilities = dataclasses.replace(NumpyBackend.capabilities, max_rows=4096,
                                           max_rows_reason="an interpreter")

    for check_id in ("B9.layer_norm", "B9.deterministic"):
        records = run(FewRows(), check_id, "float32")
        skipped = [r for r in records if r.status == "unsupported"]
        assert skipped and all("4099" in r.case and "max_rows = 4096 (an interpreter)"
                               in r.message for r in skipped)
        assert {r.status for r in records if r not in skipped} == {"pass"}
