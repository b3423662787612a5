"""One rank of a ReplicaGroup (impls/_replicas.py): `python -m
normspec.impls._replica_child MODULE RANK WORLD PORT`.

It imports the replica module, calls `replica_setup(rank, world, port)` once and
`replica_run(state, job)` for every job read from stdin, answering each on stdout
("ready", "ok" with the result, or "error" with the exception's type and text). The
framework's own printing goes to stderr: stdout carries answers only."""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys

from normspec.impls._replicas import HEADER, _send


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: EOF on stdin still ends the child
        pass


def _read(stream):
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    return pickle.loads(stream.read(n))


def main(argv: list[str]) -> int:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides, and kills
    module, rank, world, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the framework prints goes to the log, not into the answers
    jobs = sys.stdin.buffer
    try:
        mod = importlib.import_module(module)
        state = mod.replica_setup(rank, world, port)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which gives up
        _send(answers, ("error", type(exc).__name__, str(exc)))
        return 1
    _send(answers, ("ready",))
    while True:
        msg = _read(jobs)
        if msg is None:
            return 0
        try:
            _send(answers, ("ok", mod.replica_run(state, msg[1])))
        except Exception as exc:  # noqa: BLE001 - the framework's refusal is a finding
            _send(answers, ("error", type(exc).__name__, str(exc)))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
