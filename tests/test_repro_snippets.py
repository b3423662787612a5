"""Every finding's repro runs as printed: each check is run on the broken backend that it
catches (test_harness_catches.CATCHES covers every family), and the repro snippet of
every failing record is executed in a fresh interpreter, where it must finish and, for a
numeric finding, print got against expected with the error in ULPs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from normspec.conformance import runner
from normspec.impls.registry import LoadedBackend
from test_harness_catches import CATCHES, CHECKS, bb

TESTS = Path(__file__).resolve().parent
PER_CHECK = 4


def failing_records():
    out = []
    for check_id, (broken, dtype) in sorted(CATCHES.items()):
        name = next(k for k, v in vars(bb).items() if v is broken)
        loaded = LoadedBackend(name, "tests", backend=broken(), requested=f"broken_backends:{name}")
        recs = runner.run_check(loaded, CHECKS[check_id], dtype, seed=0, examples=3, timeout=60)
        # a few per check: the point is that each kind of repro runs (the shape matrix's
        # broken backends fail dozens of cases alike, each a fresh interpreter here)
        out += [r for r in recs if r.status == "fail"][:PER_CHECK]
    return out


def execute(snippet: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    return subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def executed():
    records = failing_records()
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(execute, [r.repro for r in records]))
    return list(zip(records, procs, strict=True))


def test_every_family_has_failing_records(executed):
    from normspec.conformance.checks import FAMILIES

    families = {CHECKS[r.check].fn.__module__.rsplit(".", 1)[-1] for r, _ in executed}
    assert set(FAMILIES) == families


def test_every_repro_runs_and_shows_the_finding(executed):
    broken = []
    for rec, proc in executed:
        if proc.returncode != 0:
            broken.append(f"{rec.backend} {rec.check} {rec.case}: exit {proc.returncode}\n"
                          f"{proc.stderr[-800:]}\n--- snippet ---\n{rec.repro}")
        elif rec.max_ulp is not None and "ULPs of" not in proc.stdout:
            broken.append(f"{rec.backend} {rec.check} {rec.case}: printed no comparison\n"
                          f"{proc.stdout[-800:]}\n--- snippet ---\n{rec.repro}")
        elif (rec.quantity and not rec.quantity.endswith(".output")
              and rec.quantity.rsplit(".", 1)[-1] not in proc.stdout):
            # the gradient or statistic that failed, not only the ones compared before it
            # (outputs are shown under each op's own name: scores, capped, ...)
            broken.append(f"{rec.backend} {rec.check} {rec.case}: did not show "
                          f"{rec.quantity}\n{proc.stdout[-800:]}\n--- snippet ---\n{rec.repro}")
    assert [] == broken


@pytest.mark.parametrize(("name", "quantities"), [
    ("EmptyBatchSkipsBackward", {"layer_norm.grad_weight", "rms_norm.grad_weight"}),
    ("EmptyBatchSkipsDbeta", {"layer_norm.grad_bias"})])
def test_a_parameter_gradient_finding_shows_that_gradient(name, quantities):
    """Backends wrong in dL/dgamma and dL/dbeta (the first of which fails a record), or in
    dL/dbeta only: each finding's repro prints that gradient against the spec's, not only
    the output and dL/dx that were compared (and agreed) before it."""
    loaded = LoadedBackend(name, "tests", backend=getattr(bb, name)(),
                           requested=f"broken_backends:{name}")
    recs = [r for r in runner.run_check(loaded, CHECKS["F2/F3.row_counts"], "float32", seed=0,
                                        examples=1) if r.status == "fail"]
    assert {r.quantity for r in recs} == quantities
    for rec in recs:
        proc = execute(rec.repro)
        assert proc.returncode == 0, proc.stderr[-800:]
        field = rec.quantity.rsplit(".", 1)[-1]
        assert f"{field}[" in proc.stdout, (
            f"the repro of {rec.quantity} printed\n{proc.stdout}\n--- snippet ---\n{rec.repro}")


@pytest.mark.parametrize(("check_id", "dtype"), [
    ("F2.rounding_bias", "bfloat16"), ("F3.rounding_bias", "float16"),
    ("F1.rounding_bias", "bfloat16"), ("F6.rounding_bias", "float16"),
    ("F8.rounding_bias", "float16")])
def test_a_rounding_bias_repro_prints_the_judged_mean(check_id, dtype):
    """The repro prints the mean signed error the record judged, over the same elements
    (found by a review: it printed the unfiltered, unclipped mean, -0.78 for a correct
    backend's QK scores)."""
    loaded = LoadedBackend("TruncatesHalf", "tests", backend=bb.TruncatesHalf(),
                           requested="broken_backends:TruncatesHalf")
    recs = [r for r in runner.run_check(loaded, CHECKS[check_id], dtype, seed=0, examples=1)
            if r.status == "fail"]
    assert recs
    for rec in recs:
        judged = float(re.search(r"mean signed error ([-+][0-9.]+) ULPs", rec.message).group(1))
        proc = execute(rec.repro)
        assert proc.returncode == 0, proc.stderr[-800:]
        printed = float(re.search(r"as judged\): (\S+)", proc.stdout).group(1))
        assert round(printed, 3) == judged
