"""pytest plugin (entry point `pytest11`): run normspec's conformance checks inside a
user's own test suite.

    pytest --normspec-backend my_kernels:make_backend [--normspec-dtype float32]
           [--normspec-check F2] [--normspec-examples 10] [--normspec-seed 0]

Each (backend, check, dtype) becomes one test item. A failing or erroring record fails
the item with the spec's message and the repro snippet; a documented deviation is an
xfail with its reason; unsupported is a skip that says which capability is missing. A
documented deviation entry that explains no record of the session is stale, judged on all
the session's records as `normspec run` judges it (an entry for float32 has nothing to
explain in float64): each fails the session as an item of its own at its end,
`<backend>::deviations[<n>]`, the n-th entry, as a strict xfail that passed.

A bad option is refused before any backend loads, as `normspec run` refuses its
arguments (the same parsers and limits): one line naming it, pytest's usage error.

Each backend runs in a process of its own, as in `normspec run` (worker.py): a backend
that hangs past --normspec-timeout or crashes fails that item alone, and nothing of it
is left running when the session ends.

Under pytest-xdist (`pytest -n 2 ...`) every xdist worker collects the same items and
starts its own backend processes for the items it runs; nothing is shared between items
but what travels with each test report (the records the judgement of stale deviation
entries needs, in `user_properties`), so the judgement is the same with or without
workers: it is made where the reports meet, in the xdist controller.
"""

from __future__ import annotations

import argparse

import pytest

from . import cli, deviations, runner
from .worker import Worker

_WORKERS: dict[str, Worker] = {}
#: per backend requested: its name, deviation entries and the session's records, for the
#: stale entries at the session's end, gathered from the test reports (in the xdist
#: controller too, where no item runs)
_SEEN: dict[str, dict] = {}
_PROPERTY = "normspec_records"
_KEPT = ("backend", "check", "claim", "op", "dtype", "quantity", "status", "reason")


def pytest_addoption(parser):
    group = parser.getgroup("normspec", "normspec conformance checks")
    group.addoption("--normspec-backend", action="append", default=[],
                    help="backend name or module:factory to check against the normspec oracle")
    group.addoption("--normspec-dtype", action="append", default=[],
                    help="dtype to check (repeatable; default float32, float16, bfloat16, float64)")
    group.addoption("--normspec-check", action="append", default=[],
                    help="check id or claim id prefix (repeatable; default all)")
    # (read as text, parsed in pytest_configure: an argparse type's error would add
    # pytest's usage text to the one line)
    group.addoption("--normspec-examples", default="10",
                    help="Hypothesis examples per drawn case (at least 1; default 10)")
    group.addoption("--normspec-seed", default="0",
                    help="Hypothesis seed (0 to 2**63 - 1; default 0)")
    group.addoption("--normspec-timeout", default="120",
                    help="seconds per check, backend and dtype (default 120)")


#: option, its dest, and `normspec run`'s parser of the same argument
_NUMBERS = (("--normspec-examples", "normspec_examples", cli._positive_int),
            ("--normspec-seed", "normspec_seed", cli._seed),
            ("--normspec-timeout", "normspec_timeout", cli._seconds))


def pytest_configure(config):
    """Refuse a bad option before any backend loads (in the xdist controller, before any
    worker starts), with one line naming it as `normspec run` does; the numbers are
    parsed in place, with the CLI's parsers and limits."""
    for flag, dest, parse in _NUMBERS:
        try:
            setattr(config.option, dest, parse(str(getattr(config.option, dest))))
        except argparse.ArgumentTypeError as exc:
            raise pytest.UsageError(f"{flag}: {exc}") from None
    for flag, select in (("--normspec-check", runner.select_checks),
                         ("--normspec-dtype", runner.check_dtypes)):
        try:
            select(config.getoption(flag) or ())
        except ValueError as exc:
            raise pytest.UsageError(f"{flag}: {exc}") from None
    unknown = cli._unknown_backend(config.getoption("normspec_backend"))
    if unknown:  # (each of its items failed "could not be used"; `normspec run` refuses it)
        raise pytest.UsageError(f"--normspec-backend: {unknown}")


