import os
import sys

from hypothesis import settings

# the test helpers (oracle_backend, broken_backends) import each other by module name
sys.path.insert(0, os.path.dirname(__file__))

# Deterministic property tests: the same examples on every run, so CI cannot flake; a
# failure prints the example and the blob that replays it.
settings.register_profile("normspec-tests", max_examples=80, deadline=None, derandomize=True,
                          print_blob=True)
settings.load_profile("normspec-tests")
