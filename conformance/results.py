"""The results format: the seam between running checks and reporting them.

A run is written twice, so that nothing it did is ever lost:

* while it runs, as a JSON Lines *stream* (`<name>.jsonl`): one JSON object a line,
  appended and flushed as each record is produced, so a crash, Ctrl-C or kill leaves
  every finished record on disk;
* when it ends (completely or interrupted), as one *document* (`<name>.json`), written
  atomically; the stream is then removed.

`read()` takes either; a stream without its end line is a run still running or killed, and
reads as an incomplete document.

Document (schema "normspec-results", version 2; version 1 files are read too):

    {"schema": "normspec-results", "version": 2,
     "runs": [{"run": label, "id": unique hex, "created": ISO time, "started": Unix time,
               "seed": int, "host", "cpu", "python",
               "versions": {package: version}, "argv": [...], "duration_s": float,
               "complete": bool, "stopped_by": "" | "SIGINT" | "SIGTERM" | "killed",
               "planned": int, "not_reached": [[backend, check, dtype], ...],
               "shard": "" | "K/N", "replicas": int, "pairs": [[check, dtype], ...],
               "unreadable_lines": [line number, ...]}],
     "backends": [{"name", "source", "version", "available", "error",
                   "capabilities", "conventions", "deviations", "run"}],
     "tolerances": [{"quantity", "base_ulps", "fixed", "growth", "reason"}],
     "records": [Record...],
     "benchmarks": [Benchmark...]}

A Benchmark (`normspec bench`, conformance/bench.py) is one timing: {"backend", "op",
"dtype", "shape", "pass", "variant": "prepared" | "protocol", "series": "table" |
"curve <elements>", "ms", "gbps", "copy_gbps", "copy_before_gbps", "copy_after_gbps",
"of_copy", "vs_torch", "vs_torch_note", "reliable", "timed", "error", "attempts", "round",
"pid", "run"}; the numbers are null where nothing was measured, and the ratios null where the
result is unreliable (`error` says why; `vs_torch_note` where only the comparison with
torch is); `round` is the round of turns the row was measured in (null where it was not
measured). Files written before the variant/series/reliability fields read as the
"table" series, "prepared" when their `timed` says so, and reliable where they have a
number.

Stream: the first line is {"stream": "normspec-results", "version": 2, "run": {...},
"tolerances": [...], "plan": [[backend, check, dtype], ...]}; then lines {"backend": {...}},
{"record": {...}} and {"done": [backend, check, dtype]} (a unit finished); the last line,
when the run ended in an orderly way, is {"end": {"complete": bool, "stopped_by": ...,
"duration_s": ...}}. A line that cannot be read (damaged on disk) is skipped and its
number kept in the run's "unreadable_lines" (read back only: a document written by a run
has none).

Non-finite numbers are data: a backend's inf or NaN must reach the report. Strict JSON
has no token for them, so every float that is not finite is written as the string
"inf", "-inf" or "nan", wherever it occurs; the measure fields of a record (`max_ulp`,
`bound_ulp`, `max_abs`, `max_rel`, `duration_s`, and `worst.ulp` / `worst.bound`) are
read back as floats. Files contain no `NaN`/`Infinity` tokens, so `jq`, browsers and
`json.loads(..., parse_constant=...)` read them.

A Record is one (backend, check, op, dtype, case) with a status:
  pass        the backend agreed with the spec within the tolerance table's bound
  fail        it disagreed (message, worst input, expected vs got, repro), or broke the
              call's contract (quantity "protocol": an input written into, an output not
              an array of the shape and dtype asked), which no deviation excuses
  deviation   it disagreed in a way its deviations file documents (reason given)
  refused     it raised where the spec gives a value, as its conventions declare
  unsupported its capabilities say it does not offer this
  error       the adapter crashed, hung, died, or its process broke the run's messages
Files from several runs merge by concatenating runs, backends and records; each record
keeps the label of the run it came from; a unit two runs hold counts the later run's
records (see merge).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from normspec.impls.protocol import DTYPES  # noqa: F401 - the dtypes a record names, in order

SCHEMA = "normspec-results"
VERSION = 2
READABLE_VERSIONS = (1, 2)
STATUSES = ("pass", "fail", "deviation", "refused", "unsupported", "error")
FAILING = ("fail", "error")
#: Record fields (and fields of `worst`) that hold numbers, read back from "inf"/"nan".
MEASURES = ("max_ulp", "bound_ulp", "max_abs", "max_rel", "duration_s")
WORST_MEASURES = ("ulp", "bound")
#: Benchmark fields that hold numbers (null where nothing was measured).
BENCH_MEASURES = ("ms", "gbps", "copy_gbps", "copy_before_gbps", "copy_after_gbps", "of_copy",
                  "vs_torch")
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
#: What a reader may assume of the optional keys, filled in where a file lacks them.
BACKEND_DEFAULTS: dict[str, Any] = {"source": "", "version": "", "error": None, "capabilities": {},
                    "conventions": {}, "deviations": [], "stale_deviations": []}
BENCH_DEFAULTS: dict[str, Any] = {"series": "table", "ms": None, "gbps": None, "copy_gbps": None,
                                  "copy_before_gbps": None, "copy_after_gbps": None,
                                  "of_copy": None, "vs_torch": None, "vs_torch_note": "",
                                  "timed": "", "error": "", "attempts": None, "round": None,
                                  "pid": None,
                                  "run": ""}
RUN_DEFAULTS: dict[str, Any] = {"id": "", "created": "", "started": 0.0, "seed": None, "host": "", "cpu": "",
                "platform": "", "python": "", "versions": {}, "argv": [], "complete": True,
                "stopped_by": "",
                "not_reached": [], "shard": "", "replicas": None, "unreadable_lines": []}


class ResultsError(ValueError):
    """A results file that cannot be read: the message names the file and the problem."""


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
    quantity: str = ""  # stable id of the worst compared quantity, e.g. "layer_norm.output"
    max_ulp: float | None = None
    bound_ulp: float | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    worst: dict = field(default_factory=dict)
    note: str = ""  # how the oracle was evaluated, where not at the parameters as given
    inputs: str = ""
    repro: str = ""
    reason: str = ""
    #: for a failed comparison, the formula variants (spec/variants.py) the output
    #: conforms to: {"op", "matches": [ids], "tried": [ids], "details": {id: {...}}};
    #: empty where nothing was diagnosed. Diagnosis, never a verdict.
    diagnosis: dict = field(default_factory=dict)
    seed: int | None = None
    duration_s: float = 0.0
    run: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_json(self) -> dict:
        return encode(asdict(self))


_RECORD_DEFAULTS: dict[str, Any] = {"message": "", "quantity": "", "note": "", "max_ulp": None,
                    "bound_ulp": None, "max_abs": None, "max_rel": None, "worst": {},
                    "inputs": "", "repro": "", "reason": "", "diagnosis": {}, "seed": None, "duration_s": 0.0,
                    "run": ""}


def encode(obj):
    """`obj` as strict-JSON-ready data: non-finite floats become "inf"/"-inf"/"nan",
    NumPy scalars and arrays become Python numbers and lists, and anything else that JSON
    has no form for becomes its repr, so writing can never fail on a backend's value."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        if math.isfinite(v):
            return v
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return encode(obj.tolist())
    return repr(obj)


