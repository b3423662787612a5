"""`normspec run --shard K/N`: N shards of a run, merged, are the unsharded run (every
record, durations aside), each unit in exactly one shard; the shard is in the run info."""

from __future__ import annotations

import copy

import pytest
from normspec.conformance import results, runner

CHECKS = ["F2.values", "B3", "DP1", "DP3"]
DTYPES = ["float32", "float64"]


def _run(shard=None):
    return runner.run(["numpy"], checks=CHECKS, dtypes=DTYPES, seed=3, examples=2, label="ci",
                      shard=shard)


def _comparable(records):
    return sorted((r["backend"], r["check"], r["dtype"], r["case"], r["status"], r["message"],
                   r["quantity"], str(r["max_ulp"]), r["inputs"], r["repro"])
                  for r in records)


@pytest.fixture(scope="module")
def runs():
    return _run(), [_run((k, 3)) for k in (1, 2, 3)]


def test_three_shards_merged_are_the_unsharded_run(runs):
    whole, shards = runs
    merged = results.merge(shards)
    assert _comparable(merged["records"]) == _comparable(whole["records"])
    assert [b["name"] for b in merged["backends"]] == [b["name"] for b in whole["backends"]]
    assert all(d["records"] for d in shards)  # every shard has work


def test_every_unit_is_in_exactly_one_shard(runs):
    whole, shards = runs
    units = [tuple(u) for d in shards for u in {(r["backend"], r["check"], r["dtype"])
                                               for r in d["records"]}]
    assert len(units) == len(set(units))
    assert sorted(units) == sorted({(r["backend"], r["check"], r["dtype"])
                                    for r in whole["records"]})
    assert [d["runs"][0]["shard"] for d in shards] == ["1/3", "2/3", "3/3"]
    assert whole["runs"][0]["shard"] == ""
    assert sum(d["runs"][0]["planned"] for d in shards) == whole["runs"][0]["planned"]


def test_shards_are_the_same_on_every_machine():
    units = [(b, c, d) for b in ("x", "y") for c in ("F1.values", "F2.values", "DP1.e4_split")
             for d in DTYPES]
    first = [runner.shard_units(units, (k, 4)) for k in range(1, 5)]
    assert first == [runner.shard_units(list(reversed(units)), (k, 4))[::-1] for k in range(1, 5)]
    assert sorted(u for s in first for u in s) == sorted(units)
    with pytest.raises(ValueError, match="K must be from 1 to N"):
        runner.shard_units(units, (5, 4))


def test_normspec_report_merges_the_shards_into_one_column(runs, tmp_path, capsys):
    from normspec.conformance import cli
    from normspec.reports import html

    _, shards = runs
    paths = [str(results.write(d, tmp_path / f"shard{k}.json")) for k, d in enumerate(shards, 1)]
    assert cli.main(["report", *paths, "-o", str(tmp_path / "merged.html")]) == 0
    assert "3 result file(s)" in capsys.readouterr().out
    context = html.build_context(results.merge([results.read(p) for p in paths]))
    assert context["columns"] == ["numpy"] and len(context["verdicts"]) == 1


def test_a_backend_missing_on_one_machine_moves_no_other_backends_unit():
    """Shards were taken over whole units, so a machine without one backend shifted the
    round robin and units of the others fell in no shard (found by a review: 457 of
    1370 units with jax missing on one machine of three). Now each shard is a set of
    (check, dtype) pairs, the same for every backend set."""
    checks = runner.select_checks(["F2", "B3"])
    everywhere = runner.plan(["x", "y", "z"], checks, DTYPES)
    without_y = runner.plan(["x", "z"], checks, DTYPES)
    for k in (1, 2, 3):
        full = runner.shard_units(everywhere, (k, 3))
        assert runner.shard_units(without_y, (k, 3)) == [u for u in full if u[0] != "y"]
        assert {(u[1], u[2]) for u in full} == {
            tuple(p) for p in runner.planned_pairs(checks, DTYPES, (k, 3))}


