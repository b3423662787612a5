import os
import sys

import pytest
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


@pytest.fixture(autouse=True)
def _numba_codec_flags_are_the_hosts(request):
    """No test starts with the numba codec's flags patched to the portable choice: a
    kernel it compiled would be cached as if compiled for this host, and every later
    process would load it (tests/portable_codec.py says how tests patch them instead)."""
    codec = sys.modules.get("normspec.impls._numba_codec")
    norm_row = sys.modules.get("normspec.impls._numba_norm_row")
    patched = []
    if codec is not None and codec.F16C != _host_choice(request, "f16c", codec._host_has_f16c):
        patched.append(f"_numba_codec.F16C = {codec.F16C}")
    if norm_row is not None and norm_row.BF16_HW != _host_choice(
            request, "bf16", lambda: norm_row.BFLOAT is not None
            and norm_row._host_has_bf16_rounding()):
        patched.append(f"_numba_norm_row.BF16_HW = {norm_row.BF16_HW}")
    assert not patched, (f"{request.node.nodeid} starts with {patched}: a fixture or an "
                         "earlier test left the codec patched")
    yield


def _host_choice(request, key, probe):
    """The host's codec choice `key`, probed once per session."""
    cache = request.config.stash.setdefault(_HOST_CHOICES, {})
    if key not in cache:
        cache[key] = probe()
    return cache[key]


_HOST_CHOICES = pytest.StashKey[dict]()