def number(v):
    """A measure read back: "inf", "-inf", "nan" to floats; numbers and None unchanged."""
    return _NONFINITE.get(v, v) if isinstance(v, str) else v


def decode_record(d: dict) -> dict:
    """A record dict with its measures as numbers (inf and NaN restored) and every
    optional field present."""
    d = {**_RECORD_DEFAULTS, **d}
    for k in MEASURES:
        if k in d:
            d[k] = number(d[k])
    if isinstance(d.get("worst"), dict):
        d["worst"] = {k: (number(v) if k in WORST_MEASURES else v) for k, v in d["worst"].items()}
    return d


def record_from_json(d: dict) -> Record:
    return Record(**decode_record(d))


def dumps(obj, **kw) -> str:
    return json.dumps(encode(obj), allow_nan=False, **kw)


def new_document() -> dict:
    return {"schema": SCHEMA, "version": VERSION, "runs": [], "backends": [],
            "tolerances": [], "records": [], "benchmarks": []}


# ------------------------------------------------------------------ the format's fields
class ListOf:
    """A JSON array whose every item has the form `item`; of `length` items, where given."""

    def __init__(self, item, length: int | None = None):
        self.item, self.length = item, length


class MapOf:
    """A JSON object whose every value has the form `value`, whatever its keys."""

    def __init__(self, value):
        self.value = value


class Shape:
    """A JSON object whose named fields have their forms where present, and whose
    `required` fields are present (in a non-empty object only, where `empty_ok`: a
    record's `worst` is {} where nothing was measured). Fields it does not name are not
    read by normspec, and are left alone."""

    def __init__(self, fields: dict, required: tuple = (), empty_ok: bool = False):
        self.fields, self.required, self.empty_ok = fields, required, empty_ok


#: Any value: one the report only prints.
ANY = object
#: A measure, after decoding: "inf", "-inf" and "nan" are floats by then (see `number`).
NUMBER = (int, float)
MEASURE = (int, float, None)
TEXTS = ListOf(str)
#: A unit of work, [backend, check, dtype], and a (check, dtype) pair.
UNIT = ListOf(str, 3)
PAIR = ListOf(str, 2)
DEVIATION = Shape({"check": str, "except_check": str, "op": (str, None), "dtype": (str, None),
                   "quantity": (str, None), "reason": ANY}, required=("reason",))

