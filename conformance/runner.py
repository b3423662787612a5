"""The run: every selected check, for every backend and dtype.

Each backend runs in a process of its own (worker.py), driven by one of `jobs` slot
threads here: at most `jobs` processes work at once, and once every backend has had its
turn, a free slot shares the backend with the most work left in a second process. A
backend that raises, hangs, dies or misbehaves fails that check alone and the run goes on.
Every record is handed to `on_record` the moment it arrives (the CLI streams it to disk),
and an interruption (Ctrl-C, SIGTERM) stops the backend processes at once and returns
what was done, marked incomplete."""

from __future__ import annotations

import collections
import datetime as _dt
import difflib
import os
import platform
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from importlib import metadata

from normspec.impls.protocol import DTYPES

from . import deviations, results, tolerances
from .checks import Check, all_checks
from .results import Record
from .unit import backend_entry, run_check
from .worker import Worker

DEFAULT_DTYPES = DTYPES
#: a free slot starts a second process for a backend only when that backend's units not
#: yet started are expected to take at least this long, and at least SHARE_LOADS times
#: what loading the backend took at the run's start (a process costs a load, ~1-5 s, and
#: the compile caches it has not warmed; two processes finish work W in about (W + the
#: load) / 2, so the share gains (W - the load) / 2)
SHARE_MIN_S = 3.0
SHARE_LOADS = 2.0
SHARE_POLL_S = 0.2
VERSIONED_PACKAGES = ("normspec", "numpy", "ml_dtypes", "hypothesis", "torch", "jax", "flax",
                      "jaxlib", "numba", "triton")


def select_checks(patterns: Iterable[str] | None) -> list[Check]:
    """Checks whose id equals a pattern or starts with it followed by a dot, whose claim
    names it ("F2" selects F2.values, F2.grad and F2/F3.half_overflow), or one of whose
    claims is in the family the pattern names ("DP" selects DP1, DP2, DP3...; "F" every
    F claim's, F2/F3.half_overflow too: found by a review, "F" had left out the 12
    checks of two claims)."""
    checks = all_checks()
    if not patterns:
        return checks
    chosen, patterns = [], list(patterns)
    for p in patterns:
        hits = [c for c in checks if c.id == p or c.id.startswith(p + ".") or c.claim == p
                or any(claim == p or (p.isalpha() and claim.startswith(p)
                                      and claim[len(p):].isdigit())
                       for claim in c.claim.split("/"))]
        if not hits:
            close = difflib.get_close_matches(p, [c.id for c in checks] + sorted(
                {c.claim for c in checks}), n=4, cutoff=0.5)
            raise ValueError(f"unknown check {p!r}" + (f"; did you mean {', '.join(close)}?"
                                                        if close else "")
                             + f" (`normspec checks` lists all {len(checks)})")
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
    """The run's entry in its results file; `id` tells it from any other run, even one of
    the same label started in the same second (a merge refuses a run counted twice)."""
    return {"run": label, "id": uuid.uuid4().hex,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            # (to the microsecond: which of two runs of one second is the later, see
            # results.merge)
            "started": round(time.time(), 6),
            "seed": seed, "host": platform.node(), "cpu": _cpu(), "platform": platform.platform(),
            "python": sys.version.split()[0], "versions": _versions(), "argv": sys.argv[1:]}




class Stopped(BaseException):
    """Raised in the main thread at a checkpoint after a signal: the run stops, keeping
    its records.
    A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


class _StopRequests:
    """A signal's stop, as the main thread sees it. The CLI's handler, which runs in the
    main thread between any two of its bytecodes, only records it (`request_stop`); the
    main thread acts on it at a `checkpoint()`, in each loop it waits in: while the
    backends load, and while the slots run. Raised from the handler itself, Stopped
    landed inside concurrent.futures' wait(), in a `with` on a future's lock not yet
    begun, and left the lock held: the stopped run hung in the pool's shutdown (1 stopped
    run in 16 on this loaded 2-core machine); and after the slots had finished it threw
    away the finished run's results, or ended in a traceback while they were written
    (found by a review). A stop that comes after the last checkpoint is not acted on:
    the run is complete by then, and its results are written as usual."""

    def __init__(self):
        self.pending = ""


STOPS = _StopRequests()


def request_stop(signal_name: str) -> None:
    """What a signal handler calls: the run stops at its next checkpoint."""
    STOPS.pending = STOPS.pending or signal_name


def checkpoint() -> None:
    """Raise Stopped here if a stop was requested (main thread only)."""
    if STOPS.pending:
        raise Stopped(STOPS.pending)


def _record_ctrl_c() -> Callable[[], object]:
    """Ctrl-C in a program that calls run() itself, with Python's own SIGINT handler:
    recorded as a stop until the returned function puts that handler back, as the CLI's
    handler does, instead of a KeyboardInterrupt raised at any bytecode (which could
    leave a lock of concurrent.futures held and hang the run, see _StopRequests). A
    handler of the program's own is left alone."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        saved = signal.signal(signal.SIGINT, lambda signum, frame: request_stop("SIGINT"))
        return lambda: signal.signal(signal.SIGINT, saved)
    return lambda: None


