"""Backends that go for the harness around them rather than the math: each does what code
in a backend's process can do to a run (fork into it, write on its pipe, die leaving a
child that holds the pipe, raise an exception that is not an Exception, declare data
that is not plain, start processes of its own, print into a closed pipe, hang when loaded
again after a death). tests/test_results_survive.py runs
them through `normspec run`; each must cost its own check at most, with a message."""

from __future__ import annotations

import gc
import os
import sys
import time

from normspec.impls.numpy_ref import NumpyBackend


class ForksIntoTheHarness(NumpyBackend):
    """LayerNorm forks once, and both processes return from it (the child never exits):
    two processes answer the run on one pipe."""

    forked = False

    def layer_norm(self, *args, **kwargs):
        if not ForksIntoTheHarness.forked:
            ForksIntoTheHarness.forked = True
            os.fork()
        return super().layer_norm(*args, **kwargs)


class WritesOnThePipe(NumpyBackend):
    """LayerNorm sends bytes that are no message on every pipe end of its process."""

    def layer_norm(self, *args, **kwargs):
        from multiprocessing.connection import Connection

        for conn in [o for o in gc.get_objects() if isinstance(o, Connection)]:
            conn.send_bytes(b"\x00 not a message")
        return super().layer_norm(*args, **kwargs)


class DiesLeavingAChild(NumpyBackend):
    """LayerNorm forks a child that sleeps (holding the pipe open), then exits with 3."""

    def layer_norm(self, *args, **kwargs):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        os._exit(3)


class LeavesADaemon(NumpyBackend):
    """Correct, but its first LayerNorm call starts a daemon (two forks, setsid between:
    out of the worker's process group) that sleeps for five minutes, its pid written to
    the file $DAEMON_PID_FILE."""

    def layer_norm(self, *args, **kwargs):
        if not getattr(self, "started", False):
            self.started = True
            middle = os.fork()
            if middle == 0:
                os.setsid()
                if os.fork() == 0:
                    null = os.open(os.devnull, os.O_RDWR)
                    for fd in (0, 1, 2):  # as daemons do: the run's output is not held
                        os.dup2(null, fd)
                    with open(os.environ["DAEMON_PID_FILE"], "w") as f:
                        f.write(str(os.getpid()))
                    time.sleep(300)
                os._exit(0)
            os.waitpid(middle, 0)
        return super().layer_norm(*args, **kwargs)


class _KernelAbort(BaseException):
    """Not an Exception: what `except Exception` lets through."""


class RaisesABaseException(NumpyBackend):
    def layer_norm(self, *args, **kwargs):
        raise _KernelAbort("the kernel aborted")


_POOL = None


class RunsAProcessPool(NumpyBackend):
    """Correct: LayerNorm computed in a process pool of its own, as a backend may."""

    def layer_norm(self, *args, **kwargs):
        global _POOL
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context

        if _POOL is None:
            _POOL = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
        return _POOL.submit(NumpyBackend().layer_norm, *args, **kwargs).result()


class _RunsCodeWhenUnpickled(str):
    def __reduce__(self):
        return (os._exit, (7,))


class ReasonRunsCode(NumpyBackend):
    """A deviation reason whose unpickling would end the process that unpickles it."""

    deviations = ({"check": "F2.values", "reason": _RunsCodeWhenUnpickled("documented")},)


class NotPlainDeviation(NumpyBackend):
    """A deviation entry whose reason is an object, not text."""

    deviations = ({"check": "F2.values", "reason": object()},)


class PrintsInsideOps(NumpyBackend):
    """Correct, and chatty: every LayerNorm prints a line on stdout and one on stderr, and
    writes one on file descriptor 1 as a C library's printf would (its error ignored)."""

    def layer_norm(self, *args, **kwargs):
        import ctypes

        print("PrintsInsideOps: print", flush=True)
        print("PrintsInsideOps: print to stderr", file=sys.stderr, flush=True)
        line = b"PrintsInsideOps: written on fd 1\n"
        ctypes.CDLL(None).write(1, line, len(line))
        return super().layer_norm(*args, **kwargs)


class DiesThenHangsLoading(NumpyBackend):
    """Dies in its first LayerNorm (exit code 9), and every load after the first hangs, as
    on a lock the dead process held. Each load appends a line to $NORMSPEC_TEST_LOADS."""

    def __init__(self):
        super().__init__()
        path = os.environ["NORMSPEC_TEST_LOADS"]
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
        with open(path, encoding="utf-8") as f:
            if len(f.read().split()) > 1:
                time.sleep(600)

    def layer_norm(self, *args, **kwargs):
        os._exit(9)


for _cls in (ForksIntoTheHarness, WritesOnThePipe, DiesLeavingAChild, RaisesABaseException,
             RunsAProcessPool, ReasonRunsCode, NotPlainDeviation, PrintsInsideOps,
             DiesThenHangsLoading):
    _cls.name = _cls.__name__.lower()


class _PipeWriter(NumpyBackend):
    """LayerNorm writes `payload` on every pipe end of its process, as bytes."""

    payload = b""

    def layer_norm(self, *args, **kwargs):
        from multiprocessing.connection import Connection

        for conn in [o for o in gc.get_objects() if isinstance(o, Connection)]:
            conn.send_bytes(self.payload) if self.payload[:1] != b"\xff" else \
                os.write(conn.fileno(), self.payload[1:])
        return super().layer_norm(*args, **kwargs)


class SendsDeepJson(_PipeWriter):
    """A message nested too deep to decode (json.loads raises RecursionError)."""

    payload = b"[" * 100_000 + b"]" * 100_000


class SendsAHugeLength(_PipeWriter):
    """A raw length header of 2^31 - 1 bytes, past what the run reads: the pipe closes."""

    payload = b"\xff" + (0x7FFFFFFF).to_bytes(4, "big")


for _cls in (SendsDeepJson, SendsAHugeLength):
    _cls.name = _cls.__name__.lower()