#: Every field of the format that normspec reads, with its form: the one definition
#: `validate` and `from_stream` hold a file to, so that a value of another form is refused
#: by name (exit code 2) before any work, never met as a traceback while the report is
#: drawn (found by a review: a fail record's worst.ulp = "big" ended `normspec report`
#: with a traceback).
FORMS: dict[str, Shape] = {
    "run": Shape({"run": str, "id": str, "created": str, "started": NUMBER, "seed": (int, None),
                  "host": str, "cpu": str, "platform": str, "python": str,
                  "versions": MapOf(str), "argv": TEXTS, "duration_s": MEASURE,
                  "complete": bool, "stopped_by": str, "planned": int,
                  "not_reached": ListOf(UNIT), "shard": str, "replicas": (int, None),
                  "pairs": ListOf(PAIR), "unreadable_lines": ListOf(int)},
                 required=("run",)),
    "backend": Shape({"name": str, "available": bool, "run": str, "source": str, "version": str,
                      "error": (str, None),
                      "capabilities": Shape({"ops": TEXTS, "dtypes": TEXTS, "gradients": TEXTS}),
                      "conventions": Shape({"reasons": MapOf(ANY), "eps_zero": dict,
                                            "default_eps": dict}),
                      "deviations": ListOf(DEVIATION), "stale_deviations": ListOf(DEVIATION)},
                     required=("name", "available", "run")),
    "record": Shape({"backend": str, "check": str, "claim": str, "op": str, "dtype": str,
                     "case": str, "status": str, "message": str, "quantity": str, "note": str,
                     "inputs": str, "repro": str, "reason": str, "run": str, "seed": (int, None),
                     **{k: MEASURE for k in MEASURES},
                     "worst": Shape({"ulp": NUMBER, "bound": NUMBER, "what": str, "quantity": str,
                                     "index": ANY, "expected": ANY, "got": ANY},
                                    required=WORST_MEASURES, empty_ok=True),
                     "diagnosis": Shape({"op": str, "matches": TEXTS, "tried": TEXTS,
                                         "skipped": TEXTS, "within_envelope": TEXTS,
                                         "details": MapOf(Shape({"description": str,
                                                                 "seen_in": str},
                                                                required=("description",
                                                                          "seen_in")))})},
                    required=("backend", "check", "claim", "op", "dtype", "case", "status")),
    "tolerance": Shape({"quantity": str, "base_ulps": NUMBER, "fixed": NUMBER, "growth": NUMBER,
                        "reason": str}, required=("quantity", "base_ulps")),
    "benchmark": Shape({"backend": str, "op": str, "dtype": str, "shape": ListOf(int), "pass": str,
                        "variant": str, "series": str, **{k: MEASURE for k in BENCH_MEASURES},
                        "vs_torch_note": str, "reliable": bool, "timed": str, "error": str,
                        "attempts": (int, None), "round": (int, None), "pid": (int, None),
                        "run": str},
                       required=("backend", "op", "dtype", "shape", "pass")),
    # the lines of a stream (see the module doc); its backend and record lines hold the
    # forms above
    "header": Shape({"stream": str, "version": int, "run": dict, "tolerances": list,
                     "plan": ListOf(UNIT)}, required=("run", "plan")),
    "end": Shape({"complete": bool, "stopped_by": str, "duration_s": MEASURE}),
}


def _describe(form) -> str:
    """A form in words, for the message that refuses a value."""
    if isinstance(form, Shape):
        return "an object"
    if isinstance(form, MapOf):
        return f"an object, each value {_describe(form.value)}"
    if isinstance(form, ListOf):
        return ("a list" + (f" of {form.length} items" if form.length is not None else "")
                + f", each {_describe(form.item)}")
    names = {str: "a string", bool: "true or false", int: "a whole number", float: "a number",
             list: "a list", dict: "an object", None: "null"}
    types = form if isinstance(form, tuple) else (form,)
    if float in types:
        types = tuple(t for t in types if t is not int)
    return " or ".join(names.get(t, "a value") for t in types)


