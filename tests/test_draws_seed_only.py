"""A check's drawn examples depend on the seed alone: not on whether normspec is installed
editable, nor on which of the user's own modules are loaded. Hypothesis collects the
literals of loaded modules outside site-packages into its draws; `Context.explore` draws
under `seed_only_draws`, which shuts that source off.

Run in a fresh interpreter: Hypothesis's collected constants only ever grow, so a planted
module would otherwise stay in the draws of every later test of the session."""

from __future__ import annotations

import json
import subprocess
import sys

#: Literals of the planted module, none of which normspec or Hypothesis holds.
PLANTED = (987654321, 3141592653, 0.7182818284, 1234.5678)

SCRIPT = """
import importlib, json, sys
from hypothesis import strategies as st
from normspec.conformance.context import Context
from normspec.impls.protocol import np_dtype

def draws():
    ctx = Context(backend_name="b", source="tests", backend=None, check_id="c", claim="F2",
                  op="layer_norm", dtype=np_dtype("float32"), seed=0, examples=300)
    got = []
    ctx.explore("draws", st.tuples(st.integers(0, 2**32 - 1), st.floats(0.0, 1e4)), got.append)
    return got, ctx.records[-1].status

before, status = draws()
sys.path.insert(0, sys.argv[1])
importlib.import_module("planted_backend")
from hypothesis.internal.conjecture import providers
seen = providers._get_local_constants()  # outside a check: Hypothesis's own view
after, _ = draws()
print(json.dumps({"status": status, "drawn": len(before), "equal": before == after,
                  "collected": sorted(set(seen.integers) | set(seen.floats))}))
"""


def test_explore_draws_ignore_constants_of_loaded_modules(tmp_path):
    folder = tmp_path / "user_code"  # not under a folder named "test(s)": Hypothesis reads it
    folder.mkdir()
    (folder / "planted_backend.py").write_text(
        "".join(f"C{i} = {v!r}\n" for i, v in enumerate(PLANTED)))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["status"] == "pass" and got["drawn"] >= 100, got
    # the planted literals reached Hypothesis, so equal draws below are the guard's doing
    assert set(PLANTED) <= set(got["collected"]), (
        f"Hypothesis did not collect the planted literals {PLANTED}: this test no longer "
        "exercises the guard")
    assert got["equal"], "the same seed drew other examples once a local module was loaded"
