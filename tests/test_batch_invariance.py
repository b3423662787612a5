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
    rows is what test_harness_catches shows B9.layer_norm catching.)"""
    records = [r for r in run(bb.SwitchesStrategyFrom512(), check_id, "float32")
               if r.status != "pass"]
    assert len(records) == 1 and "batch sizes that differ: 1024," in records[0].message


def test_a_reused_output_buffer_cannot_hide_nondeterminism():
    """The harness keeps copies of what a call returned: the second call's bits written
    into the first's buffer do not make the two agree."""
    records = run(bb.ReusesOutputBuffer(), "B9.deterministic", "float32")
    failing = {r.op for r in records if r.status == "fail"}
    assert {"layer_norm", "rms_norm"} <= failing