class BackendNotUsable(ValueError):
    """A backend asked for by name could not be loaded (before any check ran)."""


def plan(backends: list[str], checks: list[Check], dtypes: list[str]) -> list[tuple]:
    """The units of a run, in order: (backend, check id, dtype). A check restricted to
    some dtypes plans only those."""
    return [(b, c.id, d) for b in backends for c in checks for d in dtypes
            if c.dtypes is None or d in c.dtypes]


def shard_units(units: list[tuple], shard: tuple[int, int] | None) -> list[tuple]:
    """Shard K of N of a run's units (backend, check, dtype): those whose (check, dtype)
    is among every N-th of the units' sorted distinct (check, dtype) pairs, starting at
    the K-th (round robin, so each check's dtypes spread over the shards), for every
    backend. The pairs depend on the checks and dtypes alone, not on which backends a
    machine has: shards sharded over whole units shifted when one machine lacked a
    backend, and units of the others fell in no shard (found by a review: 457 of 1370
    with jax missing on one machine of three). Deterministic whatever machine computes
    it; the N shards together are the unsharded run, each unit in one of them. Kept in
    plan order."""
    if shard is None:
        return units
    k, n = shard
    if not 1 <= k <= n:
        raise ValueError(f"shard {k}/{n}: K must be from 1 to N")
    chosen = set(sorted({(u[1], u[2]) for u in units})[k - 1::n])
    return [u for u in units if (u[1], u[2]) in chosen]


def planned_pairs(checks: list[Check], dtypes: list[str],
                  shard: tuple[int, int] | None) -> list[list[str]]:
    """The (check, dtype) pairs a run of these checks and dtypes plans for each backend,
    its shard's where sharded (shard_units), sorted."""
    pairs = {(u[1], u[2]) for u in shard_units(plan(["-"], checks, dtypes), shard)}
    return [list(p) for p in sorted(pairs)]


def check_dtypes(dtypes: Iterable[str]) -> list[str]:
    dtypes = list(dtypes)
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    return dtypes