def _shown(value) -> str:
    """A value as the file holds it (JSON), cut to 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is(value, types) -> bool:
    """Whether `value` is of one of the JSON `types` (None: null; a bool is no number)."""
    for t in types if isinstance(types, tuple) else (types,):
        if t is None and value is None or t is ANY:
            return True
        if t is not None and isinstance(value, t) and (t is bool or not isinstance(value, bool)):
            return True
    return False


def _problem(value, form, path: str) -> tuple[str, str] | None:
    """The first place where `value` departs from `form`: (path, what is wrong), or None.
    `path` names the value as the message will ("worst.ulp", "not_reached[2]")."""
    if isinstance(form, Shape):
        if isinstance(value, dict):
            return _shape_problem(value, form, path)
    elif isinstance(form, ListOf):
        if isinstance(value, list) and form.length in (None, len(value)):
            return _first_problem(enumerate(value), form.item, path)
    elif isinstance(form, MapOf):
        if isinstance(value, dict):
            return _first_problem(value.items(), form.value, path)
    elif _is(value, form):
        return None
    # written only here: a run's file holds ~10^6 values, nearly all of the right form
    return path, f"= {_shown(value)}, not {_describe(form)}"


def _shape_problem(value: dict, form: Shape, path: str) -> tuple[str, str] | None:
    """The first required field missing from an object, or the first field of another form."""
    if value or not form.empty_ok:
        for key in form.required:
            if key not in value:
                return (f"{path}.{key}" if path else key), "missing"
    for key, sub in form.fields.items():
        found = key in value and _problem(value[key], sub, f"{path}.{key}" if path else key)
        if found:
            return found
    return None


def _first_problem(items, form, path: str) -> tuple[str, str] | None:
    """The first of the (key, item) pairs of a list or object whose item departs from `form`."""
    for key, item in items:
        found = _problem(item, form, f"{path}[{key!r}]")
        if found:
            return found
    return None


def check_form(value, kind: str, what: str, source: str) -> None:
    """ResultsError, one line naming the file, the entry and the field, where `value`
    is not of the form FORMS[kind] gives."""
    found = _problem(value, FORMS[kind], "")
    if found:
        path, wrong = found
        if wrong == "missing":
            raise ResultsError(f"{source}: {what} has no {path!r}")
        raise ResultsError(f"{source}: {what} " + (f"has {path} {wrong}" if path else f"is {wrong[2:]}"))


def validate(doc, source: str = "results") -> dict:
    """`doc` if it is a readable results document, with measures decoded and every
    optional field filled in; else ResultsError naming the first problem (the file, the
    entry, the field and its value). Every field normspec reads is checked (FORMS)."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ResultsError(f"{source} is not a normspec results file (schema != {SCHEMA!r})")
    if doc.get("version") not in READABLE_VERSIONS:
        raise ResultsError(f"{source} has results schema version {doc.get('version')!r}; "
                           f"this normspec reads versions {READABLE_VERSIONS}")
    for key in ("runs", "backends", "records"):
        if not isinstance(doc.get(key), list):
            raise ResultsError(f"{source} has no list {key!r}")
    for key in ("tolerances", "benchmarks"):
        if not isinstance(doc.setdefault(key, []), list):
            raise ResultsError(f"{source} has {key!r} that is not a list")
    for i, run in enumerate(doc["runs"]):
        check_form(run, "run", f"run {i}", source)
        doc["runs"][i] = {**RUN_DEFAULTS, **run}
    for i, b in enumerate(doc["backends"]):
        check_form(b, "backend", f"backend {i}", source)
        doc["backends"][i] = {**BACKEND_DEFAULTS, **b}
    labels = {run["run"] for run in doc["runs"]}
    for i, r in enumerate(doc["records"]):
        if isinstance(r, dict) and r.get("status", STATUSES[0]) not in STATUSES:
            raise ResultsError(f"{source}: record {i} has unknown status {r['status']!r}")
        if isinstance(r, dict) and not r.get("run") and len(labels) == 1:
            r = {**r, "run": next(iter(labels))}  # (a file's one run: its records' label)
        doc["records"][i] = decode_record(r) if isinstance(r, dict) else r
        check_form(doc["records"][i], "record", f"record {i}", source)
    for i, t in enumerate(doc["tolerances"]):
        decoded = _decoded(t, ("base_ulps", "fixed", "growth"))
        check_form(decoded, "tolerance", f"tolerance {i}", source)
        doc["tolerances"][i] = decoded
    for i, b in enumerate(doc["benchmarks"]):
        decoded = _decoded(b, BENCH_MEASURES)
        check_form(decoded, "benchmark", f"benchmark {i}", source)
        doc["benchmarks"][i] = _bench_defaults(decoded)
    return doc


def top_copy(doc):
    """A copy of `doc` and of its lists, for validate(), which fills in and replaces
    their entries (each a new dict) but changes nothing inside an entry: the caller's
    document stays as it was, without a deep copy of every record (~0.5 s a full run)."""
    if not isinstance(doc, dict):
        return doc
    return {k: list(v) if isinstance(v, list) else v for k, v in doc.items()}


