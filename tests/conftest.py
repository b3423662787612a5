import os
import sys

from hypothesis import settings
from normspec.conformance.worker import CHILD_ENV

# this process loads several frameworks' OpenMP runtimes (torch, numba) side by side, as
# a backend process of `normspec run` does: their threads wait passively, not spinning
for _key, _value in CHILD_ENV.items():
    os.environ.setdefault(_key, _value)

# the test helpers (oracle_backend, broken_backends) import each other by module name
sys.path.insert(0, os.path.dirname(__file__))

# Deterministic property tests: the same examples on every run, so CI cannot flake; a
# failure prints the example and the blob that replays it.
settings.register_profile("normspec-tests", max_examples=80, deadline=None, derandomize=True,
                          print_blob=True)
settings.load_profile("normspec-tests")