class _Run:
    """The state of one run: its workers, its records per unit, and whether it stops."""

    def __init__(self, *, label, seed, examples, timeout, shrink, say, on_record):
        self.label, self.seed, self.examples = label, seed, examples
        self.timeout, self.shrink, self.say = timeout, shrink, say
        self.on_record = on_record or (lambda rec: None)
        self.on_done: Callable[[tuple], None] = lambda unit: None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.workers: dict[str, Worker] = {}
        self.records: dict[tuple, list[dict]] = {}
        self.done: set[tuple] = set()
        #: where the time went, per backend: loading, and checks per family
        self.timing: dict[str, dict] = {}
        self.family = {c.id: c.fn.__module__.rsplit(".", 1)[-1] for c in all_checks()}
        #: per backend name: its units not yet started, loaded processes no slot holds,
        #: processes working on it, and how many of its units have finished (their
        #: seconds are timing[name]["checks_s"])
        self.order: list[str] = []
        self.requested: dict[str, str] = {}
        self.pending: dict[str, collections.deque] = {}
        self.idle: dict[str, list[Worker]] = {}
        self.active: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.extra: list[Worker] = []  # second processes of shared backends
        self.unshareable: set[str] = set()
        #: per backend name: the processes a slot is driving now (see drive)
        self.driving: dict[str, list[Worker]] = collections.defaultdict(list)
        #: threads letting finished processes exit (_stop_later)
        self.stoppers: list[threading.Thread] = []

    def _keep(self, unit, rec: dict) -> None:
        rec["run"] = self.label
        # filed under the name the results list the backend by: a process started after a
        # crash may have made it call itself something else (a name with its pid)
        rec["backend"] = unit[0]
        with self.lock:
            self.records.setdefault(unit, []).append(rec)
            self.on_record(rec)

    def load(self, names: list[str]) -> list[Worker]:
        """Start every backend's process at once and wait until each has loaded."""
        workers = [Worker(n, self.label) for n in names]
        start = time.perf_counter()
        for w in workers:
            self.workers[w.requested] = w
            checkpoint()  # (no process is started once a stop came)
            w.start()
        for w in workers:
            w.wait_loaded(self.timeout, interrupt=checkpoint)
            # loads overlap: this is when the backend was ready, counted from the start
            # compile_s / family_compile_s: the part of checks_s / families the backend
            # says it spent compiling (None: it does not say)
            self.timing[w.entry["name"]] = {"load_s": round(time.perf_counter() - start, 2),
                                            "checks_s": 0.0, "families": {}, "processes": 1,
                                            "compile_s": None, "family_compile_s": {}}
        return workers

    # ------------------------------------------------------------ scheduling
    def queue(self, workers: list[Worker], units: list[tuple]) -> None:
        """Hand the planned units to the slots: per backend, in plan order, and the
        backend's loaded process waiting for the first slot that takes it."""
        for w in workers:
            name = w.entry["name"]
            self.order.append(name)
            self.requested[name] = w.requested
            self.idle[name] = [w]
            self.pending[name] = collections.deque(u for u in units if u[0] == name)
            self.active[name] = 0
            self.finished[name] = 0

    def _remaining_s(self, name: str) -> float:
        """What the backend's units not yet started will take, by the mean of its
        finished ones (infinite before any has finished: not yet known)."""
        n = self.finished[name]
        return (len(self.pending[name]) * self.timing[name]["checks_s"] / n if n
                else float("inf"))

    def _choose(self) -> tuple[str | None, bool]:
        """(backend for a free slot, whether nothing is left to wait for). A backend no
        process works on comes first, in the run's order (slowest first); else, a second
        process for the backend with the most work left, when that work is known to
        outweigh starting a process (`SHARE_MIN_S`, `SHARE_LOADS`)."""
        waiting = [n for n in self.order if self.pending[n]]
        if not waiting:
            return None, True
        fresh = [n for n in waiting if not self.active[n]]
        if fresh:
            return fresh[0], False
        shareable = [n for n in waiting if n not in self.unshareable
                     and len(self.pending[n]) >= 2
                     and self._remaining_s(n) >= max(SHARE_MIN_S,
                                                     SHARE_LOADS * self.timing[n]["load_s"])]
        if shareable:
            best = max(shareable, key=self._remaining_s)
            if self._remaining_s(best) != float("inf"):
                return best, False
        return None, False  # the work left is unknown or small: the busy processes keep it

    def slot(self) -> None:
        """One of `jobs` slots: takes a backend, runs its units until none is left,
        then takes the next. Once every backend has a process, a free slot shares the
        backend with the most work left, in a process of its own, so two cores finish
        together instead of one waiting for the slowest backend."""
        while not self.stopping.is_set():
            with self.lock:
                name, finished = self._choose()
                if name is not None:
                    worker = self.idle[name].pop() if self.idle[name] else None
                    self.active[name] += 1
            if finished:
                return
            if name is None:
                time.sleep(SHARE_POLL_S)
                continue
            try:
                if worker is None:
                    with self.lock:  # (stop() closes every worker in `extra`, under it)
                        if self.stopping.is_set():
                            return
                        worker = Worker(self.requested[name], self.label)
                        self.extra.append(worker)
                    if (not worker.start() or not worker.wait_loaded(self.timeout)
                            or worker.entry["name"] != name):
                        # the units stay with the backend's first process
                        with self.lock:
                            self.unshareable.add(name)
                        continue
                    with self.lock:
                        self.timing[name]["processes"] += 1
                self.drive(worker, name)
            finally:
                with self.lock:
                    self.active[name] -= 1
                if worker is not None:
                    self._stop_later(worker)

    def _stop_later(self, worker: Worker) -> None:
        """Let `worker`'s process finish in a thread of its own, and the slot take its
        next backend now: a framework's exit takes seconds (jax's ~1.5 s here), during
        which a core would wait. run() waits for these threads before it returns (a
        stopped run kills the processes first)."""
        t = threading.Thread(target=worker.stop, name=f"normspec-stop-{worker.requested}",
                             daemon=True)
        t.start()
        with self.lock:
            self.stoppers.append(t)

    def join_stoppers(self) -> None:
        """Wait for the processes _stop_later let finish (each ends within seconds: it
        is killed if it does not exit)."""
        with self.lock:
            stoppers = list(self.stoppers)
        for t in stoppers:
            t.join()

    def drive(self, worker: Worker, name: str) -> None:
        """The backend's units, one at a time, in `worker`'s process, until none is left.
        A worker that gave up starting its process again (Worker.given_up) leaves the
        units to another process of the backend that a slot drives and that has not
        given up, if there is one (it leaves drive only when no unit is left, so none
        goes without a record); else it records each unit left at once. The backend gets
        no further process (unshareable)."""
        with self.lock:
            self.driving[name].append(worker)
        try:
            self._drive(worker, name)
        finally:
            with self.lock:
                self.driving[name].remove(worker)

    def _drive(self, worker: Worker, name: str) -> None:
        """drive's loop, while `worker` is listed in `driving`."""
        while not self.stopping.is_set():
            with self.lock:
                if not self.pending[name]:
                    return
                if worker.given_up:
                    self.unshareable.add(name)
                    if any(not w.given_up for w in self.driving[name] if w is not worker):
                        return
                unit = self.pending[name].popleft()
            _, check_id, dtype = unit
            t0 = time.perf_counter()
            recs = worker.execute(check_id, dtype, seed=self.seed, examples=self.examples,
                                  shrink=self.shrink, timeout=self.timeout,
                                  on_record=lambda rec, u=unit: self._keep(u, rec),
                                  stopping=self.stopping)
            if self.stopping.is_set():
                return  # the unit was cut short by the stop, not by the backend
            spent = time.perf_counter() - t0
            with self.lock:
                self.done.add(unit)
                self.finished[name] += 1
                t = self.timing[name]
                t["checks_s"] = round(t["checks_s"] + spent, 2)
                fam = self.family.get(check_id, "other")
                t["families"][fam] = round(t["families"].get(fam, 0.0) + spent, 2)
                if worker.last_compile_s is not None:  # (rounded when printed: many are ms)
                    c = t["family_compile_s"]
                    c[fam] = c.get(fam, 0.0) + worker.last_compile_s
                    t["compile_s"] = (t["compile_s"] or 0.0) + worker.last_compile_s
            # (outside the lock: the stream syncs the unit to disk, and the other slot
            # need not wait on the disk for that)
            self.on_done(unit)
            if recs:
                counts = ", ".join(f"{n} {s}" for s, n in _count(recs).items())
                self.say(f"{name:>8} {check_id:<26} {dtype:<9} {counts} "
                         f"({time.perf_counter() - t0:.1f}s)")

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
            workers = [*self.workers.values(), *self.extra]
        for w in workers:
            w.close()


