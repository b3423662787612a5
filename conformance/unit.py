"""One unit of work, in the process that holds the backend: one check, one backend, one
dtype, turned into records. The run (runner.py) sends units to backend processes
(worker.py); the pytest plugin and normspec's own tests call `run_check` directly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
from normspec.impls import registry
from normspec.impls.protocol import Capabilities

from . import deviations
from .cases import dtype_of
from .checks import Check
from .context import Context, exception_text
from .results import Record


def why_unsupported(check: Check, caps: Capabilities, dtype: str) -> str | None:
    """The capability a backend lacks for this check and dtype, or None. A check that
    drives several ops runs when the backend has any of them in this dtype (the cases of
    the others are recorded unsupported one by one); a check of no particular op (the
    protocol's) when any op runs in this dtype."""
    ops = check.ops or tuple(caps.ops)
    if not any(op in caps.ops for op in ops):
        return f"capabilities do not list {', '.join(ops) or 'any op'}"
    if not any(caps.supports(op, dtype) for op in ops):
        return f"capabilities list no {'/'.join(o for o in ops if o in caps.ops)} in {dtype}"
    for need in check.needs:
        if need == "gradients":
            if not any(caps.has_gradient(op, dtype) for op in ops):
                return f"capabilities list no gradients of {'/'.join(ops)} in {dtype}"
        elif not getattr(caps, need, False):
            return f"capabilities say {need} = False"
    return None


def run_check(loaded: registry.LoadedBackend, check: Check, dtype: str, *, seed: int,
              examples: int, timeout: float | None = None, shrink: bool = False,
              emit: Callable[[Record], None] | None = None) -> list[Record]:
    """One check for one backend and dtype; returns its records, and passes each to
    `emit` the moment its case ends (deviations already applied).

    With `timeout` None the check runs in the calling thread (a backend process, whose
    parent enforces the time limit). With a timeout it runs in a daemon thread that is
    abandoned when it overruns: in-process callers (the pytest plugin) cannot stop a
    hung backend, only stop waiting for it; `normspec run` never relies on this."""
    backend = loaded.backend
    base = dict(backend=loaded.name, check=check.id, claim=check.claim,
                op="/".join(check.ops), dtype=dtype, seed=seed)
    if check.dtypes is not None and dtype not in check.dtypes:
        return []  # outside the check's domain (e.g. float16 subnormals): nothing to record
    records: list[Record] = []

    def finish(rec: Record) -> None:
        rec.seed = seed
        if rec.status == "fail":
            reason = deviations.reason_for(asdict(rec), loaded.deviations)
            if reason:
                rec.status, rec.reason = "deviation", reason
        records.append(rec)
        if emit is not None:
            emit(rec)

    try:
        # the backend's own declarations, read by the harness's code: one that raises, or
        # is not a Capabilities, is this unit's error, named (it ended the process, and
        # the record said "its process died": a red team)
        declared = "capabilities"
        why = why_unsupported(check, backend.capabilities, dtype)
        declared = "conventions"
        conventions = getattr(backend, "conventions", None)
    except Exception as exc:  # noqa: BLE001 - a third party's broken declaration
        finish(Record(**base, case="all", status="error",
                      message=f"reading the backend's {declared} raised {exception_text(exc)}"))
        return records
    if why:
        finish(Record(**base, case="all", status="unsupported", message=why))
        return records
    ctx = Context(backend_name=loaded.name, source=loaded.requested, backend=backend, shrink=shrink,
                  check_id=check.id, claim=check.claim, op=base["op"], dtype=dtype_of(dtype),
                  seed=seed, examples=examples, conventions=conventions, on_record=finish)
    box: dict = {}

    def body():
        try:
            # findings go into records; NumPy's floating-point warnings would only be noise
            with np.errstate(all="ignore"):
                check.fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a crash outside any case
            box["error"] = f"{type(exc).__name__}: {exc}"

    start = time.perf_counter()
    if timeout is None:
        body()
    else:
        worker = threading.Thread(target=body, name=f"normspec-{loaded.name}-{check.id}",
                                  daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            ctx.on_record = None  # the abandoned thread's later cases are not this unit's
            done = len(records)
            finish(Record(**base, case="timeout", status="error",
                          duration_s=round(time.perf_counter() - start, 3),
                          message=f"timed out after {timeout:g} s (the backend hung or is too "
                                  f"slow); {done} case(s) had finished"))
            return records
    elapsed = round(time.perf_counter() - start, 3)
    if "error" in box:
        finish(Record(**base, case="check body", status="error", message=box["error"],
                      duration_s=elapsed))
    if not records:
        finish(Record(**base, case="all", status="error", duration_s=elapsed,
                      message="the check produced no result (a defect in normspec)"))
    return records


def backend_entry(loaded: registry.LoadedBackend, label: str) -> dict:
    """The backend as the results file lists it: source, version, availability,
    capabilities, conventions and documented deviations."""
    b = loaded.backend
    entry = {"name": loaded.name, "source": loaded.source, "available": loaded.available,
             "error": loaded.error, "deviations": loaded.deviations, "run": label,
             "version": str(getattr(b, "version", "")) if b else "",
             "capabilities": {}, "conventions": {}}
    if b is not None:
        for key in ("capabilities", "conventions"):
            try:
                obj: Any = getattr(b, key, None)
                entry[key] = obj.as_dict() if hasattr(obj, "as_dict") else dict(vars(obj))
            except Exception as exc:  # noqa: BLE001 - a third party's broken declaration
                entry[key] = {"error": f"{type(exc).__name__}: {exc}"}
        if not isinstance(entry["conventions"].get("reasons", {}), dict):
            # the checks read a missing reasons table as none; so does the report
            entry["conventions"]["reasons"] = {}
    return entry
