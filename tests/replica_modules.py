"""A replica module (impls/_replicas.py) whose ranks do what each job tells them: answer
their rank, raise, die or hang; for test_replicas.py."""

from __future__ import annotations

import os
import time


def replica_setup(rank, world, port):
    if os.environ.get("REPLICA_SETUP_FAILS"):
        raise RuntimeError("no collective here")
    return {"rank": rank}


def replica_run(state, job):
    what = job.get(state["rank"], "answer")
    if what == "die":
        os._exit(3)
    if what == "hang":
        time.sleep(3600)
    if what == "raise":
        raise ValueError("refused by the framework")
    return state["rank"]
