"""A declared convention that contradicts the spec turns exactly the records it explains
into deviations, with the declared reason; records it does not explain stay failures; a
declaration that is not true fails its contract check. Deviation entries match on stable
quantity ids, and an entry that explains nothing is reported stale."""

from __future__ import annotations

import broken_backends as bb
from normspec.conformance import cli, runner
from normspec.conformance.checks import all_checks
from normspec.impls.numpy_ref import NumpyBackend
from normspec.impls.registry import LoadedBackend

CHECKS = {c.id: c for c in all_checks()}


def statuses(backend, check_id, dtype="float32", deviations=()):
    loaded = LoadedBackend(backend.name, "tests", backend=backend, deviations=list(deviations))
    return runner.run_check(loaded, CHECKS[check_id], dtype, seed=0, examples=3, timeout=60)


def blended(recs):
    """The records of F4.running_stats whose momentum blends in the batch: with momentum
    0 the statistics stay as they are, so no estimator shows (those cases pass)."""
    frozen = [r for r in recs if "momentum 0.0" in r.case]
    assert frozen and {r.status for r in frozen} == {"pass"}
    return [r for r in recs if r not in frozen]


def test_a_declared_biased_estimator_is_a_deviation_where_it_explains_the_record():
    recs = blended(statuses(bb.BiasedDeclared(), "F4.running_stats"))
    assert {r.status for r in recs} == {"deviation"}
    assert all("running_var_estimator = 'biased'" in r.reason and "ONNX Runtime" in r.reason
               for r in recs)
    assert {r.quantity for r in recs} == {"batch_norm.running_var"}
    # B4 and E3's train/eval divergence comes from the unbiased estimate: explained too
    for check_id in ("B4.train_eval_divergence", "E3.train_then_eval"):
        assert "fail" not in {r.status for r in statuses(bb.BiasedDeclared(), check_id)}
    # and the declaration is true
    assert {r.status for r in statuses(bb.BiasedDeclared(), "F4.declared_estimator")} == {"pass"}


def test_the_same_defect_undeclared_fails():
    assert {r.status for r in blended(statuses(bb.BiasedRunningVar(), "F4.running_stats"))} \
        == {"fail"}


def test_a_declaration_does_not_excuse_another_bug():
    recs = statuses(bb.BiasedDeclaredFlippedMomentum(), "F4.running_stats")
    assert "fail" in {r.status for r in recs}


def test_a_false_declaration_fails_its_contract_check():
    class DeclaresBiased(NumpyBackend):
        name = "declares-biased"
        conventions = bb.BiasedDeclared.conventions

    assert {r.status for r in statuses(DeclaresBiased(), "F4.declared_estimator")} == {"fail"}
    assert {r.status for r in statuses(DeclaresBiased(), "F4.running_stats")} == {"pass"}


def test_one_value_batches_declared_accepted():
    assert {r.status for r in statuses(bb.OneValueDeclared(), "B3.batch_of_one_train")} == \
        {"deviation"}
    assert {r.status for r in statuses(bb.OneValueDeclaredButRaises(), "B3.batch_of_one_train")} \
        == {"fail"}


def test_parameter_precision_declared_evaluates_the_oracle_there_and_says_so():
    declared = statuses(bb.Float32EpsDeclared(), "F2.values", dtype="float64")
    assert {r.status for r in declared} == {"pass"}
    assert any("declared parameter_dtype" in r.note for r in declared)
    assert "fail" in {r.status for r in statuses(bb.Float32EpsUndeclared(), "F2.values",
                                                 dtype="float64")}
    # float32 inputs compute in float32 anyway: nothing to account for, no note
    assert all(r.note == "" for r in statuses(bb.Float32EpsDeclared(), "F2.values"))
    assert {r.status for r in statuses(bb.Float32EpsDeclared(), "protocol.parameter_dtype",
                                       dtype="float64")} == {"pass"}


def test_deviation_entries_match_stable_quantity_ids():
    entry = {"quantity": "batch_norm.running_var", "reason": "stores the biased variance"}
    recs = blended(statuses(bb.BiasedRunningVar(), "F4.running_stats", deviations=[entry]))
    assert {r.status for r in recs} == {"deviation"}
    prefix = {"quantity": "batch_norm", "reason": "anything BatchNorm"}
    assert {r.status for r in blended(statuses(bb.BiasedRunningVar(), "F4.running_stats",
                                               deviations=[prefix]))} == {"deviation"}
    # a prefix is dotted: "batch_norm.run" is not a prefix of "batch_norm.running_var"
    partial = {"quantity": "batch_norm.run", "reason": "no"}
    assert {r.status for r in blended(statuses(bb.BiasedRunningVar(), "F4.running_stats",
                                               deviations=[partial]))} == {"fail"}
    # except_check leaves a check out, by id, id prefix or claim
    for excepted in ("F4.running_stats", "F4"):
        narrowed = dict(prefix, except_check=excepted)
        assert {r.status for r in blended(statuses(bb.BiasedRunningVar(), "F4.running_stats",
                                                   deviations=[narrowed]))} == {"fail"}
    elsewhere = dict(prefix, except_check="F1/F2.constant_near_max")
    assert {r.status for r in blended(statuses(bb.BiasedRunningVar(), "F4.running_stats",
                                               deviations=[elsewhere]))} == {"deviation"}


class Documented(NumpyBackend):
    """A conforming backend that still documents a deviation it no longer has."""

    name = "documented"
    deviations = ({"check": "F2.values", "reason": "was wrong once, fixed since"},)


def test_an_entry_that_explains_nothing_is_stale(capsys):
    doc = runner.run(["test_conventions:Documented"], checks=["F2.values"], dtypes=["float32"],
                     examples=2)
    (entry,) = doc["backends"]
    assert entry["stale_deviations"] == [dict(Documented.deviations[0])]
    cli.print_summary(doc)
    assert "stale deviation entry of documented" in capsys.readouterr().out


def test_a_malformed_deviation_entry_is_named():
    from normspec.conformance.deviations import problems

    assert problems({"check": "F2", "reason": "r"}) == []
    every = "selects every record: name at least one of check, op, dtype, quantity"
    assert problems({"except_check": ["F2"], "reason": "r"}) == [
        "except_check must be one string (an id, id prefix or claim id), got ['F2']", every]
    assert problems({"checks": "F2"}) == [
        "unknown key 'checks' (known: check, except_check, op, dtype, quantity, reason)",
        "no reason", every]
    assert problems({"reason": "known upstream issue"}) == [every]
    assert problems({"quantity": "protocol", "reason": "r"}) == [
        "quantity 'protocol': a breach of the protocol is never a deviation"]


def test_no_deviation_entry_excuses_a_breach_of_the_protocol():
    """An entry scoped to the check (found by a review: one meant for F2's ULP noise
    turned "x modified in place" into a deviation)."""
    entry = {"check": "F2", "reason": "float32 accumulation differs"}
    recs = statuses(bb.WritesInput(), "F2.values", deviations=[entry])
    assert recs and {r.status for r in recs} == {"fail"}
    assert all(r.quantity == "protocol" and "modified in place" in r.message for r in recs)
