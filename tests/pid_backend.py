"""The numpy backend, and a note of each process that loads it: the file named by
$NORMSPEC_TEST_PIDS gets the process id, one line per load, and the version says the
process's OMP_WAIT_POLICY (tests/test_sharing.py). $NORMSPEC_TEST_SLOW (seconds) makes
every LayerNorm/RMSNorm call that much slower, so that a run lasts long enough to share."""

from __future__ import annotations

import atexit
import os
import time

from normspec.impls.numpy_ref import NumpyBackend


class PidBackend(NumpyBackend):
    name = "numpy_pid"

    def __init__(self):
        super().__init__()
        self.version = f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
        self.slow = float(os.environ.get("NORMSPEC_TEST_SLOW", "0"))

    def layer_norm(self, *args, **kwargs):
        time.sleep(self.slow)
        return super().layer_norm(*args, **kwargs)

    def rms_norm(self, *args, **kwargs):
        time.sleep(self.slow)
        return super().rms_norm(*args, **kwargs)


def make_backend():
    with open(os.environ["NORMSPEC_TEST_PIDS"], "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    return PidBackend()


class SlowExit(NumpyBackend):
    """The numpy backend whose process takes $NORMSPEC_TEST_EXIT_S seconds to exit, then
    notes "<name> exited <time>" in $NORMSPEC_TEST_PIDS (only if it exits, not killed)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        atexit.register(self._exit)

    def _exit(self):
        time.sleep(float(os.environ.get("NORMSPEC_TEST_EXIT_S", "0")))
        with open(os.environ["NORMSPEC_TEST_PIDS"], "a", encoding="utf-8") as f:
            f.write(f"{self.name} exited {time.time()}\n")


def make_slow_exit_a():
    return SlowExit("numpy_exit_a")


def make_slow_exit_b():
    return SlowExit("numpy_exit_b")
