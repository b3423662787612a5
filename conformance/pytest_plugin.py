"""pytest plugin (entry point `pytest11`): run normspec's conformance checks inside a
user's own test suite.

    pytest --normspec-backend my_kernels:make_backend [--normspec-dtype float32]
           [--normspec-check F2] [--normspec-examples 10] [--normspec-seed 0]

Each (backend, check, dtype) becomes one test item. A failing or erroring record fails
the item with the spec's message and the repro snippet; a documented deviation is an
xfail with its reason; unsupported is a skip that says which capability is missing.

Each backend runs in a process of its own, as in `normspec run` (worker.py): a backend
that hangs past --normspec-timeout or crashes fails that item alone, and nothing of it
is left running when the session ends.

Under pytest-xdist (`pytest -n 2 ...`) every xdist worker collects the same items and
starts its own backend processes for the items it runs; nothing is shared between items
but what travels with each test report (the records the end-of-session summary of stale
deviation entries needs, in `user_properties`), so the summary is the same with or
without workers.
"""

from __future__ import annotations

import pytest

from . import deviations, runner
from .worker import Worker

_WORKERS: dict[str, Worker] = {}
#: per backend: (deviations, records) for the end-of-session summary, gathered from the
#: test reports (in the xdist controller too, where no item runs)
_SEEN: dict[str, tuple[list, list]] = {}
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
    group.addoption("--normspec-examples", type=int, default=10,
                    help="Hypothesis examples per drawn case")
    group.addoption("--normspec-seed", type=int, default=0, help="Hypothesis seed")
    group.addoption("--normspec-timeout", type=float, default=120.0,
                    help="seconds per check, backend and dtype")


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
            "backend": self.worker.requested, "deviations": self.worker.deviations,
            "records": [{k: r.get(k, "") for k in _KEPT} for r in self.records]}))
        bad = [r for r in self.records if r["status"] in ("fail", "error")]
        if bad:
            raise NormspecFailure("\n\n".join(
                f"[{r['status']}] {r['case']}: {r['message']}\n--- repro ---\n{r['repro']}"
                for r in bad))
        # strict xfail: an entry written for this check that explains nothing here is
        # stale, so a fixed backend is noticed (entries without a check: see the summary)
        named = [d for d in self.worker.deviations if d.get("check")]
        for entry in deviations.stale(named, self.records):
            raise NormspecFailure(f"[XPASS(strict)] the documented deviation {entry} explains "
                                  "no record of this check: the backend no longer deviates "
                                  "here; remove the entry")
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
            _SEEN.setdefault(value["backend"], (value["deviations"], []))[1].extend(
                value["records"])


def pytest_terminal_summary(terminalreporter):
    for requested, (entries, records) in _SEEN.items():
        for entry in deviations.stale([d for d in entries if not d.get("check")], records):
            terminalreporter.write_line(f"normspec: stale deviation entry of {requested}: {entry} "
                                        "(it selects records of this session but explained none)")


def pytest_sessionfinish(session, exitstatus):
    while _WORKERS:
        _WORKERS.popitem()[1].stop()
