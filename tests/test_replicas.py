"""The replica processes of data-parallel adapters (impls/_replicas.py): a group answers,
keeps living after a consistent refusal, and is killed, never left hanging, when a rank
dies, hangs or disagrees; every process it started is gone afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from normspec.impls._replicas import ReplicaError, ReplicaFailure, ReplicaGroup

TESTS = str(Path(__file__).resolve().parent)


def group(world=2, **env):
    return ReplicaGroup("replica_modules", world, env={"PYTHONPATH": TESTS, **env})


def gone(procs):
    return all(p.poll() is not None for p in procs)


def test_a_group_answers_and_survives_a_refusal_by_every_rank():
    g = group()
    try:
        assert g.run([{}, {}]) == [0, 1]
        with pytest.raises(ReplicaError, match="ValueError: refused by the framework"):
            g.run([{0: "raise"}, {1: "raise"}])
        procs = list(g.procs)
        assert g.run([{}, {}]) == [0, 1] and g.procs == procs  # the same processes
    finally:
        g.close()
    assert gone(procs)


@pytest.mark.parametrize("job,message", [
    ([{}, {1: "die"}], "replica 1 died while running"),
    ([{}, {1: "hang"}], r"replica\(s\) \[1\] did not answer within 2 s"),
    ([{0: "raise"}, {}], "replicas disagreed: 1 of 2 raised ValueError"),
])
def test_a_rank_that_dies_hangs_or_disagrees_fails_the_call_and_the_group_is_killed(job, message):
    g = group()
    g.start()
    procs = list(g.procs)
    with pytest.raises(ReplicaFailure, match=message):
        g.run(job, timeout=2.0)
    assert gone(procs) and not g.procs
    assert g.run([{}, {}]) == [0, 1]  # the next call starts a fresh group
    g.close()


def test_a_group_that_cannot_start_says_why():
    g = group(REPLICA_SETUP_FAILS="1")
    with pytest.raises(ReplicaFailure, match="could not start: RuntimeError: no collective here"):
        g.start()
    assert not g.procs


def test_replicas_die_with_their_parent(tmp_path):
    """PR_SET_PDEATHSIG: a killed backend process leaves no replica working on."""
    import signal
    import subprocess
    import sys
    import time

    script = (f"import sys; sys.path.insert(0, {TESTS!r})\n"
              "from normspec.impls._replicas import ReplicaGroup\n"
              f"g = ReplicaGroup('replica_modules', 2, env={{'PYTHONPATH': {TESTS!r}}})\n"
              "g.start()\nprint(' '.join(str(p.pid) for p in g.procs), flush=True)\n"
              "import time; time.sleep(3600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped by init) is dead
        return f.read().split()[2] != "Z"


class ReplicasThatCannotStart:
    """numpy, but its data-parallel BatchNorm runs in replica processes that fail to set
    up (a rendezvous that cannot happen, say)."""

    def __new__(cls):
        from normspec.impls.numpy_ref import NumpyBackend

        class Backend(NumpyBackend):
            name = "replicas_that_cannot_start"

            def data_parallel_batch_norm(self, steps, **kwargs):
                g = group(world=len(steps[0]), REPLICA_SETUP_FAILS="1")
                try:
                    g.run([{}] * len(steps[0]))
                finally:
                    g.close()

        return Backend()


def test_a_dp_check_whose_processes_cannot_start_is_an_error_for_that_check_alone():
    from normspec.conformance import runner

    doc = runner.run(["test_replicas:ReplicasThatCannotStart"], checks=["DP1.e4_split", "F2.values"],
                     dtypes=["float32"], examples=2)
    by_check = {r["check"]: r for r in doc["records"]}
    assert by_check["DP1.e4_split"]["status"] == "error"
    assert "could not start: RuntimeError: no collective here" in by_check["DP1.e4_split"]["message"]
    assert by_check["F2.values"]["status"] == "pass" and doc["runs"][0]["complete"]