def _decoded(entry, measures) -> Any:
    """An entry with its `measures` read back as numbers ("inf" to inf); not an object:
    as it is, for check_form to refuse."""
    if not isinstance(entry, dict):
        return entry
    return {k: (number(v) if k in measures else v) for k, v in entry.items()}


def _bench_defaults(b: dict) -> dict:
    """A benchmark entry with every field, an older file's too (see the module doc)."""
    out = {**BENCH_DEFAULTS, **b}
    if "variant" not in b:
        out["variant"] = "prepared" if "prepare_benchmark" in str(b.get("timed", "")) \
            else "protocol"
    if "reliable" not in b:
        out["reliable"] = bool(b.get("gbps"))
    return out


def _reject_constant(name):
    raise ValueError(f"non-standard JSON constant {name}")


def _loads(text: str, source: str):
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ResultsError(f"{source} is not valid JSON ({exc})") from None


# ------------------------------------------------------------------ documents
def write(doc: dict, path) -> Path:
    """Write a document atomically (a temporary file renamed over the target)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(doc, indent=1), encoding="utf-8")
    tmp.replace(path)
    return path


def read(path) -> dict:
    """A document from a `.json` document or a `.jsonl` stream (see the module doc)."""
    path = Path(path)
    try:
        data = path.read_bytes()
        if path.suffix == ".jsonl":  # (decoded line by line: see from_stream)
            return from_stream(data, str(path))
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"cannot read {path}: {exc}") from None
    return validate(_loads(text, str(path)), str(path))


def _unit(rec: dict) -> tuple:
    """What one run's unit of work is: a backend under a run label, a check, a dtype."""
    return rec.get("backend"), rec.get("run", ""), rec.get("check"), rec.get("dtype")


def _unit_ranks(docs: list[dict]) -> dict[tuple, dict[int, tuple]]:
    """For each unit, the rank of each document that holds records of it: whether its run
    finished the unit (its `not_reached` does not list it), when that run started
    (created, to the second, then `started`, which files written before it lack), and
    the document's position. The highest rank's records are counted (see merge)."""
    ranks: dict[tuple, dict[int, tuple]] = {}
    for i, doc in enumerate(docs):
        when: dict[str, tuple] = {}
        unfinished: set[tuple] = set()
        for run in doc.get("runs", []):
            label = run.get("run", "")
            when[label] = max(when.get(label, ("", 0.0)),
                              (str(run.get("created") or ""), float(run.get("started") or 0.0)))
            unfinished |= {(u[0], label, u[1], u[2]) for u in run.get("not_reached") or []}
        for rec in doc.get("records", []):
            unit = _unit(rec)
            ranks.setdefault(unit, {})[i] = (unit not in unfinished, when.get(unit[1], ("", 0.0)), i)
    return ranks


def _left_out(unit: tuple, rank: tuple, kept: tuple, file: str, by: str) -> dict:
    """The `superseded` entry of a unit's records in one file that another's displace,
    saying why: `because` "finished" where the run kept finished the unit and this one did
    not (a killed run's half-done unit, whichever started later), else "later" (the run
    kept started later)."""
    return {"backend": unit[0], "run": unit[1], "check": unit[2], "dtype": unit[3],
            "records": 0, "failing": 0, "file": file, "by": by,
            "because": "finished" if kept[0] and not rank[0] else "later"}


def merge(docs: list[dict], names: list[str] | None = None) -> dict:
    """One document from many: runs, backends, records and benchmarks concatenated.

    A backend listed by several documents under the same run label (the shards of one
    sharded run, `normspec run --shard K/N`) is listed once, and its stale deviation
    entries are found again over all its records: an entry one shard did not use may
    explain a record of another.

    A unit (backend and run label, check, dtype) that several runs hold is taken whole
    from one run, and the others' records of it are left out: from the run that finished
    it, of those that did (a killed run's half-done unit never displaces a whole one,
    found by a review), then from the run started last (a merge of a full run and a later
    run of one check counted that check's records twice: found by a new user). The runs
    of one unit are of one host (check_mergeable refuses two). `superseded` lists what
    was left out, how much of it failing, from which file (`names`, else its position),
    for which file's records, and why.

    Also: `unfinished`, the units no run here finished or holds though planned
    (`_unfinished`); `missing_shards`, run label -> shards of it not here; and
    `tolerance_tables`, each distinct table with the runs that used it."""
    out = new_document()
    ranks = _unit_ranks(docs)
    owner = {unit: max(held.values())[-1] for unit, held in ranks.items()}
    names = names or [f"document {i + 1}" for i in range(len(docs))]
    dropped: dict[tuple, dict] = {}
    for i, doc in enumerate(docs):
        for key in ("runs", "backends", "benchmarks"):
            out[key].extend(doc.get(key, []))
        for rec in doc.get("records", []):
            unit = _unit(rec)
            if owner[unit] == i:
                out["records"].append(rec)
                continue
            entry = dropped.get((unit, i)) or dropped.setdefault((unit, i), _left_out(
                unit, ranks[unit][i], ranks[unit][owner[unit]], names[i], names[owner[unit]]))
            entry["records"] += 1
            entry["failing"] += rec.get("status") in FAILING
        if not out["tolerances"]:
            out["tolerances"] = doc.get("tolerances", [])
    out["backends"] = _fold_backends(out["backends"], out["records"], out["runs"])
    out["superseded"] = list(dropped.values())
    out["unfinished"] = _unfinished(docs, ranks, out["backends"])
    out["missing_shards"] = missing_shards(out["runs"])
    out["tolerance_tables"] = _tolerance_tables(docs)
    return out


