"""pytest plugin (entry point `pytest11`): run normspec's conformance checks inside a
user's own test suite.

    pytest --normspec-backend my_kernels:make_backend [--normspec-dtype float32]
           [--normspec-check F2] [--normspec-examples 10] [--normspec-seed 0]

Each (backend, check, dtype) becomes one test item. A failing or erroring record fails
the item with the spec's message and the repro snippet; a documented deviation is an
xfail with its reason; unsupported is a skip that says which capability is missing.
"""

from __future__ import annotations

import pytest
from normspec.impls import registry

from . import runner


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
    def __init__(self, *, loaded, check, dtype, **kwargs):
        super().__init__(**kwargs)
        self.loaded, self.check, self.dtype = loaded, check, dtype
        self.records = []

    def runtest(self):
        if not self.loaded.available:
            raise NormspecFailure(f"backend {self.loaded.requested!r} could not be used: "
                                  f"{self.loaded.error}")
        opt = self.config.getoption
        self.records = runner.run_check(self.loaded, self.check, self.dtype,
                                        seed=opt("normspec_seed"),
                                        examples=opt("normspec_examples"),
                                        timeout=opt("normspec_timeout"))
        bad = [r for r in self.records if r.status in ("fail", "error")]
        if bad:
            raise NormspecFailure("\n\n".join(
                f"[{r.status}] {r.case}: {r.message}\n--- repro ---\n{r.repro}" for r in bad))
        statuses = {r.status for r in self.records}
        if statuses == {"unsupported"}:
            pytest.skip(f"unsupported: {self.records[0].message}")
        if "deviation" in statuses:
            reasons = sorted({r.reason for r in self.records if r.status == "deviation"})
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
    for spec in specs:
        try:
            loaded = registry.load(spec)
        except registry.UnknownBackend as exc:
            loaded = registry.LoadedBackend(spec, spec, error=str(exc))
        for check in checks:
            for dtype in dtypes:
                items.append(NormspecItem.from_parent(
                    session, name=f"{loaded.name}::{check.id}[{dtype}]", loaded=loaded,
                    check=check, dtype=dtype))
