"""The results JSON: the seam between running checks and reporting them.

Schema (version 1), one JSON object per file:

    {"schema": "normspec-results", "version": 1,
     "runs": [{"run": label, "created": ISO time, "seed": int, "host": ..., "cpu": ...,
               "python": ..., "versions": {package: version}, "argv": [...]}],
     "backends": [{"name", "source", "version", "available", "error",
                   "capabilities", "conventions", "deviations", "run"}],
     "tolerances": [{"quantity", "base_ulps", "growth", "reason"}],
     "records": [Record...],
     "benchmarks": [...]}

A Record is one (backend, check, op, dtype, case) with a status:
  pass        the backend agreed with the spec within the tolerance table's bound
  fail        it disagreed (message, worst input, expected vs got, repro)
  deviation   it disagreed in a way its deviations file documents (reason given)
  refused     it raised where the spec gives a value, as its conventions declare
  unsupported its capabilities say it does not offer this
  error       the adapter crashed, hung, or broke the contract of the protocol
Files from several runs merge by concatenating runs, backends and records; each record
keeps the label of the run it came from.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = "normspec-results"
VERSION = 1
STATUSES = ("pass", "fail", "deviation", "refused", "unsupported", "error")
FAILING = ("fail", "error")


@dataclass
class Record:
    backend: str
    check: str
    claim: str
    op: str
    dtype: str
    case: str
    status: str
    message: str = ""
    max_ulp: float | None = None
    bound_ulp: float | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    worst: dict = field(default_factory=dict)
    inputs: str = ""
    repro: str = ""
    reason: str = ""
    seed: int | None = None
    duration_s: float = 0.0
    run: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("max_ulp", "bound_ulp", "max_abs", "max_rel"):
            if d[k] is not None and d[k] != d[k]:  # NaN is not JSON
                d[k] = None
            elif d[k] is not None and abs(d[k]) == float("inf"):
                d[k] = "inf"
        return d


def _float(v):
    return float("inf") if v == "inf" else v


def record_from_json(d: dict) -> Record:
    d = dict(d)
    for k in ("max_ulp", "bound_ulp", "max_abs", "max_rel"):
        d[k] = _float(d.get(k))
    return Record(**d)


def new_document() -> dict:
    return {"schema": SCHEMA, "version": VERSION, "runs": [], "backends": [],
            "tolerances": [], "records": [], "benchmarks": []}


def validate(doc: dict, source: str = "results") -> dict:
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{source} is not a normspec results file (schema != {SCHEMA!r})")
    if doc.get("version") != VERSION:
        raise ValueError(f"{source} has results schema version {doc.get('version')!r}; "
                         f"this normspec reads version {VERSION}")
    for i, r in enumerate(doc.get("records", [])):
        if r.get("status") not in STATUSES:
            raise ValueError(f"{source}: record {i} has unknown status {r.get('status')!r}")
    return doc


def write(doc: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False), encoding="utf-8")
    tmp.replace(path)
    return path


def read(path) -> dict:
    path = Path(path)
    return validate(json.loads(path.read_text(encoding="utf-8")), str(path))


def merge(docs: list[dict]) -> dict:
    """One document from many: runs, backends, records and benchmarks concatenated."""
    out = new_document()
    for doc in docs:
        for key in ("runs", "backends", "records", "benchmarks"):
            out[key].extend(doc.get(key, []))
        if not out["tolerances"]:
            out["tolerances"] = doc.get("tolerances", [])
    return out


def summarize(records: list[dict]) -> dict[str, Counter]:
    """Status counts per backend."""
    counts: dict[str, Counter] = {}
    for r in records:
        counts.setdefault(r["backend"], Counter())[r["status"]] += 1
    return counts