def check_mergeable(docs: list[dict], names: list[str]) -> None:
    """ResultsError when documents cannot be merged into one honest report: the same run
    in two files (its records would count twice), or one backend name in one run label
    with two versions or sources (two backends whose records would be added together).
    `names` names the documents in the message."""
    seen: dict[tuple, str] = {}
    for doc, name in zip(docs, names, strict=True):
        for run in doc.get("runs", []):
            # a run is its id; files written before runs had one, by label, time (to the
            # second: two runs of one label started in one second looked like one) and shard
            key = ((run["id"],) if run.get("id") else
                   (run.get("run"), run.get("created"), run.get("shard")))
            if key in seen and (run.get("id") or run.get("created")):  # no time: cannot tell
                raise ResultsError(f"{name} and {seen[key]} both hold run {run.get('run')!r} "
                                   f"created {run.get('created') or '(no time)'}: its records "
                                   "would count twice")
            seen.setdefault(key, name)
    _check_one_host_a_unit(docs, names)
    backends: dict[tuple, tuple] = {}
    for doc, name in zip(docs, names, strict=True):
        for b in doc.get("backends", []):
            if not b.get("available"):  # (no version: a machine without it, a shard's)
                continue
            who = (b.get("name"), b.get("run"))
            what = (b.get("version"), b.get("source"))
            if who in backends and backends[who][0] != what:
                (version, source), other = backends[who]
                raise ResultsError(
                    f"backend {who[0]!r} of run {who[1]!r} is {what[0] or '?'} ({what[1]}) in "
                    f"{name} and {version or '?'} ({source}) in {other}: two backends under "
                    "one name (give a run --label)")
            backends.setdefault(who, (what, name))


def _check_one_host_a_unit(docs: list[dict], names: list[str]) -> None:
    """ResultsError where one unit (backend, run label, check, dtype) was run on two hosts:
    tox env names, the default label, are the same on every machine, and the merge kept
    one machine's records of a unit and dropped the other's, failures included, with a
    verdict of "conforms" (found by a review). Which machine's records count cannot be
    told; different units of one label from several hosts (shards on several machines)
    merge, and a re-run on one host supersedes. Files without a host cannot be told
    apart, and are not refused."""
    seen: dict[tuple, tuple[str, str]] = {}
    for doc, name in zip(docs, names, strict=True):
        hosts = {run.get("run", ""): run.get("host") or "" for run in doc.get("runs", [])}
        for rec in doc.get("records", []):
            unit, host = _unit(rec), hosts.get(rec.get("run", ""), "")
            other_host, other = seen.setdefault(unit, (host, name))
            if host and other_host and host != other_host:
                raise ResultsError(
                    f"backend {unit[0]!r} of run {unit[1]!r} ran {unit[2]} {unit[3]} on host "
                    f"{other_host!r} ({other}) and on host {host!r} ({name}): which "
                    "machine's records count cannot be told (give each machine its own "
                    "--label)")
            if not other_host and host:
                seen[unit] = (host, name)


def _fold_backends(backends: list[dict], records: list[dict], runs: list[dict]) -> list[dict]:
    """One entry per backend and run label. Where a label's runs are several (a re-run) or
    sharded, its stale deviation entries are found again over the merged records: an entry
    one shard did not use may explain a record of another, and a sharded run leaves them
    to the merge (runner.run). Not where shards of the label are missing
    (`missing_shards`): an entry may explain a record of a shard not here."""
    from .deviations import stale

    groups: dict[tuple, list[dict]] = {}
    for b in backends:
        groups.setdefault((b.get("name"), b.get("run")), []).append(b)
    sharded = {run.get("run") for run in runs if run.get("shard")}
    partial = missing_shards(runs)
    out = []
    for (name, run), entries in groups.items():
        if (len(entries) == 1 and run not in sharded) or run in partial:
            out.append(entries[0])
            continue
        first = dict(next((e for e in entries if e.get("available")), entries[0]))
        mine = [r for r in records if r.get("backend") == name and r.get("run", run) == run]
        first["stale_deviations"] = stale(first.get("deviations") or [], mine)
        out.append(first)
    return out


