"""The `normspec` command: backends, claims, checks, run, report, bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from normspec.impls import registry

from . import results, runner
from .diagnosis import summary as diagnosis_summary

#: Where runs go unless told otherwise: each run its own file, named by time and label;
#: results/latest names the newest.
RESULTS_DIR = Path("results")
REPORTS_DIR = Path("reports")
LATEST = "latest"
#: Seconds a unit (a check on one dtype) took per backend, the mean of the latest run of
#: each: the next run starts the slowest backend first (runner.run's `previous`)
TIMING = "timing"
#: The conventions whose declarations the checks hold a backend to (README.md's table says
#: by which check): `normspec backends` lists them as verified, the rest as its word.
VERIFIED_CONVENTIONS = ("running_var_estimator", "eps_zero", "parameter_dtype",
                        "momentum_held_as", "single_value_batch", "batch_invariant",
                        "deterministic", "data_parallel_buffers", "sync_batch_norm_refused",
                        "fused_residual_sum")
#: The conventions that are the backend's word, shown as given.
DECLARED_CONVENTIONS = ("default_eps", "native_momentum", "half_compute_dtype")


def _print_table(rows: list[list[Any]], out=None) -> None:
    out = out or sys.stdout
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for n, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)


# ------------------------------------------------------------------ backends
def cmd_backends(args) -> int:
    names = args.backend or list(registry.discover())
    known = registry.discover()
    for name in names:
        if ":" not in name and name not in known:
            print(f"normspec backends: error: unknown backend {name!r}; known: "
                  f"{', '.join(sorted(known))} (or give module:factory)", file=sys.stderr)
            return 2
    entries = [runner.backend_entry(registry.load(n), "local") for n in names]
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    for e in entries:
        state = "available" if e["available"] else f"unavailable: {e['error']}"
        if e["name"] in registry.OPT_IN:
            state += f" (opt-in, not in a run without --backend: {registry.OPT_IN[e['name']]})"
        print(f"{e['name']}  ({e['source']})")
        print(f"  version:     {e['version'] or '-'}")
        print(f"  status:      {state}")
        if e["available"]:
            caps, conv = e["capabilities"], e["conventions"]
            print(f"  ops:         {', '.join(caps.get('ops', []))}")
            print(f"  dtypes:      {', '.join(caps.get('dtypes', []))}")
            for op, dts in caps.get("op_dtypes", {}).items():
                print(f"    {op}: {', '.join(dts)}")
            print(f"  gradients:   {', '.join(caps.get('gradients', [])) or '-'}")
            for op, dts in caps.get("gradient_dtypes", {}).items():
                print(f"    {op}: {', '.join(dts)}")
            print(f"  no-grad mode: {caps.get('no_grad_mode')}, momentum=None: "
                  f"{caps.get('cumulative_momentum')}, track_running_stats=False: "
                  f"{caps.get('untracked_stats')}")
            print(f"  data parallel: {', '.join(caps.get('data_parallel', [])) or '-'}")
            print("  conventions (verified):")
            for key in VERIFIED_CONVENTIONS:
                print(f"    {key}: {conv.get(key)}")
            print("  conventions (declared, not verified):")
            for key in DECLARED_CONVENTIONS:
                print(f"    {key}: {conv.get(key)}")
            for key, why in (conv.get("reasons") or {}).items():
                print(f"    why {key}: {why}")
            if e["deviations"]:
                print(f"  deviations:  {len(e['deviations'])} documented")
        print()
    return 0


def cmd_claims(args) -> int:
    from .claims import CLAIMS, markdown

    checks = runner.select_checks(None)
    records = None
    if args.results:
        try:
            records = results.read(args.results)["records"]
        except results.ResultsError as exc:
            print(f"normspec claims: error: {exc}", file=sys.stderr)
            return 2
    if args.markdown:
        sys.stdout.write(markdown(checks, records, source=args.results or ""))
        return 0
    rows = [["claim", "title", "checks"]]
    for claim in CLAIMS.values():
        ids = [c.id for c in checks if c.verifies(claim.id)]
        rows.append([claim.id, claim.title, ", ".join(ids) or "- (not checked on backends)"])
    _print_table(rows)
    return 0


def cmd_checks(args) -> int:
    rows = [["check", "claim", "ops", "title"]]
    for c in runner.select_checks(None):
        rows.append([c.id, c.claim, ",".join(c.ops) or "all", c.title])
    _print_table(rows)
    return 0


# ------------------------------------------------------------------ run
def _whole(lo: int, hi: int | None = None):
    """An argparse type: a whole number from lo (to hi - 1), named in the error."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < lo or (hi is not None and v >= hi):
            raise argparse.ArgumentTypeError(
                f"{text!r} must be at least {lo}" if hi is None else
                f"{text!r} must be from {lo} to {'2**63' if hi == 2**63 else hi} - 1")
        return v
    return parse


