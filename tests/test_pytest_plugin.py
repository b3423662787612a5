"""The pytest plugin: `pytest --normspec-backend module:factory` runs the checks inside
a user's own suite, failing with the spec's message and repro."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def run_pytest(tmp_path, *args, env=None):
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(TESTS))
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


@pytest.mark.parametrize("backend, item", [("test_conventions:Documented", "documented"),
                                           ("test_pytest_plugin:StaleUnnamed", "stale_unnamed")])
def test_a_stale_deviation_fails_strictly(tmp_path, backend, item):
    """An entry that explains no record of the session fails it, as an item of its own
    named by the entry, whether it names a check or not (one naming none, only an op, had
    a line in the terminal summary and exit code 0: found by a review)."""
    proc = run_pytest(tmp_path, "--normspec-backend", backend, "--normspec-check", "F2.values",
                      "-rf")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    assert f"FAILED ::{item}::deviations[0] - [XPASS(strict)]" in proc.stdout, proc.stdout[-3000:]
    assert f"\n[XPASS(strict)] stale deviation entry of {backend}: {{" in proc.stdout
    assert "no longer deviates" in proc.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_an_entry_is_stale_only_if_the_whole_session_needs_it(tmp_path, workers):
    """The README's entry, a check and no dtype, for a deviation in float32 only: its
    float64 item passes and the entry is not stale, as `normspec run` judges it (the
    plugin judged each item alone and failed the float64 one as a stale XPASS(strict):
    found by a review). Under xdist the two items may run in different workers."""
    proc = run_pytest(tmp_path, *workers, "--normspec-backend", "test_pytest_plugin:Float32Off",
                      "--normspec-dtype", "float64", "--normspec-check", "E1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed, 1 xfailed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("option, value", [
    ("--normspec-check", "F99"), ("--normspec-dtype", "float3"),
    ("--normspec-examples", "0"), ("--normspec-examples", "-5"), ("--normspec-examples", "ten"),
    ("--normspec-seed", "-1"), ("--normspec-seed", str(2**63)),
    ("--normspec-timeout", "0"), ("--normspec-timeout", "-1"), ("--normspec-timeout", "nan"),
    ("--normspec-backend", "nosuch")])
def test_a_bad_option_is_a_usage_error_before_any_work(tmp_path, option, value):
    """As `normspec run` refuses its arguments (the same parsers): one line naming the
    value, pytest's usage error (exit code 4), and no backend loaded (a bad check or dtype
    was an INTERNALERROR traceback after the backends had loaded; 0 examples, a negative
    seed and a timeout of 0 were taken: found by a review)."""
    pids = tmp_path / "pids"
    proc = run_pytest(tmp_path, "--normspec-backend", "pid_backend:make_backend",
                      "--normspec-check", "E1", f"{option}={value}",
                      env={"NORMSPEC_TEST_PIDS": str(pids)})
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"ERROR: {option}: ") and repr(value) in line, line
    assert not pids.exists()


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
    assert "2 failed, 8 passed" in proc.stdout, proc.stdout[-3000:]
    assert "NaiveVariance::B1.layer_norm_shift[float32]" in proc.stdout
    assert "stale_unnamed::deviations[0]" in proc.stdout
    assert "stale deviation entry of test_pytest_plugin:StaleUnnamed" in proc.stdout


class StaleUnnamed:
    """numpy with a deviation entry naming no check, that explains nothing: the session
    fails with an item for it at its end (judged on every item's records, from every
    worker)."""

    def __new__(cls):
        from normspec.impls.numpy_ref import NumpyBackend

        backend = NumpyBackend()
        backend.name = "stale_unnamed"
        backend.deviations = ({"op": "layer_norm", "reason": "never needed"},)
        return backend


class Float32Off:
    """numpy with LayerNorm's float32 output 1% off, and the entry for it as the README
    writes one: a check and a reason, no dtype."""

    def __new__(cls):
        import numpy as np
        from normspec.impls.numpy_ref import NumpyBackend

        class Backend(NumpyBackend):
            name = "float32_off"
            deviations = ({"check": "E1", "reason": "float32 LayerNorm output is 1% off"},)

            def layer_norm(self, x, *args, **kwargs):
                out = super().layer_norm(x, *args, **kwargs)
                if x.dtype != np.float32:
                    return out
                return out._replace(output=(out.output * 1.01).astype(x.dtype))

        return Backend()
