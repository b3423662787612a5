"""The runner: every selected check, for every backend and dtype, each in its own
thread with a timeout, so a backend that raises, hangs or misbehaves fails that check
alone and the run goes on."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable
from importlib import metadata

import numpy as np
from normspec.impls import registry
from normspec.impls.protocol import Capabilities

from . import results, tolerances
from .cases import DTYPE_NAMES, dtype_of
from .checks import Check, all_checks
from .context import Context
from .results import Record

DEFAULT_DTYPES = ("float32", "float16", "bfloat16", "float64")
VERSIONED_PACKAGES = ("normspec", "numpy", "ml_dtypes", "hypothesis", "torch", "jax", "flax",
                      "jaxlib", "numba", "triton")


def select_checks(patterns: Iterable[str] | None) -> list[Check]:
    """Checks whose id equals a pattern or starts with it ("F2" selects F2.values, F2.grad)."""
    checks = all_checks()
    if not patterns:
        return checks
    chosen, patterns = [], list(patterns)
    for p in patterns:
        hits = [c for c in checks if c.id == p or c.id.startswith(p + ".") or c.claim == p]
        if not hits:
            raise ValueError(f"unknown check {p!r}; known: {', '.join(c.id for c in checks)}")
        chosen += [c for c in hits if c not in chosen]
    return chosen


def _versions() -> dict[str, str]:
    out = {}
    for pkg in VERSIONED_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def run_info(seed: int, label: str) -> dict:
    return {"run": label, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "seed": seed, "host": platform.node(), "cpu": _cpu(), "platform": platform.platform(),
            "python": sys.version.split()[0], "versions": _versions(), "argv": sys.argv[1:]}


def _why_not(check: Check, caps: Capabilities, dtype: str) -> str | None:
    missing = [op for op in check.ops if op not in caps.ops]
    if missing:
        return f"capabilities do not list {', '.join(missing)}"
    if dtype not in caps.dtypes:
        return f"capabilities do not list dtype {dtype}"
    for need in check.needs:
        if need == "gradients":
            lacking = [op for op in check.ops if op not in caps.gradients]
            if lacking:
                return f"capabilities list no gradients for {', '.join(lacking)}"
        elif not getattr(caps, need, False):
            return f"capabilities say {need} = False"
    return None


def _deviation_reason(rec: Record, deviations: list[dict]) -> str | None:
    """The reason of the first deviation entry that matches a failed record.

    An entry names any of: `check` (an id, an id prefix, or a claim id), `op`, `dtype`,
    and `quantity` (the start of the failing quantity's name, e.g. "layer.running_var"
    or "batch_norm"); every field it names must match."""
    for d in deviations:
        target = d.get("check")
        if target and not (rec.check == target or rec.check.startswith(target + ".")
                           or rec.claim == target):
            continue
        if d.get("dtype") not in (None, rec.dtype) or d.get("op") not in (None, rec.op):
            continue
        quantity = d.get("quantity")
        if quantity and not str(rec.worst.get("what", "")).startswith(quantity):
            continue
        return str(d.get("reason", "documented deviation"))
    return None


def run_check(loaded: registry.LoadedBackend, check: Check, dtype: str, *, seed: int,
              examples: int, timeout: float, shrink: bool = False) -> list[Record]:
    """One check for one backend and dtype, in a worker thread bounded by `timeout`."""
    backend = loaded.backend
    ctx = Context(backend_name=loaded.name, source=loaded.requested, backend=backend, shrink=shrink,
                  check_id=check.id, claim=check.claim, op="/".join(check.ops),
                  dtype=dtype_of(dtype), seed=seed, examples=examples,
                  conventions=getattr(backend, "conventions", None))
    base = dict(backend=loaded.name, check=check.id, claim=check.claim, op=ctx.op, dtype=dtype,
                seed=seed)
    if check.dtypes is not None and dtype not in check.dtypes:
        return []  # outside the check's domain (e.g. float16 subnormals): nothing to record
    why = _why_not(check, backend.capabilities, dtype)
    if why:
        return [Record(**base, case="all", status="unsupported", message=why)]
    box: dict = {}

    def target():
        try:
            # findings go into records; NumPy's floating-point warnings would only be noise
            with np.errstate(all="ignore"):
                check.fn(ctx)
        except Exception as exc:  # noqa: BLE001 - a crash outside any case
            box["error"] = f"{type(exc).__name__}: {exc}"

    start = time.perf_counter()
    worker = threading.Thread(target=target, name=f"normspec-{loaded.name}-{check.id}", daemon=True)
    worker.start()
    worker.join(timeout)
    elapsed = round(time.perf_counter() - start, 3)
    if worker.is_alive():
        done = list(ctx.records)
        return done + [Record(**base, case="timeout", status="error", duration_s=elapsed,
                              message=f"timed out after {timeout:g} s (the backend hung or is "
                                      f"too slow); {len(done)} case(s) had finished")]
    records = list(ctx.records)
    if "error" in box:
        records.append(Record(**base, case="check body", status="error", message=box["error"],
                              duration_s=elapsed))
    if not records:
        records.append(Record(**base, case="all", status="error", duration_s=elapsed,
                              message="the check produced no result (a defect in normspec)"))
    for rec in records:
        rec.seed = seed
        if rec.status == "fail":
            reason = _deviation_reason(rec, loaded.deviations)
            if reason:
                rec.status, rec.reason = "deviation", reason
    return records


def backend_entry(loaded: registry.LoadedBackend, label: str) -> dict:
    b = loaded.backend
    entry = {"name": loaded.name, "source": loaded.source, "available": loaded.available,
             "error": loaded.error, "deviations": loaded.deviations, "run": label,
             "version": str(getattr(b, "version", "")) if b else "",
             "capabilities": {}, "conventions": {}}
    if b is not None:
        for key in ("capabilities", "conventions"):
            obj = getattr(b, key, None)
            try:
                entry[key] = obj.as_dict() if hasattr(obj, "as_dict") else dict(vars(obj))
            except Exception as exc:  # noqa: BLE001 - a third party's broken declaration
                entry[key] = {"error": f"{type(exc).__name__}: {exc}"}
    return entry


def run(backends: list[str] | None = None, *, checks: list[str] | None = None,
        dtypes: list[str] | None = None, seed: int = 0, examples: int = 20,
        timeout: float = 120.0, label: str | None = None, shrink: bool = False,
        progress: Callable[[str], None] | None = None) -> dict:
    """Run the conformance suite and return the results document (see results.py).

    `backends` None means every backend found; those whose framework is missing are
    listed as unavailable. A backend asked for by name that is unknown or unavailable
    gets an error record, so the run fails but still completes.
    """
    say = progress or (lambda _msg: None)
    label = label or os.environ.get("TOX_ENV_NAME") or platform.node() or "local"
    selected = select_checks(checks)
    dtypes = list(dtypes or DEFAULT_DTYPES)
    for d in dtypes:
        if d not in DTYPE_NAMES:
            raise ValueError(f"unknown dtype {d!r}; choose from {', '.join(DTYPE_NAMES)}")
    doc = results.new_document()
    doc["runs"].append(run_info(seed, label))
    doc["tolerances"] = tolerances.table_rows()
    explicit = backends is not None
    names = list(backends) if explicit else list(registry.discover())
    for name in names:
        try:
            loaded = registry.load(name)
        except registry.UnknownBackend as exc:
            loaded = registry.LoadedBackend(name, name, error=str(exc))
        doc["backends"].append(backend_entry(loaded, label))
        if not loaded.available:
            say(f"{name}: unavailable: {loaded.error}")
            if explicit:
                doc["records"].append(Record(
                    backend=loaded.name, check="load", claim="-", op="-", dtype="-", case="load",
                    status="error", message=f"backend {name!r} could not be used: {loaded.error}",
                    run=label).to_json())
            continue
        for check in selected:
            for dtype in dtypes:
                t0 = time.perf_counter()
                recs = run_check(loaded, check, dtype, seed=seed, examples=examples,
                                 timeout=timeout, shrink=shrink)
                if not recs:
                    continue
                counts = ", ".join(f"{n} {s}" for s, n in _count(recs).items())
                say(f"{loaded.name:>8} {check.id:<26} {dtype:<9} {counts} "
                    f"({time.perf_counter() - t0:.1f}s)")
                for rec in recs:
                    rec.run = label
                    doc["records"].append(rec.to_json())
    return doc


def _count(recs):
    out: dict[str, int] = {}
    for r in recs:
        out[r.status] = out.get(r.status, 0) + 1
    return out


__all__ = ["DEFAULT_DTYPES", "run", "run_check", "select_checks"]
