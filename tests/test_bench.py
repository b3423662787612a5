"""`normspec bench` without asserting a time: a measurement whose copy baseline moved is
marked unreliable and gets no ratio; each backend is timed in a process of its own; the
ratios to torch come from reliable rows only; the report draws the cost curve and names
the reason of an unreliable row; an older results file's benchmarks still read."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import pytest
from normspec.conformance import bench, results
from normspec.reports import bench_plots, html

MB = 10**6


def _rec(**kw) -> dict:
    item = dict(series="table", op="layer_norm", dtype="float32", shape=[4, 8],
                pass_="forward", variant="prepared")
    item.update(kw)
    return bench._record("numba", item)


def test_baselines_that_disagree_make_the_result_unreliable():
    # the copy took 1 ms before and 1.3 ms after: 30% apart, past the 15% the bench allows
    rec = bench.judge(_rec(), [1e-3], [1.3e-3], [2e-3], 8 * MB)
    assert rec["reliable"] is False and rec["of_copy"] is None
    assert "unreliable" in rec["error"] and "30%" in rec["error"]
    ok = bench.judge(_rec(), [1e-3], [1.1e-3], [2e-3], 8 * MB)
    assert ok["reliable"] is True and ok["error"] == ""
    assert ok["of_copy"] == pytest.approx(1.05e-3 / 2e-3)


def test_times_are_the_fastest_call():
    # a busy machine: most calls waited out a 12 ms slice, the fastest did not
    slices = [12e-3, 1e-3, 12e-3]
    rec = bench.judge(_rec(), slices, slices, [24e-3, 2e-3, 12e-3], 8 * MB)
    assert rec["reliable"] and rec["ms"] == pytest.approx(2.0)
    assert rec["of_copy"] == pytest.approx(0.5)


def test_a_kernel_far_faster_than_the_copy_is_unreliable():
    # both copies slowed alike (spinning threads): agreeing baselines, impossible ratio
    rec = bench.judge(_rec(), [8e-3], [8e-3], [0.2e-3], 2 * MB)
    assert rec["reliable"] is False and rec["of_copy"] is None and "slowed" in rec["error"]


def test_ratios_to_torch_only_between_reliable_rows():
    torch = bench.judge(dict(_rec(), backend="torch"), [1e-3], [1e-3], [4e-3], 8 * MB)
    fast = bench.judge(_rec(), [1e-3], [1e-3], [1e-3], 8 * MB)
    shaky = bench.judge(_rec(variant="protocol"), [1e-3], [2e-3], [1e-3], 8 * MB)
    other = bench.judge(_rec(dtype="float16"), [1e-3], [1e-3], [1e-3], 8 * MB)
    bench.compare_to_torch([torch, fast, shaky, other])
    assert fast["vs_torch"] == pytest.approx(4.0)
    assert shaky["vs_torch"] is None and other["vs_torch"] is None


def test_no_ratio_to_torch_across_copies_that_disagree():
    # torch's process saw a copy at 8 GB/s, this one at 16: each reliable on its own,
    # but a ratio of their fractions of copy would mix two states of the machine
    torch = bench.judge(dict(_rec(), backend="torch"), [1e-3], [1e-3], [4e-3], 8 * MB)
    fast = bench.judge(_rec(), [0.5e-3], [0.5e-3], [1e-3], 8 * MB)
    near = bench.judge(_rec(dtype="float16"), [1.1e-3], [1.1e-3], [1e-3], 8 * MB)
    near_torch = bench.judge(dict(_rec(dtype="float16"), backend="torch"), [1e-3], [1e-3],
                             [2e-3], 8 * MB)
    bench.compare_to_torch([torch, fast, near, near_torch])
    assert fast["reliable"] and fast["vs_torch"] is None
    assert "16.0 GB/s in this process and 8.0 GB/s in torch's" in fast["vs_torch_note"]
    assert "1.000 ms against torch's 4.000 ms" in fast["vs_torch_note"]
    assert "no x torch" in bench.summary([torch, fast])
    doc = results.new_document() | {"benchmarks": [dict(r, run="b") for r in (torch, fast)]}
    assert "16.0 GB/s in this process and 8.0 GB/s in torch" in html.render([doc])
    # 10% apart: compared, against each one's own copy
    assert near["vs_torch"] == pytest.approx(1.1 * 2)
    assert near["vs_torch_note"] == ""


def test_backends_take_turns_and_one_that_dies_loses_no_row():
    items = [dict(series="table", op=op, dtype=dt, shape=[16, 64], pass_="forward",
                  variant=v)
             for op, dt in (("rms_norm", "float32"), ("layer_norm", "float32"),
                            ("rms_norm", "float16"))
             for v in ("prepared", "protocol")]
    said: list[str] = []
    doc = bench.run_bench(["numpy", "nonfinite_backends:Segfaults"], items=items, repeat=2,
                          progress=said.append)
    rows = doc["benchmarks"]
    assert [(r["backend"], r["op"], r["dtype"]) for r in rows[::2]] == [
        ("numpy", "rms_norm", "float32"), ("Segfaults", "rms_norm", "float32"),
        # the second measurement: the other process goes first (and dies in LayerNorm)
        ("Segfaults", "layer_norm", "float32"), ("numpy", "layer_norm", "float32"),
        ("numpy", "rms_norm", "float16"), ("Segfaults", "rms_norm", "float16")]
    assert len(rows) == 2 * len(items)
    dead = [r for r in rows if r["backend"] == "Segfaults" and r["error"].startswith("not measured")]
    assert [(r["op"], r["dtype"], r["variant"]) for r in dead] == [
        ("layer_norm", "float32", "protocol"), ("rms_norm", "float16", "prepared"),
        ("rms_norm", "float16", "protocol")]
    assert "Segfaults's bench process stopped" in dead[0]["error"]
    assert any("Segfaults's bench process stopped" in line for line in said)
    assert all(r["gbps"] for r in rows if r["backend"] == "numpy" and r["variant"] == "protocol")
    results.validate(copy.deepcopy(results.encode(doc)))


def test_a_default_backend_that_cannot_load_has_a_row_for_each_measurement(monkeypatch):
    from normspec.impls import registry

    monkeypatch.setattr(registry, "default_backends",
                        lambda: ["numpy", "no_such_module_here:make_backend"])
    item = dict(series="table", op="rms_norm", dtype="float32", shape=[16, 64],
                pass_="forward", variant="protocol")
    doc = bench.run_bench(None, items=[item], repeat=2, progress=lambda _: None)
    rows = doc["benchmarks"]
    assert [r["backend"] for r in rows] == ["numpy", "no_such_module_here:make_backend"]
    assert rows[1]["error"].startswith("not measured: unavailable: ")
    assert "no_such_module_here" in rows[1]["error"]
    results.validate(copy.deepcopy(results.encode(doc)))


@pytest.mark.parametrize("backends, says", [
    (["numpy", "no_such_module_here:make_backend"],
     "backend 'no_such_module_here:make_backend' could not be used"),
    (["numpy", "normspec.impls.numpy_ref:make_backend"], "call themselves 'numpy'"),
])
def test_bench_refuses_a_backend_asked_for_that_cannot_be_used(tmp_path, backends, says):
    """As `run` does: exit 2, one line, nothing written (bench measured 48 rows of
    "not measured" and exited 0; two names of one backend gave torch a ratio to itself:
    a review). A name given twice is timed once."""
    import subprocess
    import sys

    out = tmp_path / "b.json"
    args = [a for name in backends for a in ("--backend", name)]
    done = subprocess.run([sys.executable, "-m", "normspec.conformance.cli", "bench", "--quick",
                           "--no-curve", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not out.exists()
    item = dict(series="table", op="rms_norm", dtype="float32", shape=[16, 64],
                pass_="forward", variant="protocol")
    rows = bench.run_bench(["numpy", "numpy"], items=[item], repeat=2,
                           progress=lambda _: None)["benchmarks"]
    assert [r["backend"] for r in rows] == ["numpy"]


def test_each_backend_is_timed_in_its_own_process():
    item = dict(series="table", op="rms_norm", dtype="float32", shape=[16, 64],
                pass_="forward", variant="protocol")
    doc = bench.run_bench(["numpy", "numba"], items=[item], repeat=3, progress=lambda _: None)
    rows = doc["benchmarks"]
    assert [r["backend"] for r in rows] == ["numpy", "numba"]
    pids = {r["pid"] for r in rows}
    assert len(pids) == 2 and os.getpid() not in pids and None not in pids
    assert all(r["gbps"] for r in rows), [r["error"] for r in rows]
    results.validate(copy.deepcopy(results.encode(doc)))


def _curve_doc() -> dict:
    doc = results.new_document()
    doc["runs"].append({"run": "bench"})
    rows = []
    for backend in ("numba", "torch"):
        for variant in bench.VARIANTS:
            for d in (64, 1024, 16384):
                rec = _rec(series="curve 1048576", shape=[(1 << 20) // d, d], variant=variant)
                rec["backend"] = backend
                rows.append(bench.judge(rec, [1e-3], [1e-3], [1e-3 * (1 + d / 1e4)], 8 * MB))
    shaky = bench.judge(_rec(), [1e-3], [2e-3], [1e-3], 8 * MB)
    rows.append(shaky)
    rows.append(bench.judge(_rec(backend="torch"), [1e-3], [1e-3], [2e-3], 8 * MB))
    for r in rows:
        r["run"] = "bench"
    doc["benchmarks"] = rows
    return doc


def test_report_draws_the_cost_curve_and_says_why_a_row_has_no_number():
    page = html.render([_curve_doc()])
    assert "Cost curve" in page and page.count("<svg") >= 2
    assert "the machine&#39;s load changed" in page or "the machine's load changed" in page
    assert "protocol (fresh output)" in page  # the legend says which call is which


def test_an_unreliable_row_shows_no_figure_in_the_report():
    """Its time, GB/s and copies are not shown either, only why it has no number (the
    table printed them, and "of copy" could be worked out from them: a review)."""
    shaky = bench.judge(_rec(), [1e-3], [2e-3], [0.123456e-3], 8 * MB)
    doc = results.new_document() | {"benchmarks": [dict(shaky, run="b")]}
    page = html.render([doc])
    assert "0.123" not in page and "64.80" not in page, "a figure of an unreliable row"
    assert "the machine&#39;s load changed" in page or "the machine's load changed" in page


def _bars(rows) -> list[dict]:
    return [dict(bench.judge(_rec(**kw), [1e-3], [1e-3], [t], 8 * MB), run=run)
            for kw, t, run in rows]


def test_every_series_drawn_is_named_in_the_legend():
    """numba's protocol call has no reliable bar in the first group ([4, 8]) but one in
    the second: its hatched bars are named too (only a series with a bar in the first
    group was: a review)."""
    rows = _bars([(dict(), 1e-3, "b"), (dict(shape=[8, 8]), 1e-3, "b"),
                  (dict(shape=[8, 8], variant="protocol"), 2e-3, "b")])
    rows.append(dict(bench.judge(_rec(variant="protocol"), [1e-3], [2e-3], [2e-3], 8 * MB),
                     run="b"))
    fig = _figure(bench_plots.bench_plot, rows)
    labels = {t.get_text() for ax in fig.axes if ax.get_legend()
              for t in ax.get_legend().get_texts()}
    assert {"numba prepared", "numba protocol (fresh output)"} <= labels, labels


def test_merged_runs_draw_each_runs_bar_named_by_run():
    """Two files measuring the same: each run's bar drawn and named (the bar plot drew
    the first file's and the curve the last's, naming neither: a review)."""
    rows = _bars([(dict(), 1e-3, "one"), (dict(), 2e-3, "two")])
    fig = _figure(bench_plots.bench_plot, rows)
    labels = {t.get_text() for ax in fig.axes if ax.get_legend()
              for t in ax.get_legend().get_texts()}
    assert {"numba prepared, run one", "numba prepared, run two"} <= labels, labels


def _figure(plot, rows):
    """The matplotlib figure `plot` draws for these benchmark rows."""
    figures = []
    plot(results.new_document() | {"benchmarks": rows}, figures.append)
    return figures[0]


def test_old_benchmark_entries_still_read():
    old = {"backend": "numba", "op": "layer_norm", "dtype": "float32", "shape": [4, 8],
           "pass": "forward", "ms": 1.0, "gbps": 2.0, "copy_gbps": 3.0, "of_copy": 0.66,
           "vs_torch": None, "timed": "native call (prepare_benchmark)", "error": "",
           "run": "old"}
    doc = results.new_document()
    doc["benchmarks"] = [old]
    got = results.validate(doc)["benchmarks"][0]
    assert got["variant"] == "prepared" and got["series"] == "table" and got["reliable"]
    assert html.render([results.new_document() | {"benchmarks": [old]}])


def test_a_moved_baseline_is_measured_again(monkeypatch):
    from normspec.impls import registry

    # copy, kernel, copy: the first attempt's copies disagree (1 ms, then 2 ms)
    times = iter([[1e-3], [1e-3], [2e-3], [1e-3], [1e-3], [1.05e-3]])
    monkeypatch.setattr(bench, "_time", lambda fn, repeat, budget_s=1.0: next(times))
    item = dict(series="table", op="rms_norm", dtype="float32", shape=[4, 8],
                pass_="forward", variant="protocol")
    rec = bench.measure_one(registry.load("numpy").backend, "numpy", item)
    assert rec["reliable"] and rec["attempts"] == 2 and rec["error"] == ""


def test_inputs_that_cannot_be_made_are_that_rows_error_and_the_next_is_measured(monkeypatch):
    """A MemoryError making a big item's inputs: that row says so, and the process goes
    on (it ended the process, and every later row of the backend read "not measured");
    asked for again, the same inputs are made, not taken as made (found by a review)."""
    from normspec.impls import registry

    big, small = [512, 512], [4, 8]
    real = np.random.default_rng
    fail = [True]

    class Rng:
        def __init__(self, seed):
            self.rng = real(seed)

        def normal(self, loc, scale, size):
            if fail[0] and list(size) == big:
                raise MemoryError("scripted: no room for the inputs")
            return self.rng.normal(loc, scale, size)

        def __getattr__(self, name):  # the copy's buffers
            return getattr(self.rng, name)

    monkeypatch.setattr(bench.np.random, "default_rng", Rng)
    monkeypatch.setattr(bench, "_time", lambda fn, repeat, budget_s=1.0: [1e-3])
    backend, inputs = registry.load("numpy").backend, bench._Inputs()

    def measure(shape):
        item = dict(series="table", op="rms_norm", dtype="float32", shape=shape,
                    pass_="forward", variant="protocol")
        return bench.measure_one(backend, "numpy", item, inputs=inputs)
    rec = measure(big)
    assert rec["error"] == "MemoryError: scripted: no room for the inputs" and rec["ms"] is None
    fail[0] = False
    assert measure(big)["ms"] is not None, "the inputs that failed were taken as made"
    assert measure(small)["ms"] is not None


class _ScriptedWorker:
    """A bench process whose copies run at the GB/s its script gives, turn after turn:
    `script[name]` lists, per turn, the copy's speed (before and after alike) or a pair
    (before, after), "err" for a measurement that raised (no time), or None for a turn
    in which the process stops. Its kernel takes as
    long as the copy (torch's twice as long): 2x torch wherever the two agree.
    `made` keeps every process made, to count the turns each took."""

    script: dict[str, list] = {}
    made: list[_ScriptedWorker] = []

    def __init__(self, name, label, *, timing=False):
        assert timing  # a bench process leaves the runtime as users have it
        self.name, self.entry, self.error = name, {"name": name}, None
        self.turn = 0
        self.made.append(self)

    def start(self):
        return True

    def wait_loaded(self, timeout, interrupt=None):
        return True

    def stop(self):
        pass

    def run_job(self, message, *, timeout, on_record):
        from normspec.conformance.worker import Outcome

        _, group, _ = message
        speed = self.script[self.name][self.turn]
        self.turn += 1
        if speed is None:
            return Outcome("timeout", 0)
        if speed == "err":
            for item in group:
                on_record(dict(bench._record(self.name, item), error="MemoryError: scripted"))
            return Outcome("done", len(group))
        before, after = speed if isinstance(speed, tuple) else (speed, speed)
        for item in group:
            copy_s = [8 * MB / (before * 1e9)], [8 * MB / (after * 1e9)]
            kernel = copy_s[0][0] * (2 if self.name == "torch" else 1)
            on_record(bench.judge(bench._record(self.name, item), *copy_s, [kernel], 8 * MB))
        return Outcome("done", len(group))


def _bench_rounds(monkeypatch, script, variants=("prepared",)):
    """run_bench over one measurement with the scripted processes, in the script's order:
    (the rows, the 'measured again' lines, the turns each process took)."""
    from normspec.conformance import worker

    monkeypatch.setattr(_ScriptedWorker, "script", script)
    monkeypatch.setattr(_ScriptedWorker, "made", [])
    monkeypatch.setattr(worker, "Worker", _ScriptedWorker)
    items = [dict(series="table", op="layer_norm", dtype="float32", shape=[256, 1000],
                  pass_="forward+backward", variant=v) for v in variants]
    said: list[str] = []
    rows = bench.run_bench(list(script), items=items, progress=said.append,
                           timeout=5)["benchmarks"]
    turns = {w.name: w.turn for w in _ScriptedWorker.made}
    return rows, [line for line in said if line.startswith("measured again")], turns


def _row(rows, backend):
    return next(r for r in rows if r["backend"] == backend)


@pytest.mark.parametrize("script, kept, vs_torch", [
    # torch's turn ran against a copy at half the speed, then both agreed: round 2
    ({"torch": [8.0, 16.0], "numba": [16.0, 16.0]}, 2, 2.0),
    # agreed at once: one round
    ({"torch": [16.0], "numba": [15.0]}, 1, 2.0),
    # never agreed: ROUNDS rounds, none better than the first, which is kept, with its note
    ({"torch": [8.0] * bench.ROUNDS, "numba": [16.0] * bench.ROUNDS}, 1, None),
    # torch's own row had no number (its copy moved), then it had
    ({"torch": [(16.0, 8.0), 16.0], "numba": [16.0, 16.0]}, 2, 2.0),
])
def test_a_measurement_whose_copies_disagree_across_processes_is_taken_again(
        monkeypatch, script, kept, vs_torch):
    rows, again, turns = _bench_rounds(monkeypatch, script)
    assert turns == {name: len(speeds) for name, speeds in script.items()}
    assert len(again) == len(script["torch"]) - 1
    assert [r["backend"] for r in rows] == ["torch", "numba"][::1 if kept % 2 else -1], rows
    assert all(r["round"] == kept for r in rows)
    numba = _row(rows, "numba")
    assert numba["reliable"] and numba["vs_torch"] == (pytest.approx(vs_torch) if vs_torch else None)
    if vs_torch is None:
        assert "no x torch" in numba["vs_torch_note"]
        assert "numba prepared (round 1): no x torch: the copy of the same bytes ran at 16.0 " \
               "GB/s in this process and 8.0 GB/s in torch's" in again[0]
    if isinstance(script["torch"][0], tuple):
        assert "torch's prepared row has no number (unreliable: the copy baseline moved" in again[0]


@pytest.mark.parametrize("second, why", [
    ({"torch": 16.0, "numba": (16.0, 8.0)}, "numba's copy moved during its turn"),
    ({"torch": (16.0, 8.0), "numba": 16.0}, "torch's copy moved: nothing to compare with"),
    ({"torch": 16.0, "numba": None}, "numba's process stopped"),
])
def test_a_round_that_measured_less_never_replaces_an_earlier_one(monkeypatch, second, why):
    """Round 1: both reliable, copies apart (no ratio). Round 2 loses something: the
    results keep round 1, every number in it (found by a review: round 2 was kept)."""
    script = {"torch": [8.0, second["torch"], 8.0], "numba": [16.0, second["numba"], 16.0]}
    rows, again, _ = _bench_rounds(monkeypatch, script)
    assert again, why
    assert [r["round"] for r in rows] == [1, 1], (why, rows)
    assert all(r["reliable"] and r["gbps"] for r in rows), (why, rows)


def test_a_round_where_one_backend_gains_a_ratio_and_another_loses_its_number(monkeypatch):
    """Round 2 gives numba its ratio but other's process stops: round 1 is kept, with
    other's number and ratio (a second review: keeping round 2 lost them), and no third
    round is taken, which could not be kept either (a third review)."""
    script = {"torch": [8.0, 16.0, 16.0], "numba": [16.0, 16.0, 16.0], "other": [8.0, None]}
    rows, again, turns = _bench_rounds(monkeypatch, script)
    other = _row(rows, "other")
    assert other["round"] == 1 and other["reliable"] and other["vs_torch"] == pytest.approx(2.0)
    assert _row(rows, "numba")["vs_torch"] is None
    assert turns == {"torch": 2, "numba": 2, "other": 2} and len(again) == 1


@pytest.mark.parametrize("numba, other, vs_torch", [
    # round 2 compares numba with torch while other's copy moves
    (["err", 8.0, 8.0], [16.0, (16.0, 8.0), 16.0], 2.0),
    # round 2 only times numba, unreliably, and other's copy moves: no rank gained in sum,
    # but a row timed that round 1 had not
    (["err", (16.0, 8.0), (16.0, 8.0)], [16.0, (16.0, 8.0), (16.0, 8.0)], None),
])
def test_a_later_round_that_timed_a_row_the_first_could_not_is_kept(
        monkeypatch, numba, other, vs_torch):
    """numba's first measurement raised; round 2 times it while other's copy moves:
    round 2 is kept, the one with every row timed (a third review: round 1 was kept,
    numba with no time at all)."""
    rows, again, _ = _bench_rounds(monkeypatch, {"torch": [8.0] * 3, "numba": numba,
                                                 "other": other})
    assert all(r["round"] == 2 for r in rows), rows
    assert _row(rows, "numba")["ms"] is not None and _row(rows, "other")["ms"] is not None
    assert _row(rows, "numba")["vs_torch"] == (pytest.approx(vs_torch) if vs_torch else None)


@pytest.mark.parametrize("script, kept", [
    # slowed in round 1 only: round 2 measures it at full speed and is kept, with its ratio
    ({"torch": [10.0, 10.0], "numba": [0.1, 10.0]}, 2),
    # slowed in every round: no number, however plausible its % of copy
    ({"torch": [10.0] * bench.ROUNDS, "numba": [0.1] * bench.ROUNDS}, 1),
    # torch slowed: neither its number nor a ratio to it
    ({"torch": [0.1] * bench.ROUNDS, "numba": [10.0] * bench.ROUNDS}, 1),
])
def test_a_process_slowed_throughout_has_no_number(monkeypatch, script, kept):
    """A process slowed before, during and after its turn alike: its copies agree, so
    judge() passes it, but they ran 100 times below the same bytes' copy in the other
    process's turn (a review saw 1.75 GB/s against 128-195, and "96% of copy" where the
    process's other rounds measured 40%). That row has no number, and the measurement is
    taken again; a torch row so slowed gives no ratio."""
    rows, again, turns = _bench_rounds(monkeypatch, script)
    slowed = "numba" if script["numba"][0] == 0.1 else "torch"
    assert turns == {name: len(speeds) for name, speeds in script.items()}
    assert "slowed throughout" in again[0], again
    assert all(r["round"] == kept for r in rows), rows
    row, other = _row(rows, slowed), _row(rows, {"numba": "torch", "torch": "numba"}[slowed])
    if kept == 2:
        assert row["reliable"] and row["vs_torch"] == pytest.approx(2.0)
        return
    assert not row["reliable"] and row["of_copy"] is None and row["vs_torch"] is None
    assert row["error"].startswith(bench.SLOWED) and "0.10 GB/s" in row["error"], row["error"]
    assert f"10.00 GB/s {other['backend']}'s process measured" in row["error"]
    assert other["reliable"]
    if slowed == "torch":
        assert other["vs_torch"] is None and "torch's prepared row has no number" in \
            other["vs_torch_note"], other
    assert "slowed throughout" in bench.summary(rows)


def test_torch_stopping_in_a_later_round_keeps_the_ratios_of_an_earlier_one(monkeypatch):
    """Round 2 gives numba its ratio, other still has none, and torch stops in round 3:
    round 2 stays kept (a second review: the rounds were ranked again without torch and
    round 1 kept, losing numba's ratio)."""
    script = {"torch": [8.0, 16.0, None], "numba": [16.0, 16.0, 16.0],
              "other": [16.0, 8.0 * 1.5, 16.0]}
    rows, again, _ = _bench_rounds(monkeypatch, script)
    assert _row(rows, "numba")["round"] == 2
    assert _row(rows, "numba")["vs_torch"] == pytest.approx(2.0)
    assert _row(rows, "torch")["reliable"]


@pytest.mark.parametrize("script, turns", [
    # no torch: nothing to compare with, one round
    ({"numba": [16.0], "other": [8.0]}, {"numba": 1, "other": 1}),
    # the row without a ratio is of a process that stopped after it: no round for it
    ({"torch": [8.0, 8.0], "numba": [8.0, 8.0], "other": [16.0, None]},
     {"torch": 2, "numba": 2, "other": 2}),
    # torch stopped: no round can give a ratio
    ({"torch": [8.0, None], "numba": [16.0, 16.0]}, {"torch": 2, "numba": 2}),
    # torch's prepared row failed: the same again would not help
    ({"torch": ["err"], "numba": [16.0]}, {"torch": 1, "numba": 1}),
])
def test_no_round_is_taken_again_for_nothing(monkeypatch, script, turns):
    rows, again, took = _bench_rounds(monkeypatch, script)
    assert took == turns, again
    assert len(again) == max(turns.values()) - 1
    assert all(r["round"] == 1 for r in rows if r["ms"] is not None)
    numba = _row(rows, "numba")
    if script.get("torch") == ["err"]:
        assert numba["vs_torch_note"] == (
            "no x torch: torch's prepared row has no time (MemoryError: scripted)")


def test_a_process_that_stopped_keeps_what_it_measured_before(monkeypatch):
    """A process that dies in the middle of its first turn: its first row stays, and no
    round is taken again for nothing."""
    class Dies(_ScriptedWorker):
        def run_job(self, message, *, timeout, on_record):
            from normspec.conformance.worker import Outcome

            if self.name == "numba":
                _, group, _ = message
                on_record(bench.judge(bench._record("numba", group[0]), [1e-3], [1e-3], [1e-3],
                                      8 * MB))
                return Outcome("died", 1, "killed by signal 9")
            return super().run_job(message, timeout=timeout, on_record=on_record)

    from normspec.conformance import worker

    monkeypatch.setattr(_ScriptedWorker, "script", {"torch": [1.0] * bench.ROUNDS})
    monkeypatch.setattr(worker, "Worker", Dies)
    items = [dict(series="table", op="layer_norm", dtype="float32", shape=[256, 1000],
                  pass_="forward", variant=v) for v in bench.VARIANTS]
    rows = bench.run_bench(["torch", "numba"], items=items, progress=lambda _: None)["benchmarks"]
    numba = [r for r in rows if r["backend"] == "numba"]
    assert [bool(r["gbps"]) for r in numba] == [True, False], numba
    assert "numba's bench process stopped" in numba[1]["error"]


def test_torch_prepared_backward_does_not_add_into_the_last_calls_gradients():
    pytest.importorskip("torch")
    from normspec.impls import registry

    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((4, 8)), rng.standard_normal((4, 8))
    run = registry.load("torch").backend.prepare_benchmark(
        "layer_norm", x, (8,), np.ones(8), np.zeros(8), 1e-5, g)
    run()
    run()
    tensors = dict(zip(run.__code__.co_freevars, (c.cell_contents for c in run.__closure__),
                       strict=True))
    # dL/dbeta is g summed over the rows; after two calls it must still be one call's
    assert np.allclose(tensors["b"].grad.numpy(), g.sum(0)), (
        f"got dL/dbeta {tensors['b'].grad.numpy()} after two calls, but one call gives "
        f"{g.sum(0)}")


def test_ctrl_c_keeps_the_measurements_taken_and_says_the_bench_stopped(monkeypatch):
    """Ctrl-C during the second measurement (its records in): the first is kept, the
    second dropped (not compared across rounds), the run says SIGINT, and
    `normspec bench` writes the file and exits 130 (it had ended with a traceback and
    nothing saved)."""
    from normspec.conformance import worker

    items = [dict(series="table", op="rms_norm", dtype="float32", shape=[16, 64 * k],
                  pass_="forward", variant="protocol") for k in (1, 2)]
    real, calls = worker.Worker.run_job, []

    def run_job(self, message, **kw):
        calls.append(message)
        out = real(self, message, **kw)
        if len(calls) == 2:  # the second measurement's records have arrived
            raise KeyboardInterrupt
        return out
    monkeypatch.setattr(worker.Worker, "run_job", run_job)
    doc = bench.run_bench(["numpy"], items=items, repeat=2, progress=lambda line: None)
    assert (doc["runs"][0]["complete"], doc["runs"][0]["stopped_by"]) == (False, "SIGINT")
    assert [r["shape"] for r in doc["benchmarks"]] == [[16, 64]]


def test_each_bench_writes_a_file_of_its_own(tmp_path, monkeypatch):
    """`normspec bench` wrote results/bench.json every time, over the last bench's numbers
    (found by a new user)."""
    from normspec.conformance import cli

    written = []

    def fake_main(args):
        Path(args.json).write_text("{}", encoding="utf-8")
        written.append(args.json)
        return 0
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "main", fake_main)
    (tmp_path / "results").mkdir()
    assert cli.main(["bench", "--backend", "numpy"]) == 0
    assert cli.main(["bench", "--backend", "numpy"]) == 0
    first, second = written
    assert first != second and all(p.startswith("results/") and "-bench" in p for p in written)
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == sorted(
        Path(p).name for p in written)
