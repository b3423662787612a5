"""How backend processes share two cores: once every backend has a process, a free slot
starts a second process for the backend with the most work left and takes units from
the same queue, each unit run exactly once, the run's records those of a run without
sharing; and each backend process waits passively instead of spinning."""

from __future__ import annotations

import threading

import pytest
from normspec.conformance import runner

CHECKS = ["F2.values", "F3.values", "F2.grad", "B1", "B2", "E1", "E2"]
DTYPES = ["float32", "float64"]


def _run(jobs):
    return runner.run(["pid_backend:make_backend"], checks=CHECKS, dtypes=DTYPES, seed=5,
                      examples=2, label="ci", jobs=jobs)


def _comparable(records):
    return sorted((r["check"], r["dtype"], r["case"], r["status"], r["message"],
                   str(r["max_ulp"]), r["inputs"]) for r in records)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pids = tmp_path_factory.mktemp("pids") / "pids.txt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NORMSPEC_TEST_PIDS", str(pids))
        alone = _run(1)
        alone_pids = pids.read_text().split()
        pids.write_text("")
        mp.setattr(runner, "SHARE_MIN_S", 0.0)  # share as soon as the work left is known
        mp.setattr(runner, "SHARE_LOADS", 0.0)
        # ~40 calls of 0.1 s: the first process cannot drain the queue before a second
        # one has started (about a second), however fast the machine
        mp.setenv("NORMSPEC_TEST_SLOW", "0.1")
        shared = _run(2)
        shared_pids = pids.read_text().split()
    return alone, alone_pids, shared, shared_pids


def test_a_free_slot_shares_the_backend_in_a_second_process(runs):
    alone, alone_pids, shared, shared_pids = runs
    assert len(set(alone_pids)) == 1
    assert len(set(shared_pids)) == 2
    assert shared["runs"][0]["timing"]["numpy_pid"]["processes"] == 2


def test_shared_units_run_once_each_and_give_the_same_records(runs):
    alone, _, shared, _ = runs
    assert shared["runs"][0]["complete"] and alone["runs"][0]["complete"]
    assert shared["runs"][0]["planned"] == alone["runs"][0]["planned"]
    units = [(r["check"], r["dtype"], r["case"]) for r in shared["records"]]
    assert len(units) == len(set(units))
    assert _comparable(shared["records"]) == _comparable(alone["records"])


@pytest.mark.parametrize(("given", "seen"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_backend_processes_wait_passively_unless_told_otherwise(tmp_path, monkeypatch, given, seen):
    """OpenMP threads spinning after a parallel region take the core another backend's
    process needs; each backend process waits passively, unless the user said otherwise."""
    monkeypatch.setenv("NORMSPEC_TEST_PIDS", str(tmp_path / "pids.txt"))
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    doc = runner.run(["pid_backend:make_backend"], checks=["E1"], dtypes=["float32"], label="ci")
    assert doc["backends"][0]["version"] == f"OMP_WAIT_POLICY={seen}"


class _FakeWorker:
    """What _Run.drive uses of a Worker: execute() records one error per unit it is given
    (once given up, as Worker.execute does) after `hold` is set."""

    def __init__(self, name, given_up=""):
        self.entry, self.requested, self.given_up = {"name": name}, name, given_up
        self.last_compile_s = None
        self.units: list = []
        self.hold = threading.Event()
        self.hold.set()
        self.started = threading.Event()

    def execute(self, check_id, dtype, *, on_record, **_):
        self.started.set()
        self.hold.wait(30)
        self.units.append((check_id, dtype))
        rec = {"check": check_id, "dtype": dtype, "status": "error"}
        on_record(rec)
        return [rec]


def _state(workers, units):
    state = runner._Run(label="ci", seed=0, examples=1, timeout=1.0, shrink=False,
                        say=lambda _msg: None, on_record=None)
    for w in workers:
        state.timing.setdefault(w.entry["name"], {"checks_s": 0.0, "families": {},
                                                  "compile_s": None, "family_compile_s": {}})
    state.queue(workers[:1], units)
    return state


def test_a_process_that_gave_up_leaves_the_units_to_one_that_still_runs():
    """A backend's second process that could not be started again (Worker.given_up)
    leaves the units to the process that still runs them, and the backend gets no third
    process; one that gave up with no such process beside it records every unit left,
    so that none is left without a record."""
    units = [("b", "F2.values", d) for d in DTYPES * 3]
    running, gone = _FakeWorker("b"), _FakeWorker("b", given_up="its process died")
    state = _state([running, gone], units)
    running.hold.clear()
    driver = threading.Thread(target=state.drive, args=(running, "b"))
    driver.start()
    try:
        assert running.started.wait(30)
        state.drive(gone, "b")  # (returns at once: `running` takes the units left)
        assert gone.units == [] and len(state.pending["b"]) == len(units) - 1
        assert "b" in state.unshareable
    finally:
        running.hold.set()
        driver.join(30)
    assert len(running.units) == len(units) and not state.pending["b"]
    assert state.done == set(units)

    alone = _FakeWorker("b", given_up="its process died")
    state = _state([alone], units)
    state.drive(alone, "b")
    assert len(alone.units) == len(units) and state.done == set(units)


def test_a_slot_goes_on_while_a_finished_process_exits_and_the_last_exits_cleanly(
        tmp_path, monkeypatch):
    """A framework's exit takes seconds (jax's ~1.5 s), during which the slot waited and
    a core idled. The next backend now starts at once; and the last processes, which
    the run's end used to kill once their slots had let go of them, exit as the others
    do (a review). Each backend here takes 3 s to exit and says when it did."""
    import time

    from normspec.conformance.worker import Worker

    notes = tmp_path / "notes"
    monkeypatch.setenv("NORMSPEC_TEST_PIDS", str(notes))
    monkeypatch.setenv("NORMSPEC_TEST_EXIT_S", "3")
    started: dict[str, float] = {}
    real_execute = Worker.execute

    def execute(self, *args, **kwargs):
        started.setdefault(self.requested, time.time())
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(Worker, "execute", execute)
    doc = runner.run(["pid_backend:make_slow_exit_a", "pid_backend:make_slow_exit_b"],
                     checks=["F2.values"], dtypes=["float32"], examples=2, jobs=1)
    assert doc["runs"][0]["complete"]
    exited = dict(line.split(" exited ") for line in notes.read_text().splitlines())
    assert set(exited) == {"numpy_exit_a", "numpy_exit_b"}  # neither was killed
    # b's first unit started while a was still exiting
    assert started["pid_backend:make_slow_exit_b"] < float(exited["numpy_exit_a"]) - 1.0