def test_a_claim_family_selects_every_check_of_its_claims():
    """"F" left out the checks of two claims (F2/F3.*, F1/F5.*, F1/F2.*: 12 of 40; found
    by a review)."""
    every = runner.select_checks(None)
    for family in ("F", "B", "E", "DP"):
        expected = [c for c in every if any(
            claim.startswith(family) and claim[len(family):].isdigit()
            for claim in c.claim.split("/"))]
        assert runner.select_checks([family]) == expected and expected
    assert "F2/F3.half_overflow" in [c.id for c in runner.select_checks(["F"])]


def test_a_merge_of_all_the_shards_misses_no_unit(runs):
    """(the pairs each run records are the units it has records of: nothing is called
    missing that is not)"""
    whole, shards = runs
    assert results.merge([whole])["unfinished"] == []
    merged = results.merge(shards)
    assert (merged["unfinished"], merged["missing_shards"]) == ([], {})


def test_a_backend_not_installed_on_one_shards_machine_is_missing_its_units(runs, tmp_path,
                                                                          capsys):
    """A shard run on a machine without the backend lists it unavailable (no version) and
    runs none of its units: the merge refused the shards as 'two backends under one name'
    (a version, and none), and with that fixed said nothing of the units no machine ran
    (found by a review). The units its label's runs planned that it has no record of are
    reported missing, in the report's notice and verdict and on the console."""
    from normspec.conformance import cli
    from normspec.reports import html

    _, shards = runs
    second = copy.deepcopy(shards[1])
    second["runs"][0].update(host="other-machine", id="other")
    second["backends"] = [dict(b, available=False, version="", error="not installed")
                          for b in second["backends"]]
    second["records"] = []
    docs = [shards[0], second, shards[2]]
    paths = [str(results.write(d, tmp_path / f"s{k}.json")) for k, d in enumerate(docs, 1)]
    assert cli.main(["report", *paths, "-o", str(tmp_path / "r.html")]) == 0
    assert (f"incomplete: backend 'numpy' of run 'ci': {len(shards[1]['runs'][0]['pairs'])} "
            "unit(s) with no record") in capsys.readouterr().out
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "have no record of it" in page and "F2.values" in page
    merged = results.merge(docs)
    assert {(u["check"], u["dtype"], u["why"]) for u in merged["unfinished"]} == {
        (check, dtype, "no record") for check, dtype in shards[1]["runs"][0]["pairs"]}
    (verdict,) = html.build_context(merged)["verdicts"]
    assert f"incomplete: {len(shards[1]['runs'][0]['pairs'])} unit(s)" in verdict["line"]


def test_stale_deviations_are_judged_over_all_the_shards_of_one_label_and_only_then(runs):
    """A sharded run leaves its stale deviation entries to the merge. Over every shard of
    one label they are found; where a shard is missing (not given, or shards with labels
    of their own) an entry may explain a record of the shard not here, and it was called
    stale: it is not judged then, and the missing shards are named."""
    _, shards = runs
    entry = {"check": "B3", "reason": "no longer deviates"}
    docs = copy.deepcopy(shards)
    for d in docs:
        d["backends"][0]["deviations"] = [entry]
    assert results.merge(docs)["backends"][0]["stale_deviations"] == [entry]
    partial = results.merge(docs[:2])
    assert partial["backends"][0]["stale_deviations"] == []
    assert partial["missing_shards"] == {"ci": ["3/3"]}
    for k, d in enumerate(docs, 1):
        d["runs"][0]["run"] = f"ci-{k}"
        for x in d["backends"] + d["records"]:
            x["run"] = f"ci-{k}"
    labelled = results.merge(docs)
    assert labelled["missing_shards"] == {"ci-1": ["2/3", "3/3"], "ci-2": ["1/3", "3/3"],
                                          "ci-3": ["1/3", "2/3"]}
    assert all(b["stale_deviations"] == [] for b in labelled["backends"])