def missing_shards(runs: list[dict]) -> dict[str, list[str]]:
    """Run label -> the shards ("K/N") of a sharded run that no run of that label here
    is: a label of shard runs ("ci-1", "ci-2", ... one label per shard) or a shard not
    given misses them. A label with an unsharded run misses none."""
    shards: dict[str, set[str]] = {}
    for run in runs:
        shards.setdefault(run.get("run", ""), set()).add(run.get("shard") or "")
    out = {}
    for label, have in shards.items():
        if "" in have:
            continue
        wanted = {f"{k}/{n}" for n in {int(s.split("/")[1]) for s in have}
                  for k in range(1, n + 1)}
        if wanted - have:
            out[label] = sorted(wanted - have, key=lambda s: tuple(map(int, s.split("/")))[::-1])
    return out


def _planned(docs: list[dict]) -> set[tuple]:
    """The units the runs planned, as far as their files say (runs[i].pairs, which files
    written before it lack): a run's pairs for every backend its file lists under the
    run's label, available or not (a shard on a machine without the backend lists it as
    unavailable, and runs none of its units)."""
    units = set()
    for doc in docs:
        for run in doc.get("runs", []):
            label = run.get("run", "")
            names = {b.get("name") for b in doc.get("backends", []) if b.get("run") == label}
            units |= {(name, label, check, dtype) for name in names
                      for check, dtype in run.get("pairs") or []}
    return units


def _unfinished(docs: list[dict], ranks: dict[tuple, dict[int, tuple]],
                backends: list[dict]) -> list[dict]:
    """The units of the merge that no run finished, judged on the merged units, not per
    file (a killed run's unreached units that another run here finished are complete):
    "not finished" where a run planned it and stopped before its end, "no record" where a
    label's runs planned it for a backend that has no record of it under that label (a
    shard on a machine where the backend was not installed). Only for a backend available
    under the label somewhere here: one available nowhere says so in its verdict."""
    stopped = {(u[0], run.get("run", ""), u[1], u[2]) for doc in docs
               for run in doc.get("runs", []) for u in run.get("not_reached") or []}
    available = {(b.get("name"), b.get("run")) for b in backends if b.get("available")}
    out = []
    for unit in sorted(stopped | _planned(docs)):
        if any(rank[0] for rank in ranks.get(unit, {}).values()) or \
                (unit not in stopped and unit[:2] not in available):
            continue
        out.append({"backend": unit[0], "run": unit[1], "check": unit[2], "dtype": unit[3],
                    "why": "not finished" if unit in stopped or unit in ranks else "no record"})
    return out


def _tolerance_tables(docs: list[dict]) -> list[dict]:
    """Each distinct tolerance table of the documents, with the runs that used it
    ("label (created)"): a merge of runs of two normspec versions showed the first file's
    table alone (found by a review)."""
    tables: dict[str, dict] = {}
    for doc in docs:
        rows = doc.get("tolerances") or []
        if not rows:  # (a bench has none)
            continue
        table = tables.setdefault(json.dumps(rows, sort_keys=True), {"rows": rows, "runs": []})
        table["runs"] += [f"{run.get('run', '')} ({run.get('created') or 'no time'})"
                          for run in doc.get("runs", [])]
    return list(tables.values())


def summarize(records: list[dict]) -> dict[str, Counter]:
    """Status counts per backend."""
    counts: dict[str, Counter] = {}
    for r in records:
        counts.setdefault(r["backend"], Counter())[r["status"]] += 1
    return counts


# ------------------------------------------------------------------ streams
class Stream:
    """The append-only JSON Lines record of a run in progress: every line is written
    with one call and flushed, and a finished unit is also fsync'd, so what was done
    survives a kill of this process (or of the machine, for finished units). Threads may
    write at once: lines are written whole, one at a time, and the fsync, which waits on
    the disk, holds no lock (the run's slots would wait on it: ~1 s of a full run)."""

    def __init__(self, path, *, run: dict, tolerances: list, plan: list):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "x", encoding="utf-8")  # never append to another run's
        self._lock = threading.Lock()
        self._line({"stream": SCHEMA, "version": VERSION, "run": run, "tolerances": tolerances,
                    "plan": plan})

    def _line(self, obj, sync=False) -> None:
        text = dumps(obj) + "\n"
        with self._lock:
            self._f.write(text)
            self._f.flush()
        if sync:
            os.fsync(self._f.fileno())

    def backend(self, entry: dict) -> None:
        self._line({"backend": entry}, sync=True)

    def record(self, rec: dict) -> None:
        self._line({"record": rec})

    def done(self, unit) -> None:
        self._line({"done": list(unit)}, sync=True)

    def end(self, **info) -> None:
        self._line({"end": info}, sync=True)

    def close(self) -> None:
        self._f.close()


