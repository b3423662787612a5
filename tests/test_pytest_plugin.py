"""The pytest plugin: `pytest --normspec-backend module:factory` runs the checks inside
a user's own suite, failing with the spec's message and repro."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run_pytest(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                           "--normspec-dtype", "float32", "--normspec-examples", "3", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_a_conforming_backend_passes(tmp_path):
    proc = run_pytest(tmp_path, "--normspec-backend", "numpy", "--normspec-check", "F2",
                      "--normspec-check", "F6.values")
    assert proc.returncode == 0, proc.stdout[-3000:]
    # "F2" selects every check of the claim, the F2/F3 ones included; float32 only
    from normspec.conformance.runner import select_checks

    items = [c for c in select_checks(["F2", "F6.values"]) if c.dtypes in (None, ("float32",))
             or "float32" in (c.dtypes or ())]
    assert any(c.claim == "F2/F3" for c in items)
    assert f"{len(items)} passed" in proc.stdout


def test_a_broken_backend_fails_with_message_and_repro(tmp_path):
    proc = run_pytest(tmp_path, "--normspec-backend", "broken_backends:NaiveVariance",
                      "--normspec-check", "B1.layer_norm_shift")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "NaiveVariance::B1.layer_norm_shift[float32]" in proc.stdout
    assert "but the spec says" in proc.stdout and "--- repro ---" in proc.stdout


def test_unsupported_is_a_visible_skip(tmp_path):
    proc = run_pytest(tmp_path, "--normspec-backend", "numpy", "--normspec-check",
                      "B6.no_grad_still_updates")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "SKIPPED" in proc.stdout and "no_grad_mode = False" in proc.stdout


def test_a_stale_deviation_fails_strictly(tmp_path):
    proc = run_pytest(tmp_path, "--normspec-backend", "test_conventions:Documented",
                      "--normspec-check", "F2.values")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "XPASS(strict)" in proc.stdout and "no longer deviates" in proc.stdout


def test_a_declared_convention_is_an_xfail_with_its_reason(tmp_path):
    proc = run_pytest(tmp_path, "--normspec-backend", "broken_backends:BiasedDeclared",
                      "--normspec-check", "F4.running_stats", "-rx")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 xfailed" in proc.stdout and "running_var_estimator" in proc.stdout


def test_the_plugin_runs_under_xdist_workers(tmp_path):
    """pytest -n 2: each xdist worker starts its own backend processes for its items; the
    stale-entry summary, gathered from the reports, still reaches the controller."""
    proc = run_pytest(tmp_path, "-n", "2", "--normspec-backend", "numpy",
                      "--normspec-backend", "broken_backends:NaiveVariance",
                      "--normspec-backend", "test_pytest_plugin:StaleUnnamed",
                      "--normspec-check", "F2.values", "--normspec-check", "B1.layer_norm_shift",
                      "--normspec-check", "F6.values")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "2 workers" in proc.stdout or "gw1" in proc.stdout, proc.stdout[-3000:]
    assert "1 failed, 8 passed" in proc.stdout, proc.stdout[-3000:]
    assert "NaiveVariance::B1.layer_norm_shift[float32]" in proc.stdout
    assert "stale deviation entry of test_pytest_plugin:StaleUnnamed" in proc.stdout


class StaleUnnamed:
    """numpy with a deviation entry naming no check, that explains nothing: the summary at
    the end of the session says so (it needs every item's records, from every worker)."""

    def __new__(cls):
        from normspec.impls.numpy_ref import NumpyBackend

        backend = NumpyBackend()
        backend.name = "stale_unnamed"
        backend.deviations = ({"op": "layer_norm", "reason": "never needed"},)
        return backend
