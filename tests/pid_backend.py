"""The numpy backend, and a note of each process that loads it: the file named by
$NORMSPEC_TEST_PIDS gets the process id, one line per load, and the version says the
process's OMP_WAIT_POLICY (tests/test_sharing.py)."""

from __future__ import annotations

import os

from normspec.impls.numpy_ref import make_backend as _numpy


def make_backend():
    with open(os.environ["NORMSPEC_TEST_PIDS"], "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    backend = _numpy()
    backend.name = "numpy_pid"
    backend.version = f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
    return backend