_positive_int = _whole(1)
_seed = _whole(0, 2**63)


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds above 0")
    return v


def _shard(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    try:
        k_i, n_i = int(k), int(n)
    except ValueError:
        k_i = n_i = 0
    if not sep or not 1 <= k_i <= n_i:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shard K/N with 1 <= K <= N "
                                         "(e.g. 2/3)")
    return k_i, n_i


def _replicas(text: str) -> int:
    from .checks.data_parallel import parse_replicas

    try:
        return parse_replicas(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: The longest --label: it is part of the results' file names, which a file system
#: caps at 255 bytes (a 300-character label failed after the backends had loaded).
LABEL_MAX = 100


def _label(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the label is empty")
    if len(text) > LABEL_MAX:
        raise argparse.ArgumentTypeError(f"the label is {len(text)} characters long; at most "
                                         f"{LABEL_MAX} (it is part of the results' file names)")
    return text


def _path(text: str) -> str:
    """An argparse type: a path, not empty (an empty one fell back to the default path)."""
    if not text:
        raise argparse.ArgumentTypeError("the path is empty")
    return text


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "run"


def _unwritable(path: Path) -> str | None:
    """Why `path` cannot be written, found before any work by creating (and at once
    removing) a scratch file where it would go; None if it can."""
    if path.is_dir():
        return f"{path} is a folder"
    if path.exists() and not path.is_file():
        # written by renaming a finished file over it: a device (/dev/null) or a pipe
        # would be replaced by a regular file, as root
        return f"{path} is not a regular file"
    parent, missing = path.parent, None
    while not parent.exists():
        parent, missing = parent.parent, parent
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        # (the folder that does not exist is the one to name, where there is one)
        return (f"{missing} does not exist and cannot be made in {parent} ({exc.strerror})"
                if missing is not None else f"{parent} is not a writable folder ({exc.strerror})")
    return None


def _same_file(path: Path, *others: Path) -> bool:
    """Whether `path` names the same file as one of `others` (symbolic links and
    relative paths resolved; files that do not exist yet compared by name)."""
    here = path.resolve()
    return any(here == o.resolve() for o in others)


def _stem_of(label: str) -> str:
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{_safe(label)}"


def _lock(stem: str) -> Path:
    return RESULTS_DIR / f".{stem}.lock"


def _new_stem(label: str) -> str:
    """A results name of its own for this run: UTC time and label, never an old one's,
    nor one another run started in the same second took: the name is claimed at once by
    creating its lock file (_lock, exclusively; the run removes it when it ends, and left
    behind by a killed run it only keeps the name taken). Checked for files alone, two
    runs started together both took it, and the second failed with a traceback once its
    backends had loaded (found by a review)."""
    stem = _stem_of(label)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    candidate, n = stem, 1
    while True:
        if not any((RESULTS_DIR / f"{candidate}{ext}").exists() for ext in (".json", ".jsonl")):
            try:
                os.close(os.open(_lock(candidate), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return candidate
            except FileExistsError:
                pass
        n += 1
        candidate = f"{stem}-{n}"


def _stream_path(json_path: Path) -> Path:
    return json_path.with_suffix(".jsonl") if json_path.suffix == ".json" \
        else json_path.with_name(json_path.name + ".jsonl")


class _Signals:
    """SIGINT and SIGTERM stop the run once (runner.request_stop, which keeps the first:
    the run stops at its next checkpoint); later ones change nothing while the partial
    results are written."""

    def __init__(self):
        self.saved = {}

    def _handler(self, signum, frame):
        runner.request_stop(signal.Signals(signum).name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.saved[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self.saved.items():
            signal.signal(s, h)
        runner.STOPS.pending = ""  # one that came after the run's last checkpoint


class _Progress:
    """The run's progress lines on stdout, or none once stdout is gone (a closed pipe:
    `normspec run | tee` stopped by Ctrl-C, which stops tee too). A failed print must not
    end the run: raised in a slot thread, it ended a stopped run with exit 0, no line and
    no results file (found by a review)."""

    def __init__(self):
        self.gone = False

    def __call__(self, message: str) -> None:
        if self.gone:
            return
        try:
            print(message, flush=True)
        except OSError:
            self.gone = True
            try:  # what is left in stdout's buffer goes nowhere, not to a later flush
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):
                pass


def _tell(line: str) -> None:
    """One line on stderr, if stderr is still there (the exit code says the rest)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _unknown_backend(names) -> str | None:
    """What is wrong with the first --backend that names no installed backend (a
    module:factory is tried when loaded), or None."""
    known = registry.discover()
    for name in names or ():
        if ":" not in name and name not in known:
            return (f"unknown backend {name!r}; known: {', '.join(sorted(known))} "
                    "(or give module:factory)")
    return None


def _refuse(message: str, command: str = "run") -> int:
    """Bad input: one line naming it, exit code 2."""
    print(f"normspec {command}: error: {message}", file=sys.stderr)
    return 2


def _not_a_report_path(path: Path) -> str | None:
    """Why a report (HTML) must not be written at `path`: a results file's name (the
    report would replace results: found by a review, `report -o results/b.json` replaced
    another run's results with HTML), or results/latest (the next `normspec report`
    then crashed)."""
    if path.suffix in (".json", ".jsonl"):
        return "that is a results file's name (.json, .jsonl); a report is HTML"
    return _kept_by_runs(path)


def _kept_by_runs(path: Path) -> str | None:
    """Why `path` must not be written with results or a report: a file the runs in
    RESULTS_DIR keep (results/latest: the next `normspec report` then crashed; results/
    timing: the next run would replace what was written there, found by a review)."""
    if _same_file(path, RESULTS_DIR / LATEST):
        return "that file names the latest run"
    if _same_file(path, RESULTS_DIR / TIMING):
        return "that file keeps the backends' timing for the next run's order"
    return None


def cmd_run(args) -> int:
    label = args.label or os.environ.get("TOX_ENV_NAME") or platform.node() or "local"
    if len(label) > LABEL_MAX:
        return _refuse(f"the label {label[:40]!r}... is {len(label)} characters long; give a "
                       f"--label of at most {LABEL_MAX}")
    try:
        selected = runner.select_checks(args.check or None)
    except ValueError as exc:
        return _refuse(str(exc))
    if not runner.planned_pairs(selected, args.dtype or list(runner.DEFAULT_DTYPES), args.shard):
        # (a run of nothing said "conforms"; found by a review)
        return _refuse(f"nothing to run: no check of {', '.join(args.check or ['the suite'])} "
                       f"applies to {', '.join(args.dtype or runner.DEFAULT_DTYPES)}"
                       + (f" in shard {args.shard[0]}/{args.shard[1]}" if args.shard else ""))
    from .checks.data_parallel import REPLICAS_ENV, replicas

    if args.replicas is None:  # (--replicas overrides it)
        try:
            replicas()
        except ValueError as exc:
            return _refuse(f"${REPLICAS_ENV}: {exc}")
    unknown = _unknown_backend(args.backend)
    if unknown:
        return _refuse(unknown)
    if args.json and Path(args.json).suffix == ".jsonl":
        return _refuse(f"--json {args.json}: a .jsonl file is read as a run's stream; give a "
                       ".json path")
    if args.json and _kept_by_runs(Path(args.json)):
        return _refuse(f"cannot write {args.json}: {_kept_by_runs(Path(args.json))}")
    if args.html and not args.no_html and _not_a_report_path(Path(args.html)):
        return _refuse(f"cannot write {args.html}: {_not_a_report_path(Path(args.html))}")
    def paths(stem):
        json_path = Path(args.json) if args.json else RESULTS_DIR / f"{stem}.json"
        return json_path, None if args.no_html else (
            Path(args.html) if args.html else REPORTS_DIR / f"{stem or _safe(json_path.stem)}.html")
    # (the name is claimed once the arguments are found good: a refusal writes nothing)
    json_path, html_path = paths(None if args.json else _stem_of(label))
    for path in (json_path, html_path):
        why = path is not None and _unwritable(path)
        if why:
            return _refuse(f"cannot write {path}: {why}")
    if html_path is not None and _same_file(html_path, json_path, _stream_path(json_path)):
        return _refuse(f"--html {html_path} is the results file itself (or its stream): "
                       "the report would replace the results")
    if _stream_path(json_path).exists():
        return _refuse(f"{_stream_path(json_path)} exists (the stream of a run that did not "
                       "finish?); report it, move it away, or give another --json")
    made = not RESULTS_DIR.exists()
    stem = None if args.json else _new_stem(label)
    json_path, html_path = paths(stem)
    try:
        return _run_into(args, label, stem, json_path, html_path)
    finally:
        if stem:
            _release(stem, made)


def _release(stem: str, made: bool) -> None:
    """The name's lock removed, and the results folder too if this run made it and
    wrote nothing there (a backend refused once loaded: nothing is written)."""
    _lock(stem).unlink(missing_ok=True)
    if made:
        with contextlib.suppress(OSError):  # (not empty: the run wrote its results)
            RESULTS_DIR.rmdir()


def _run_into(args, label: str, stem: str | None, json_path: Path, html_path: Path | None) -> int:
    """cmd_run once its arguments are found good: the run, its results and report."""
    stream: list[results.Stream] = []

    def on_start(doc, units):
        stream.append(results.Stream(_stream_path(json_path), run=doc["runs"][0],
                                     tolerances=doc["tolerances"], plan=units))
        for entry in doc["backends"]:
            stream[0].backend(entry)
        if stem:
            (RESULTS_DIR / LATEST).write_text(stem + "\n", encoding="utf-8")

    verbose = not args.quiet
    previous = _previous_timing()
    if args.replicas is not None:  # read by the DP checks in the backend processes
        from .checks.data_parallel import REPLICAS_ENV

        os.environ[REPLICAS_ENV] = str(args.replicas)
    with _Signals():
        try:
            doc = runner.run(args.backend or None, checks=args.check or None,
                             dtypes=args.dtype or None, seed=args.seed, examples=args.examples,
                             timeout=args.timeout, label=label, shrink=args.shrink, jobs=args.jobs,
                             shard=args.shard, record_unavailable=args.record_unavailable,
                             progress=_Progress() if verbose else None,
                             on_start=on_start, on_record=lambda r: stream[0].record(r),
                             on_done=lambda u: stream[0].done(u), previous=previous)
        except runner.BackendNotUsable as exc:
            return _refuse(str(exc))
        info = doc["runs"][0]
        if stream:
            stream[0].end(complete=info["complete"], stopped_by=info["stopped_by"],
                          duration_s=info["duration_s"])
            stream[0].close()
        # (no stream: stopped while the backends were loading; the file still says so)
        results.write(doc, json_path)
        if stream:
            _stream_path(json_path).unlink()
        elif stem:  # the newest run, if an empty one: `normspec report` shows it
            (RESULTS_DIR / LATEST).write_text(stem + "\n", encoding="utf-8")
        if html_path is not None:
            from normspec.reports import html

            try:
                html.write_report([doc], html_path)
            except Exception as exc:  # noqa: BLE001 - the results are safe; say so, once
                print(f"normspec run: error: the report could not be written ({type(exc).__name__}: "
                      f"{exc}; a defect in normspec); the results are in {json_path}",
                      file=sys.stderr)
                return 1
        if info["stopped_by"]:
            done = info["planned"] - len(info["not_reached"])
            when = (f"after {done} of {info['planned']} checks" if stream else
                    "while the backends were loading, before any check")
            _tell(f"normspec run: stopped by {info['stopped_by']} {when}; partial results: "
                  f"{json_path}" + (f" (report: {html_path})" if html_path else ""))
            return 128 + signal.Signals[info["stopped_by"]].value
        if stem:  # (a run written elsewhere, --json, leaves this folder alone)
            _keep_timing(doc)
        failing = sum(r["status"] in results.FAILING for r in doc["records"])
        try:
            print_summary(doc)
            print_timing(doc)
            print(f"\nresults: {json_path}  ({len(doc['records'])} records, "
                  f"{info['duration_s']} s)")
            if html_path is not None:
                print(f"report:  {html_path}")
        except OSError:  # stdout gone (a closed pipe): the results are written
            pass
        return 1 if failing else 0


def _previous_timing() -> dict[str, float]:
    """Seconds a unit took per backend in the latest runs here (TIMING), if it can be
    read: a few bytes, where reading the latest results file took ~0.5 s of the run."""
    try:
        kept = json.loads((RESULTS_DIR / TIMING).read_text(encoding="utf-8"))
        return {str(b): float(s) for b, s in kept.items()
                if isinstance(s, (int, float)) and math.isfinite(s)}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _keep_timing(doc: dict) -> None:
    """Write TIMING (for a run written into RESULTS_DIR that was not stopped): this run's
    seconds a unit per backend it ran, beside what the file says of the backends it did
    not run. (A mean for ordering backends, not a measurement: a run of a few checks
    counts as a full run does.)"""
    units: dict[str, set] = {}
    for r in doc["records"]:
        units.setdefault(r["backend"], set()).add((r["check"], r["dtype"]))
    per_unit = _previous_timing()
    for b, t in (doc["runs"][0].get("timing") or {}).items():
        if t.get("checks_s") and units.get(b):
            per_unit[b] = round(float(t["checks_s"]) / len(units[b]), 4)
    try:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        tmp = RESULTS_DIR / f"{TIMING}.{os.getpid()}.tmp"  # (runs in one folder at once)
        tmp.write_text(json.dumps(per_unit, sort_keys=True), encoding="utf-8")
        tmp.replace(RESULTS_DIR / TIMING)
    except OSError:  # an unwritable folder costs the next run its order, nothing more
        pass


def print_timing(doc: dict, out=None) -> None:
    """Where the time went: per backend, its load (imports, framework start-up) and its
    checks, with the three costliest check families; of each, the part the backend says
    it spent compiling (JIT, XLA, sessions; loading compiled code from a cache included),
    "?" where it does not say."""
    timing = doc["runs"][0].get("timing") or {}
    if not timing:
        return

    def compiled(seconds) -> str:
        return "?" if seconds is None else f"{seconds:.1f}"

    rows: list[list[Any]] = [["backend", "ready after", "checks", "compile", "processes",
                              "costliest families (compile)"]]
    for name, t in sorted(timing.items(), key=lambda kv: -kv[1]["checks_s"]):
        top = sorted(t["families"].items(), key=lambda kv: -kv[1])[:3]
        fam_c = t.get("family_compile_s") or {}
        known = t.get("compile_s") is not None
        rows.append([name, f"{t['load_s']:.1f} s", f"{t['checks_s']:.1f} s",
                     f"{compiled(t.get('compile_s'))} s", t.get("processes", 1),
                     ", ".join(f"{f} {s:.1f} s ({compiled(fam_c.get(f, 0.0) if known else None)})"
                               for f, s in top)])
    print("\nwhere the time went (--jobs processes at a time; checks: seconds summed over "
          "the backend's processes; compile: the part spent compiling, as the backend "
          "counts it):",
          file=out or sys.stdout)
    _print_table(rows, out)


def print_summary(doc: dict, out=None) -> int:
    """The per-backend status table and every failure; returns the number failing."""
    out = out or sys.stdout
    counts = results.summarize(doc["records"])
    rows: list[list[Any]] = [["backend", "version", *results.STATUSES, "verdict"]]
    for b in doc["backends"]:
        c: Counter | dict = counts.get(b["name"], {})
        if not b["available"]:  # (its load error, where recorded, is counted here)
            rows.append([b["name"], "-", *[c.get(s, 0) for s in results.STATUSES],
                         f"unavailable: {str(b['error'])[:60]}"])
            continue
        failing = sum(c.get(s, 0) for s in results.FAILING)
        verdict = "conforms" if failing == 0 else f"{failing} failing"
        if c.get("deviation"):
            verdict += f", {c['deviation']} documented deviations"
        held_back = c.get("unsupported", 0) + c.get("refused", 0)
        if held_back > c.get("pass", 0) + c.get("deviation", 0):
            # a backend that implements little conforms in little: say how little
            verdict += f" (where it ran: {held_back} of {sum(c.values())} cases not run)"
        rows.append([b["name"], b["version"], *[c.get(s, 0) for s in results.STATUSES], verdict])
    print(file=out)
    _print_table(rows, out)
    for b in doc["backends"]:
        for entry in b.get("stale_deviations", []):
            print(f"\nstale deviation entry of {b['name']}: {entry} (it selects records of this "
                  "run but explained none: the backend no longer deviates there)", file=out)
    bad = [r for r in doc["records"] if r["status"] in results.FAILING]
    if bad:
        print(f"\n{len(bad)} failing record(s) (texts cut at {CONSOLE_TEXT} characters end in "
              "'...'; the results file and the report hold them whole):", file=out)
        for r in bad:
            diagnosis = diagnosis_summary(r.get("diagnosis"))
            print(f"  [{r['status']}] {r['backend']} {r['check']} {r['dtype']} ({r['case']}): "
                  f"{_cut(r['message'])}" + (f" -- diagnosis: {_cut(diagnosis)}" if diagnosis
                                             else ""), file=out)
    return len(bad)


#: Characters of a failing record's message (and of its diagnosis) the console shows.
CONSOLE_TEXT = 300


def _cut(text: str) -> str:
    """`text`, or its first CONSOLE_TEXT characters and '...' (a line cut mid-word with no
    mark read as the whole message: found by a new user)."""
    return text if len(text) <= CONSOLE_TEXT else text[:CONSOLE_TEXT].rstrip() + "..."


# ------------------------------------------------------------------ report
def _report_inputs(names: list[str]) -> list[Path]:
    """The files a `report` call means: files as given, folders as every results file in
    them (a stream only where its document is missing), nothing as the latest run."""
    if not names:
        latest = RESULTS_DIR / LATEST
        if not latest.is_file():
            raise results.ResultsError(f"no {latest}: name a results file, or run `normspec run` "
                                       "first")
        try:
            stem = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise results.ResultsError(f"{latest} cannot be read ({exc})") from None
        if not stem or "\n" in stem or len(stem) > 200 or "/" in stem:
            raise results.ResultsError(f"{latest} does not name a run (it holds "
                                       f"{stem[:40]!r}...); name a results file")
        doc_path = RESULTS_DIR / f"{stem}.json"
        return [doc_path if doc_path.exists() else RESULTS_DIR / f"{stem}.jsonl"]
    files: list[Path] = []
    for f in map(Path, names):
        if f.is_dir():
            docs = sorted(f.glob("*.json"))
            files += docs + [s for s in sorted(f.glob("*.jsonl"))
                             if s.with_suffix(".json") not in docs]
        elif f.exists():
            files.append(f)
        else:
            raise results.ResultsError(f"{f} does not exist")
    if not files:
        raise results.ResultsError(f"no results files in {' '.join(names)}")
    return files


def cmd_report(args) -> int:
    from normspec.reports import html

    try:
        files = _report_inputs(args.files)
        docs = [results.read(f) for f in files]
        results.check_mergeable(docs, [str(f) for f in files])
    except results.ResultsError as exc:
        return _refuse(str(exc), "report")
    if args.output:
        out = Path(args.output)
    elif len(files) == 1:
        out = REPORTS_DIR / f"{files[0].stem}.html"
    else:
        out = REPORTS_DIR / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-merged.html"
    why = _unwritable(out) or _not_a_report_path(out) or (
        _same_file(out, *files) and "it is one of the results files the report is made from")
    if why:
        return _refuse(f"cannot write {out}: {why}", "report")
    names = [str(f) for f in files]
    path = html.write_report(docs, out, names)
    incomplete = sum(not r.get("complete", True) for d in docs for r in d["runs"])
    merged = results.merge(docs, names)
    superseded = merged["superseded"]
    left_out = sum(u["records"] for u in superseded)
    print(f"report: {path} ({len(docs)} result file(s), "
          f"{sum(len(d['records']) for d in docs) - left_out} records"
          + (f", {incomplete} incomplete run(s)" if incomplete else "")
          + (f", {left_out} records of {len(superseded)} unit(s) superseded" if superseded
             else "") + ")")
    for line in _superseded_lines(superseded) + _incomplete_lines(merged):
        print(line)
    for f, doc in zip(files, docs, strict=True):
        _warn_unreadable(f, doc)
    return 0


def _superseded_lines(superseded: list[dict]) -> list[str]:
    """What a merge left out, one line per file and the file that displaced it: how many
    records, how many of them failing, and why (results.merge)."""
    why = {"later": "a later run", "finished": "the run that finished them, where this one did not"}
    totals: dict[tuple, Counter] = {}
    for u in superseded:
        key = (u["file"], u["by"], u["because"])
        totals.setdefault(key, Counter()).update(records=u["records"], failing=u["failing"],
                                                 units=1)
    return [f"  left out: {c['records']} records of {c['units']} unit(s) of {file} "
            f"({c['failing']} fail or error), superseded by {by}: {why[because]}"
            for (file, by, because), c in totals.items()]


def _incomplete_lines(merged: dict) -> list[str]:
    """The merge's unfinished units (results.merge), one line per backend and run label,
    and one per run label whose shards are not all here."""
    groups: dict[tuple, Counter] = {}
    for u in merged["unfinished"]:
        groups.setdefault((u["backend"], u["run"]), Counter())[u["why"]] += 1
    lines = [f"  incomplete: backend {name!r} of run {run!r}: " + ", ".join(
        f"{c[why]} unit(s) {text}" for why, text in (
            ("no record", "with no record, though runs of this label planned them"),
            ("not finished", "not finished by any run here")) if c[why])
        for (name, run), c in groups.items()]
    return lines + [f"  missing shards: run label {label!r} lacks shard(s) {', '.join(shards)} "
                    "(give all shards of a run one --label)"
                    for label, shards in merged["missing_shards"].items()]


def _warn_unreadable(path: Path, doc: dict) -> None:
    """One line on stderr for a stream with lines that could not be read: the report
    holds every other line's records, and says so too."""
    lost = [n for run in doc["runs"] for n in run.get("unreadable_lines") or []]
    if lost:
        shown = ", ".join(map(str, lost[:10])) + (", ..." if len(lost) > 10 else "")
        _tell(f"normspec report: warning: {path}: {len(lost)} line(s) could not be read "
              f"(line {shown}): what they held is not in the report; every other line's "
              "records are")


# ------------------------------------------------------------------ bench
def cmd_bench(args) -> int:
    from . import bench

    unknown = _unknown_backend(args.backend)
    if unknown:
        return _refuse(unknown, "bench")
    if args.json is not None and Path(args.json).suffix == ".jsonl":
        return _refuse(f"--json {args.json}: a .jsonl file is read as a run's stream; give a "
                       ".json path", "bench")
    why = _unwritable(Path(args.json) if args.json else RESULTS_DIR / f"{_stem_of('bench')}.json") \
        or (args.json and _kept_by_runs(Path(args.json)))
    if why:
        return _refuse(f"cannot write {args.json or RESULTS_DIR}: {why}", "bench")
    stem, made = None, not RESULTS_DIR.exists()
    if args.json is None:
        # a file of its own, as a run's: a second bench left the first's numbers intact
        # nowhere (found by a new user)
        stem = _new_stem("bench")
        args.json = str(RESULTS_DIR / f"{stem}.json")
    try:
        return bench.main(args)
    except runner.BackendNotUsable as exc:
        return _refuse(str(exc), "bench")
    finally:
        if stem:
            _release(stem, made)


class _Parser(argparse.ArgumentParser):
    """Bad arguments get one line naming the value, and exit code 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="normspec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("backends", help="list every backend found, with capabilities")
    b.add_argument("--json", action="store_true", help="print JSON instead of text")
    b.add_argument("--backend", action="append", metavar="NAME|module:factory",
                   help="only these (repeatable), a third-party module:factory included")
    b.set_defaults(fn=cmd_backends)

    cl = sub.add_parser("claims", help="every claim of the spec and the checks that verify it")
    cl.add_argument("--markdown", action="store_true",
                    help="write docs/claims.md's text: claims, formulas, examples, checks")
    cl.add_argument("--results", metavar="FILE",
                    help="with --markdown: add what each backend did, from a results file")
    cl.set_defaults(fn=cmd_claims)

    c = sub.add_parser("checks", help="list the conformance checks and their claim ids")
    c.set_defaults(fn=cmd_checks)

    r = sub.add_parser("run", help="run the conformance checks, write JSON and HTML")
    r.add_argument("--backend", action="append", metavar="NAME|module:factory",
                   help="backend to check (repeatable); default: every backend found but the "
                        "opt-in ones (`normspec backends` marks them)")
    r.add_argument("--check", action="append", metavar="ID",
                   help="check id, claim id or claim family (repeatable), e.g. F2, "
                        "B1.layer_norm_shift or DP")
    r.add_argument("--dtype", action="append", choices=list(runner.DEFAULT_DTYPES),
                   help="dtype (repeatable); default: all four")
    r.add_argument("--json", type=_path, default=None, metavar="PATH",
                   help="results path (default: results/<UTC time>-<label>.json, a new file "
                        "for every run; results/latest names the newest)")
    r.add_argument("--html", type=_path, default=None, metavar="PATH",
                   help="report path (default: reports/<same name>.html)")
    r.add_argument("--no-html", action="store_true", help="write the JSON only")
    r.add_argument("--seed", type=_seed, default=0,
                   help="seed of every drawn input, recorded (0 to 2**63 - 1; default 0)")
    r.add_argument("--examples", type=_positive_int, default=10,
                   help="Hypothesis examples per drawn case (at least 1; default 10)")
    r.add_argument("--timeout", type=_seconds, default=120.0,
                   help="seconds one check may take on one backend and dtype (default 120)")
    r.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                   help="backend processes working at once (default: cores); a free one "
                        "shares the backend with the most work left")
    r.add_argument("--label", type=_label, default=None,
                   help="run label in the results and file name (default: tox env or host name)")
    r.add_argument("--shrink", action="store_true", help="let Hypothesis shrink failures")
    r.add_argument("--shard", type=_shard, default=None, metavar="K/N",
                   help="run shard K of N of the (check, dtype) pairs, for every backend, so N "
                        "CI jobs or machines share a suite (the same pairs whichever backends "
                        "a machine has); `normspec report` merges the shards' files")
    r.add_argument("--replicas", type=_replicas, default=None, metavar="R",
                   help="replicas of the data-parallel checks (DP; 2 to 64; default "
                        "$NORMSPEC_DP_REPLICAS or 2); each replica is a process or a device")
    r.add_argument("--record-unavailable", action="store_true",
                   help="record a --backend that cannot be loaded as an error and run the "
                        "others (default: refuse the run, exit 2)")
    r.add_argument("--quiet", action="store_true", help="no per-check progress lines")
    r.set_defaults(fn=cmd_run)

    rep = sub.add_parser("report", help="merge results files into one HTML report")
    rep.add_argument("files", nargs="*", metavar="FILE|FOLDER",
                     help="results files (.json, or a .jsonl stream of an unfinished run) or "
                          "folders of them; none: the latest run (results/latest)")
    rep.add_argument("-o", "--output", type=_path, default=None,
                     help="report path (default: reports/<results name>.html, or "
                          "reports/<UTC time>-merged.html for several files)")
    rep.set_defaults(fn=cmd_report)

    be = sub.add_parser("bench", help="benchmark every backend against a memory copy")
    be.add_argument("--backend", action="append", metavar="NAME|module:factory",
                    help="backend to time (repeatable); default: every backend found but the "
                         "opt-in ones (`normspec backends` marks them)")
    be.add_argument("--json", type=_path, default=None, metavar="PATH",
                    help="results path (default: results/<UTC time>-bench.json, a new file "
                         "for every bench); `normspec report` plots it")
    be.add_argument("--quick", action="store_true", help="small shapes only")
    be.add_argument("--no-curve", action="store_true",
                    help="leave out the cost curve over row widths 64 .. 65536 (64 .. 16384 "
                         "with --quick)")
    be.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    for out in (sys.stdout, sys.stderr):
        # a backend's name or message with a lone surrogate (or a character the console's
        # encoding lacks) is printed escaped: it ended a run with a traceback and no
        # results file, raised in a slot thread's progress line (found by a review)
        reconfigure = getattr(out, "reconfigure", None)  # (a TextIOWrapper's; not a test's)
        if reconfigure is not None:
            with contextlib.suppress(ValueError):
                reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `normspec checks | head`: the reader left, nothing is wrong
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