class NormspecItem(pytest.Item):
    def __init__(self, *, worker, check, dtype, **kwargs):
        super().__init__(**kwargs)
        self.worker, self.check, self.dtype = worker, check, dtype
        self.records = []

    def runtest(self):
        if not self.worker.entry.get("available"):
            raise NormspecFailure(f"backend {self.worker.requested!r} could not be used: "
                                  f"{self.worker.error}")
        opt = self.config.getoption
        self.records = self.worker.execute(self.check.id, self.dtype, seed=opt("normspec_seed"),
                                           examples=opt("normspec_examples"), shrink=False,
                                           timeout=opt("normspec_timeout"))
        self.user_properties.append((_PROPERTY, {
            "backend": self.worker.requested, "name": self.worker.entry["name"],
            "deviations": self.worker.deviations,
            "records": [{k: r.get(k, "") for k in _KEPT} for r in self.records]}))
        bad = [r for r in self.records if r["status"] in ("fail", "error")]
        if bad:
            raise NormspecFailure("\n\n".join(
                f"[{r['status']}] {r['case']}: {r['message']}\n--- repro ---\n{r['repro']}"
                for r in bad))
        # (an entry that explains nothing here is judged at the session's end: a
        # deviation in one dtype leaves the entry nothing to explain in the others)
        statuses = {r["status"] for r in self.records}
        if statuses == {"unsupported"}:
            pytest.skip(f"unsupported: {self.records[0]['message']}")
        if "deviation" in statuses:
            reasons = sorted({r["reason"] for r in self.records if r["status"] == "deviation"})
            pytest.xfail("documented deviation: " + " | ".join(reasons))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, NormspecFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"normspec {self.name}"


class NormspecFailure(Exception):
    pass


def pytest_collection_modifyitems(session, config, items):
    specs = config.getoption("normspec_backend")
    if not specs:
        return
    checks = runner.select_checks(config.getoption("normspec_check") or None)
    dtypes = config.getoption("normspec_dtype") or list(runner.DEFAULT_DTYPES)
    timeout = config.getoption("normspec_timeout")
    fresh = [Worker(spec, "pytest") for spec in dict.fromkeys(specs) if spec not in _WORKERS]
    for w in fresh:  # every backend loads at once, each in its own process
        _WORKERS[w.requested] = w
        w.start()
    for w in fresh:
        w.wait_loaded(timeout)
    for spec in dict.fromkeys(specs):
        worker = _WORKERS[spec]
        for check in checks:
            for dtype in runner.check_dtypes(dtypes):
                if check.dtypes is not None and dtype not in check.dtypes:
                    continue  # outside the check's domain: no item, as no record
                items.append(NormspecItem.from_parent(
                    session, name=f"{worker.entry['name']}::{check.id}[{dtype}]", worker=worker,
                    check=check, dtype=dtype))


def pytest_runtest_logreport(report):
    for name, value in getattr(report, "user_properties", ()):
        if name == _PROPERTY and report.when == "call":
            seen = _SEEN.setdefault(value["backend"], {**value, "records": []})
            seen["records"].extend(value["records"])


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """Once every item has run (under xdist: every worker's, in the controller), each
    stale entry fails the session as an item of its own; not after a stop (-x, maxfail),
    whose records are not the session's, nor in an xdist worker, which has only some."""
    result = yield
    if not (hasattr(session.config, "workerinput") or session.shouldfail or session.shouldstop):
        reports = _stale_reports()
        session.testscollected += len(reports)  # (so that the progress ends at 100%)
        for report in reports:
            session.config.hook.pytest_runtest_logreport(report=report)
    return result


def _stale_reports() -> list[pytest.TestReport]:
    """A failed report of each deviation entry that explains no record of the session
    (deviations.stale, as `normspec run` judges), named by its backend and position."""
    out = []
    for requested, seen in _SEEN.items():
        stale = deviations.stale(seen["deviations"], seen["records"])
        for n, entry in enumerate(seen["deviations"]):
            if entry not in stale:
                continue
            name = f"{seen['name']}::deviations[{n}]"
            out.append(pytest.TestReport(
                f"::{name}", (".", None, f"normspec {name}"), {}, "failed",
                f"[XPASS(strict)] stale deviation entry of {requested}: {entry} (it selects "
                "records of this session but explained none: the backend no longer deviates "
                "there; remove the entry)", "call"))
    return out


def pytest_sessionfinish(session, exitstatus):
    while _WORKERS:
        _WORKERS.popitem()[1].stop()