def from_stream(data: bytes | str, source: str = "stream") -> dict:
    """The document a stream describes; without an end line it is marked not finished
    (still running, or killed). A line that cannot be read (not UTF-8, not JSON: a hole of
    NUL bytes a crash leaves on some filesystems, the last line cut short by a kill, bytes
    after it) costs that line alone: its number is kept in the run's `unreadable_lines`,
    which the report and `normspec report` tell, and every other line is read (one such
    line refused the whole stream: found by a review). A line that reads but is not of its
    form (FORMS) is refused by number."""
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogateescape")
    objs, unreadable = _stream_objects(raw)
    if unreadable and _being_written(raw, unreadable[-1], objs):
        # (found by a review: a report of a live run said "records may be missing")
        unreadable = unreadable[:-1]
    if 1 in unreadable:
        raise ResultsError(f"{source}: its header line (line 1) cannot be read: the run its "
                           "records are of is unknown")
    if not objs or objs[0][0] != 1 or not isinstance(objs[0][1], dict) \
            or objs[0][1].get("stream") != SCHEMA:
        raise ResultsError(f"{source} is not a normspec results stream (no header line)")
    head = objs[0][1]
    check_form(head, "header", "the header line (line 1)", source)
    doc = new_document()
    run = dict(head["run"])
    doc["runs"].append(run)
    doc["tolerances"] = head.get("tolerances", [])
    done, end = _read_lines(objs[1:], doc, source)
    run["planned"] = len(head["plan"])
    run["not_reached"] = [u for u in head["plan"] if tuple(u) not in done]
    run["unreadable_lines"] = unreadable
    if end is None:
        run.update(complete=False, stopped_by=NOT_ENDED)
    else:
        run.update(complete=bool(end.get("complete")) and not run["not_reached"],
                   stopped_by=end.get("stopped_by", ""), duration_s=end.get("duration_s"))
    return validate(doc, source)


def _being_written(raw: bytes, last_bad: int, objs) -> bool:
    """Whether the stream's unreadable line `last_bad` is a line a run in progress is
    still writing, not damage: the last line, unterminated, of a stream with no end line,
    and the start of a JSON object in UTF-8 (each line is written with one call, so only
    the last can be cut; a hole of NUL bytes or bytes that are not UTF-8 are damage)."""
    tail = raw.rsplit(b"\n", 1)[-1]
    if raw.endswith(b"\n") or last_bad != raw.count(b"\n") + 1 or not tail.startswith(b"{"):
        return False
    if any(isinstance(o, dict) and "end" in o for _, o in objs):
        return False
    try:
        tail.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _stream_objects(data: bytes) -> tuple[list[tuple[int, Any]], list[int]]:
    """(line number, JSON value) of every line of a stream that reads, and the numbers of
    the lines that do not (blank lines are neither)."""
    objs, unreadable = [], []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            objs.append((n, json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)))
        except ValueError:  # (a UnicodeDecodeError is one)
            unreadable.append(n)
    return objs, unreadable


#: What a stream without an end line says of its run: a run in progress reads so too.
NOT_ENDED = "not finished: still running, or killed (the stream has no end line)"
#: The kinds of line a stream holds after its header, each an object of one key.
LINE_KINDS = ("backend", "record", "done", "end")


def _read_lines(objs: list[tuple[int, Any]], doc: dict, source: str) -> tuple[set, dict | None]:
    """Fill `doc` from a stream's lines after the header ((line number, object) pairs):
    backends and records (validated with the document), and return the units done and
    the end line's object (None without one)."""
    done: set[tuple] = set()
    end = None
    for n, obj in objs:
        kind = next((k for k in LINE_KINDS if isinstance(obj, dict) and k in obj), None)
        if kind is None:
            what = f"an object without any of {', '.join(LINE_KINDS)}" if isinstance(obj, dict) \
                else f"{type(obj).__name__}, not an object"
            raise ResultsError(f"{source}: line {n} holds {what}")
        value = obj[kind]
        if kind == "done":
            found = _problem(value, UNIT, "")
            if found:
                raise ResultsError(f"{source}: line {n} has done = {_shown(value)}, not "
                                   f"{_describe(UNIT)}")
            done.add(tuple(value))
        elif kind == "end":
            check_form(value, "end", f"the end line (line {n})", source)
            end = value
        else:
            doc[kind + "s"].append(value)
    return done, end


__all__ = ["FAILING", "STATUSES", "Record", "ResultsError", "Stream", "encode", "merge", "read",
           "validate", "write"]