def run(backends: list[str] | None = None, *, checks: list[str] | None = None,
        dtypes: list[str] | None = None, seed: int = 0, examples: int = 20,
        timeout: float = 120.0, label: str | None = None, shrink: bool = False, jobs: int = 1,
        shard: tuple[int, int] | None = None, record_unavailable: bool = False,
        progress: Callable[[str], None] | None = None,
        on_start: Callable[[dict, list], object] | None = None,
        on_record: Callable[[dict], None] | None = None,
        on_done: Callable[[tuple], None] | None = None,
        previous: dict[str, float] | None = None) -> dict:
    """Run the conformance suite and return the results document (see results.py).

    `backends` None means every backend found; those whose framework is missing are
    listed as unavailable. A backend asked for by name that cannot be loaded raises
    BackendNotUsable before any check runs, unless `record_unavailable`, which records it
    as an error. `shard` (K, N) runs shard K of N of the planned units (`shard_units`);
    its records merge with the other shards' into those of the unsharded run
    (results.merge), and it leaves stale-deviation findings to that merge, since an entry
    may explain records of another shard. `on_start(doc, plan)` is called once the
    backends are loaded and before the first check; `on_record(record)` with each record
    as it arrives, `on_done(unit)` when a unit finishes. `previous` (backend -> seconds a
    unit took in earlier runs) starts the slowest backend first. Ctrl-C or `Stopped` end
    the run early: the document returned then has `complete` False, `stopped_by`, and the
    units `not_reached`.
    """
    say = progress or (lambda _msg: None)
    label = label or os.environ.get("TOX_ENV_NAME") or platform.node() or "local"
    selected = select_checks(checks)
    dtypes = check_dtypes(dtypes or DEFAULT_DTYPES)
    explicit = backends is not None
    from normspec.impls import registry

    # a backend asked for twice is checked once
    names = list(dict.fromkeys(backends or ())) if explicit else registry.default_backends()
    doc = results.new_document()
    doc["runs"].append(run_info(seed, label))
    doc["runs"][0]["shard"] = f"{shard[0]}/{shard[1]}" if shard else ""
    # what every backend of this run was to be checked on, for a merge to tell a
    # backend's missing units (one machine's shard without it) from units never planned
    doc["runs"][0]["pairs"] = planned_pairs(selected, dtypes, shard)
    from .checks.data_parallel import replicas

    doc["runs"][0]["replicas"] = replicas()
    doc["tolerances"] = tolerances.table_rows()
    state = _Run(label=label, seed=seed, examples=examples, timeout=timeout, shrink=shrink,
                 say=say, on_record=on_record)
    start = time.perf_counter()
    units: list[tuple] = []
    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="normspec-backend")
    stopped_by = ""
    load_records: list[tuple] = []
    restore_ctrl_c = _record_ctrl_c()
    try:
        workers = state.load(names)
        checkpoint()  # (before a backend that did not load is refused)
        unusable = [w for w in workers if not w.entry.get("available")]
        if explicit and unusable and not record_unavailable:
            raise BackendNotUsable("; ".join(f"backend {w.requested!r} could not be used: "
                                             f"{w.error}" for w in unusable))
        seen: dict[str, str] = {}
        for w in workers:
            other = seen.setdefault(w.entry["name"], w.requested)
            if other != w.requested:
                raise BackendNotUsable(f"backends {other!r} and {w.requested!r} both call "
                                       f"themselves {w.entry['name']!r}; records could not "
                                       "be told apart (give one another name)")
        for w in workers:
            doc["backends"].append(w.entry)
            if w in unusable:
                say(f"{w.requested}: unavailable: {w.error}")
                if explicit and (shard is None or shard[0] == 1):  # one shard records it
                    rec = Record(backend=w.entry["name"], check="load", claim="-", op="-",
                                 dtype="-", case="load", status="error", seed=seed,
                                 message=f"backend {w.requested!r} could not be used: {w.error}")
                    load_records.append(((w.entry["name"], "load", "-"), rec.to_json()))
        # the slowest backend first (by the previous run, where known): two cores finish
        # sooner when the long job does not start last
        usable = sorted((w for w in workers if w not in unusable),
                        key=lambda w: -float((previous or {}).get(w.entry["name"], 0.0)))
        units = shard_units(plan([w.entry["name"] for w in usable], selected, dtypes), shard)
        if on_start is not None:
            on_start(doc, units)
        for unit, rec in load_records:  # (after on_start: the caller's stream exists now)
            state._keep(unit, rec)
        if on_done is not None:
            state.on_done = on_done
        checkpoint()
        state.queue(usable, units)
        futures = [pool.submit(state.slot) for _ in range(max(1, jobs))]
        while futures:
            finished, pending = wait(futures, timeout=0.5, return_when=FIRST_EXCEPTION)
            for f in finished:
                f.result()  # a defect in normspec itself surfaces, never silently
            futures = list(pending)
            if futures:  # (once the last check is done, the run is complete)
                checkpoint()
        # the last processes exit as the others did, not killed by the stop below (a
        # review); a stop asked for meanwhile changes nothing: every check is done
        state.join_stoppers()
    except (KeyboardInterrupt, Stopped) as exc:
        stopped_by = exc.signal_name if isinstance(exc, Stopped) else "SIGINT"
    finally:
        state.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        state.join_stoppers()  # (after the slots, which start them)
        restore_ctrl_c()
        STOPS.pending = ""  # acted on, or come after the last checkpoint (see _StopRequests)
    for unit in [k for k in state.records if k[1] == "load"] + units:
        doc["records"].extend(state.records.get(unit, []))
    for entry in doc["backends"]:
        mine = [r for r in doc["records"] if r["backend"] == entry["name"]]
        entry["stale_deviations"] = [] if shard else deviations.stale(entry.get("deviations", []),
                                                                       mine)
    run_doc = doc["runs"][0]
    if stopped_by and not units:
        # stopped while the backends loaded: every unit of those asked for is unreached,
        # named as asked (a module:factory's own name is not known before it loads)
        units = shard_units(plan(names, selected, dtypes), shard)
    not_reached = [list(u) for u in units if u not in state.done]
    run_doc["timing"] = state.timing
    run_doc.update(duration_s=round(time.perf_counter() - start, 1), planned=len(units),
                   complete=not stopped_by and not not_reached, stopped_by=stopped_by,
                   not_reached=not_reached)
    return doc


def _count(recs):
    out: dict[str, int] = {}
    for r in recs:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out


__all__ = ["DEFAULT_DTYPES", "BackendNotUsable", "Stopped", "backend_entry", "checkpoint", "plan",
           "planned_pairs", "request_stop", "run", "run_check", "select_checks", "shard_units"]
