"""A check's drawn examples depend on the seed alone: not on whether normspec is installed
editable, nor on which of the user's own modules are loaded. Hypothesis mixes literal
numbers from the source of loaded modules outside site-packages into its draws;
`seed_only_draws` (what `Context.explore` draws under) shuts that source off."""

from __future__ import annotations

import importlib
import sys

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from normspec.conformance.context import seed_only_draws

#: Literals the planted module holds: a draw that returns one took it from there.
PLANTED = (987654321, 3141592653, 0.7182818284, 1234.5678)


def _draws(guarded: bool) -> list:
    drawn = []

    @seed(0)
    @settings(max_examples=300, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2**32 - 1), st.floats(0.0, 1e4))
    def run(i, f):
        drawn.append((i, f))

    if guarded:
        with seed_only_draws():
            run()
    else:
        run()
    return drawn


def test_draws_ignore_constants_of_loaded_modules(tmp_path, monkeypatch):
    before = _draws(guarded=True)
    folder = tmp_path / "user_code"  # not under a folder named "test(s)": Hypothesis reads it
    folder.mkdir()
    (folder / "planted_backend.py").write_text(
        "".join(f"C{i} = {v!r}\n" for i, v in enumerate(PLANTED)))
    monkeypatch.syspath_prepend(str(folder))
    importlib.import_module("planted_backend")
    try:
        after = _draws(guarded=True)
        unguarded = _draws(guarded=False)
    finally:
        sys.modules.pop("planted_backend", None)
    assert after == before, "the same seed drew other examples once a local module was loaded"
    # the guard is what keeps them equal: without it the planted literals are drawn
    taken = {v for pair in unguarded for v in pair} & set(PLANTED)
    assert taken, ("Hypothesis drew none of the planted constants without the guard; this "
                   "test no longer shows that the guard does anything")
