"""The time table at the end of a run: per backend and check family, the part of the
time the backend says it spent compiling; "?" where it cannot say or its counter fails
(which never costs a record)."""

from __future__ import annotations

import io

import pytest
from normspec.conformance import cli, results, runner


@pytest.fixture(scope="module")
def doc():
    return runner.run(["compiling_backend:make_backend", "compiling_backend:make_broken_counter",
                       "oracle_backend:make_backend"],
                      checks=["F2.values", "F3.values"], dtypes=["float32"], seed=3,
                      examples=3, label="ci", jobs=1)


def test_compile_seconds_are_counted_per_backend_and_family(doc):
    from compiling_backend import COMPILE_S

    timing = doc["runs"][0]["timing"]
    compiling = timing["numpy_compiling"]
    # one sleep per new LayerNorm shape (F2.values draws several), nothing else counted
    sleeps = round(compiling["compile_s"] / COMPILE_S)
    assert sleeps >= 2
    assert compiling["compile_s"] == pytest.approx(COMPILE_S * sleeps, abs=0.02)
    assert compiling["family_compile_s"] == {"values": compiling["compile_s"]}
    assert compiling["compile_s"] <= compiling["checks_s"]
    assert timing["numpy_broken_counter"]["compile_s"] is None  # raised: not known
    assert timing["oracle"]["compile_s"] is None  # Backend's default: cannot tell


def test_the_table_shows_compile_time_and_unknowns(doc):
    out = io.StringIO()
    cli.print_timing(doc, out)
    lines = out.getvalue().splitlines()
    header = next(ln for ln in lines if ln.startswith("backend"))
    assert " compile " in header and "costliest families (compile)" in header
    row = next(ln for ln in lines if ln.startswith("numpy_compiling"))
    compile_s = doc["runs"][0]["timing"]["numpy_compiling"]["compile_s"]
    assert f"{compile_s:.1f} s" in row and f"({compile_s:.1f})" in row
    broken = next(ln for ln in lines if ln.startswith("numpy_broken_counter"))
    assert "? s" in broken and "(?)" in broken


def test_a_failing_counter_costs_no_record(doc):
    statuses = {r["status"] for r in doc["records"] if r["backend"] == "numpy_broken_counter"}
    assert statuses <= {"pass", "unsupported"} and "pass" in statuses


def test_a_run_orders_the_next_by_its_seconds_a_unit(tmp_path, monkeypatch):
    """A run written into results/ leaves each backend's seconds a unit there (TIMING),
    and the next run hands them to runner.run, which starts the slowest backend first
    (jobs = 1: the records come in that order). A file that cannot be read orders
    nothing and fails nothing."""
    monkeypatch.chdir(tmp_path)
    seen = []
    real_run = runner.run

    def spy(*args, **kw):
        seen.append(kw.get("previous"))
        return real_run(*args, **kw)

    monkeypatch.setattr(runner, "run", spy)
    args = ["run", "--backend", "numpy", "--backend", "compiling_backend:make_backend",
            "--check", "F2.values", "--dtype", "float32", "--examples", "3", "--jobs", "1",
            "--no-html", "--quiet"]
    assert cli.main(args) == 0
    assert seen == [{}]
    kept = cli._previous_timing()
    assert set(kept) == {"numpy", "numpy_compiling"}
    assert kept["numpy_compiling"] > kept["numpy"] > 0  # (it sleeps at every new shape)
    assert cli.main(args) == 0
    assert seen[1] == kept
    stem = (cli.RESULTS_DIR / cli.LATEST).read_text().strip()
    first = results.read(cli.RESULTS_DIR / f"{stem}.json")["records"][0]["backend"]
    assert first == "numpy_compiling"
    (cli.RESULTS_DIR / cli.TIMING).write_text("{not json", encoding="utf-8")
    assert cli._previous_timing() == {}
    assert cli.main(args) == 0


@pytest.mark.parametrize("said, counted", [(float("nan"), None), (float("inf"), None),
                                           (-1.0, None), ("soon", None), (None, None),
                                           (0.25, 0.25), (2, 2.0)])
def test_a_compile_count_that_is_not_seconds_is_not_known(said, counted):
    """A compile_seconds() of NaN printed "nan s" in the time table (a red team): what is
    not a finite, non-negative number of seconds is "?", as a counter that raises is."""
    from normspec.conformance.worker import _compile_seconds

    class Says:
        def compile_seconds(self):
            return said

    assert _compile_seconds(Says()) == counted
