"""`normspec bench`: forward and forward+backward time of each backend, op and dtype, as
effective bandwidth beside a memory copy of the same bytes, and the cost curve over row
widths.

Normalization reads and writes every element once; a copy of the same bytes (torch
`Tensor.copy_`, multi-threaded; NumPy's when torch is absent) is the physical limit, so
the ratio to it is the figure of merit. The copy's buffers are NumPy arrays, as the
benchmarked inputs are: NumPy asks Linux for transparent huge pages for large arrays
(madvise), torch's allocator does not, and the same copy_ on 4 KB pages measured 20-30%
slower here (33-35 against 42-44 GB/s, [8192, 4096] float16's bytes, idle, alternated in
one process): a baseline on torch.empty buffers was below what a kernel streaming NumPy
arrays reaches (numba's float16 RMSNorm at 116% of it), so every ratio to it read high.
The copy is the same, made the same way, in every backend's process. Never a bare
time: the machine is shared and noisy, so the bench guards its own numbers:

* each backend is timed in a process of its own (the conformance runner's worker,
  conformance/worker.py), one process measuring at a time (they take turns, one
  measurement each, see run_bench), so no other backend's threads are there to spin
  against it (two frameworks' OpenMP threads spinning on two cores once
  made a 2 MB copy take 8 ms and a kernel "3818% of copy"); the OpenMP wait policy is
  left as users run it (the conformance runs' passive waiting is not set here: a
  woken thread costs tens of microseconds a call, which would weigh on small shapes);
* the copy of the same bytes is timed in that process right before and right after each
  measurement; when the two disagree by more than 15% the machine's load changed
  during it, and the result is marked unreliable: no ratio, the reason instead;
* an unreliable measurement is taken again, up to ATTEMPTS times in all (the record
  says how many it took), the last one kept;
* so is one above twice the copy's bandwidth (the copy was slowed before and after
  alike, as spinning threads do);
* a process can also be slowed before, during and after alike: its copy then runs far
  below the same bytes' copy in the other processes' turns or in another round (seen:
  1.75 GB/s against 128-195 GB/s, its kernel "96% of copy" where its other rounds
  measured 40%). A row whose copy ran at less than SLOWED_COPY of the fastest copy of
  the same bytes in its measurement (every process, every round) is unreliable, and
  the measurement is taken again in another round (see _flag_slowed);
* every time is the fastest of its calls, not the median: load only adds time, and on
  a busy machine medians read as whole scheduler slices, kernel and copy alike (a
  [256, 1000] LayerNorm and its copy both "took 12 ms");
* ratios between backends ("x torch") are taken across processes from reliable results
  only, as the ratio of their fractions of copy, each against its own baseline, and
  only where the two baselines agree within UNRELIABLE_SPREAD (see compare_to_torch),
  each pair from one round of turns; where a reliable row of a backend still running
  has no ratio, while torch runs and its row was timed, every backend still running
  takes that measurement again (see _worth_again), up to ROUNDS rounds in all, and the
  results keep the round that measured most (_kept; the record's `round` says which;
  the others' lines were printed as they were measured): copies of a few MB, which run
  in the last-level cache, were seen 20% apart between two processes' turns a second
  apart (the VM's neighbours), and most small shapes had no "x torch".

Bytes counted: forward reads x and writes y (2 N D s); forward+backward also reads x and
g and writes dx (5 N D s in all); the parameter vectors are negligible.

Two ways of calling a backend are timed, labelled in the results, table and plot:
"prepared" is the backend's `prepare_benchmark` callable on arrays in its own format
(numba: outputs allocated once, as the copy's are; torch: its functional ops, which
allocate their output at every call, as a torch user pays), "protocol" is the protocol
call (fresh outputs and the conversions from and to NumPy included).

The cost curve times LayerNorm and RMSNorm in float32 at row widths 64 .. 65536 with
the total bytes held constant (two totals: one near the caches, one well past them),
so it shows where each kernel falls off the memory limit as rows get wide or narrow.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

from . import results
from .cases import dtype_of
from .runner import run_info

SHAPES = {"full": [(8192, 4096), (2, 1 << 20), (256, 1000)], "quick": [(512, 1024), (2, 70_003)]}
OPS = ("layer_norm", "rms_norm")
DTYPES = ("float32", "float16", "bfloat16")
PASSES = ("forward", "forward+backward")
VARIANTS = ("prepared", "protocol")
CURVE = {"full": {"widths": (64, 256, 1024, 4096, 16384, 65536), "elements": (1 << 20, 1 << 24)},
         "quick": {"widths": (64, 1024, 16384), "elements": (1 << 17,)}}
CURVE_DTYPE = "float32"
#: Before/after copy baselines further apart than this: the load changed, no number.
UNRELIABLE_SPREAD = 0.15
#: Measurements of one item until one is reliable (each with its own before/after copy).
ATTEMPTS = 3
#: A kernel "faster" than this many copies of its bytes means the baseline was slowed.
IMPOSSIBLE_OF_COPY = 2.0
#: A process's copy of a measurement's bytes slower than this fraction of the fastest
#: copy of the same bytes any process measured for it (any round): that process was
#: slowed throughout, its copies before and after alike, and its figures are no number.
SLOWED_COPY = 0.5
#: How the error of such a row begins (a later round may measure it again).
SLOWED = "unreliable: this process was slowed throughout"


def plan(quick: bool = False, curve: bool = True) -> list[dict]:
    """Every measurement of a bench, the same for each backend: the table's shapes in
    every dtype, then the cost curve."""
    size = "quick" if quick else "full"
    items = [dict(series="table", op=op, dtype=dt, shape=list(shape), pass_=p, variant=v)
             for shape in SHAPES[size] for dt in DTYPES for op in OPS for p in PASSES
             for v in VARIANTS]
    if curve:
        spec = CURVE[size]
        items += [dict(series=f"curve {n}", op=op, dtype=CURVE_DTYPE, shape=[n // d, d],
                       pass_=p, variant=v)
                  for n in spec["elements"] for d in spec["widths"] for op in OPS
                  for p in PASSES for v in VARIANTS]
    return items


# ------------------------------------------------------------------ timing (in the child)
def _time(fn, repeat: int, budget_s: float = 0.6) -> list[float]:
    """Seconds of each timed call of `fn` after two warm-up calls: at most `repeat`
    calls or about `budget_s` seconds of them (at least three)."""
    fn()
    fn()
    times = []
    deadline = time.perf_counter() + budget_s
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return times


def copy_callable(nbytes: int):
    """A copy of `nbytes` bytes between two buffers made once, by NumPy as the benchmarked
    arrays are (so on the same kind of pages: see the module doc), filled before timing
    so no page fault is timed: torch's multi-threaded `copy_` on them when torch is
    installed, else NumPy's."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    try:
        import torch
    except ImportError:
        return lambda: np.copyto(dst, src)
    t_src, t_dst = torch.from_numpy(src), torch.from_numpy(dst)
    return lambda: t_dst.copy_(t_src)


def judge(rec: dict, before: list[float], after: list[float], kernel: list[float],
          moved: int) -> dict:
    """Fill the numbers of a record from the timings (seconds of each call) of the
    kernel and of the copy before and after it. Each is taken at its fastest call: the
    machine's load only ever adds time (a two-thread region whose thread lost its core
    waits out a scheduler slice, and medians on a busy machine then read as whole
    slices, for kernel and copy alike). Unreliable (no ratio, `error` says why) when
    the copies before and after disagree by more than UNRELIABLE_SPREAD (the load
    changed), or when the kernel beats the copy by IMPOSSIBLE_OF_COPY (the copy was
    slowed throughout)."""
    before_s, after_s, seconds = min(before), min(after), min(kernel)
    rec["ms"] = seconds * 1e3
    rec["gbps"] = moved / seconds / 1e9
    rec["copy_before_gbps"] = moved / before_s / 1e9
    rec["copy_after_gbps"] = moved / after_s / 1e9
    rec["copy_gbps"] = moved / ((before_s + after_s) / 2) / 1e9
    spread = max(before_s, after_s) / min(before_s, after_s) - 1
    why = ""
    if spread > UNRELIABLE_SPREAD:
        why = (f"the copy baseline moved from {rec['copy_before_gbps']:.2f} to "
               f"{rec['copy_after_gbps']:.2f} GB/s during the measurement "
               f"({100 * spread:.0f}% > {100 * UNRELIABLE_SPREAD:.0f}%): the machine's load "
               "changed")
    elif rec["gbps"] > IMPOSSIBLE_OF_COPY * rec["copy_gbps"]:
        why = (f"{rec['gbps']:.2f} GB/s is more than {IMPOSSIBLE_OF_COPY:g}x the copy of the "
               f"same bytes ({rec['copy_gbps']:.2f} GB/s): the baseline was slowed")
    rec["reliable"] = not why
    if why:
        rec["error"] = f"unreliable: {why}"
        return rec
    rec["of_copy"] = rec["gbps"] / rec["copy_gbps"]
    return rec


def timed_callable(backend, variant: str, op: str, x, w, b, g, eps: float = 1e-5):
    """(callable, what it is) that a benchmark of `variant` times: "prepared", the
    backend's prepare_benchmark callable (None where it has none), or "protocol", the
    protocol call. `b` is LayerNorm's bias (RMSNorm takes none); g None: forward alone."""
    shape = x.shape[-1:]
    if variant == "prepared":
        fn = backend.prepare_benchmark(op, x, shape, w, b, eps, g)
        return None if fn is None else (fn, "prepare_benchmark callable (the backend's own arrays)")
    if op == "layer_norm":
        fn = lambda: backend.layer_norm(x, shape, w, b, eps, g)  # noqa: E731
    else:
        fn = lambda: backend.rms_norm(x, shape, w, eps, g)  # noqa: E731
    return fn, "protocol call (fresh outputs, NumPy conversions included)"


def _record(name: str, item: dict) -> dict:
    return {"backend": name, "op": item["op"], "dtype": item["dtype"], "shape": item["shape"],
            "pass": item["pass_"], "variant": item["variant"], "series": item["series"],
            "ms": None, "gbps": None, "copy_gbps": None, "copy_before_gbps": None,
            "copy_after_gbps": None, "of_copy": None, "vs_torch": None, "vs_torch_note": "",
            "reliable": False,
            "timed": "", "error": "", "attempts": 0, "round": None, "pid": os.getpid()}


class _Inputs:
    """The arrays and copy buffers of the item being measured, kept while the next items
    use the same shape and dtype (the plan is ordered so they do): making 33M normal
    numbers or a 300 MB buffer costs more than timing the kernel."""

    def __init__(self):
        self.key: tuple | None = None
        self.x = self.g = None
        self.copies: dict[int, object] = {}

    def get(self, shape: tuple, dtype: str):
        if self.key != (shape, dtype):
            # freed before the next ones are made; the key is set once they are (one
            # that could not be made, a MemoryError, leaves none to be taken for it)
            self.key, self.copies, self.x, self.g = None, {}, None, None
            dt = dtype_of(dtype)
            rng = np.random.default_rng(0)
            self.x = rng.normal(0.5, 2.0, size=shape).astype(dt)
            # a random upstream gradient: with g = 1, dx is 0 up to rounding, and a row
            # of tiny numbers in float16 (subnormals) would time a slow path instead
            self.g = rng.normal(0.0, 1.0, size=shape).astype(dt)
            self.key = (shape, dtype)
        return self.x, self.g

    def copy(self, nbytes: int):
        if nbytes not in self.copies:
            self.copies[nbytes] = copy_callable(nbytes)
        return self.copies[nbytes]


def measure_one(backend, name: str, item: dict, repeat: int = 10,
                inputs: _Inputs | None = None) -> dict:
    """One measurement: the backend's callable timed between two copies of the same
    bytes."""
    op, dtype, shape = item["op"], item["dtype"], tuple(item["shape"])
    rec = _record(name, item)
    backward = item["pass_"] != "forward"
    caps = backend.capabilities
    if not caps.supports(op, dtype) or (backward and not caps.has_gradient(op, dtype)):
        rec["error"] = "unsupported (capabilities)"
        return rec
    if backend.benchmark_skip_reason:
        rec["error"] = f"not timed: {backend.benchmark_skip_reason}"
        return rec
    inputs = inputs or _Inputs()
    try:
        # inside: inputs that cannot be made (a MemoryError) are this row's error, and
        # the process goes on to the next measurement
        x, g = inputs.get(shape, dtype)
        g = g if backward else None
        d = shape[-1]
        w, b = np.ones(d, x.dtype), (np.zeros(d, x.dtype) if op == "layer_norm" else None)
        timed = timed_callable(backend, item["variant"], op, x, w, b, g)
        if timed is None:
            rec["error"] = "no prepare_benchmark: see its protocol row"
            return rec
        fn, rec["timed"] = timed
        moved = x.nbytes * (5 if backward else 2)
        copy = inputs.copy(moved // 2)
        for attempt in range(1, ATTEMPTS + 1):
            before = _time(copy, repeat, budget_s=0.2)
            seconds = _time(fn, repeat)
            after = _time(copy, repeat, budget_s=0.2)
            rec = judge(dict(rec, error=""), before, after, seconds, moved)
            rec["attempts"] = attempt
            if rec["reliable"]:
                break
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run is reported
        rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec
    finally:
        fn = None  # a prepared callable's buffers go before the next item's are made
    return rec


#: The child's arrays, kept from one turn to the next (run_bench sends a turn at a time).
_INPUTS = _Inputs()


def measure(loaded, items: list[dict], *, repeat: int, emit) -> int:
    """The child's side: every item of a turn on one loaded backend, each record sent
    through `emit` as soon as it is measured."""
    for item in items:
        emit(measure_one(loaded.backend, loaded.name, item, repeat, _INPUTS))
    return len(items)


# ------------------------------------------------------------------ the run (the parent)
def compare_to_torch(rows: list[dict]) -> None:
    """`vs_torch` of every reliable row: its fraction of copy over torch's prepared
    one's for the same measurement (each against the copy in its own process), where
    the two processes' copies of the same bytes ran within UNRELIABLE_SPREAD of each
    other. Where they did not, the two were timed in different states of the machine
    (this VM's copy bandwidth has been seen to sit at ~37 or ~62 GB/s for minutes at a
    time), and the ratio of their fractions would flatter the one timed against the
    faster copy; no number then, `vs_torch_note` says why, as it does where torch's row
    was timed but has no number itself."""
    torch_rows = {_key(r): r for r in rows if r["backend"] == "torch"
                  and r["variant"] == "prepared"}
    for r in rows:
        t = torch_rows.get(_key(r))
        if t is None or not (r.get("reliable") and r.get("of_copy")):
            continue
        if not (t.get("reliable") and t.get("of_copy")):
            has = "no number" if t.get("ms") is not None else "no time"
            r["vs_torch_note"] = f"no x torch: torch's prepared row has {has} ({t['error']})"
            continue
        apart = max(r["copy_gbps"], t["copy_gbps"]) / min(r["copy_gbps"], t["copy_gbps"]) - 1
        if apart > UNRELIABLE_SPREAD:
            r["vs_torch_note"] = (
                f"no x torch: the copy of the same bytes ran at {r['copy_gbps']:.1f} GB/s in "
                f"this process and {t['copy_gbps']:.1f} GB/s in torch's ({100 * apart:.0f}% "
                f"apart > {100 * UNRELIABLE_SPREAD:.0f}%); times: {r['ms']:.3f} ms against "
                f"torch's {t['ms']:.3f} ms")
            continue
        r["vs_torch"] = r["of_copy"] / t["of_copy"]


def _flag_slowed(rounds: list[list[dict]]) -> None:
    """Mark unreliable the rows of one measurement (its `rounds` of turns) whose copy ran
    at less than SLOWED_COPY of the fastest copy of the same bytes any process measured
    in any of them, then compare each round with torch's afresh: a torch row so marked
    no longer gives a ratio. The fastest copy is the faster of a row's before and after,
    over every row that has them, reliable or not (a copy that ran fast is evidence of
    what the machine does, whatever happened after)."""
    fastest = None
    for rows in rounds:
        for r in rows:
            if r.get("copy_before_gbps"):
                speed = max(r["copy_before_gbps"], r["copy_after_gbps"])
                if fastest is None or speed > fastest[0]:
                    fastest = (speed, r["backend"], r["round"])
    for rows in rounds:
        for r in rows:
            if fastest and r.get("reliable") and r["copy_gbps"] < SLOWED_COPY * fastest[0]:
                speed, who, round_ = fastest
                r.update(reliable=False, of_copy=None, error=(
                    f"{SLOWED}: the copy of the same bytes ran at {r['copy_gbps']:.2f} GB/s in "
                    f"it, under {SLOWED_COPY:g} of the {speed:.2f} GB/s {who}'s process "
                    f"measured (round {round_})"))
            r.update(vs_torch=None, vs_torch_note="")
        compare_to_torch(rows)


def _rank(r: dict) -> int:
    """How much a row of one measurement says, once compared with torch's of its round:
    3 a reliable number with its ratio to torch (or no torch row to compare with), 2 a
    reliable number without (`vs_torch_note` says why), 1 a time, unreliable; 0 none."""
    if r.get("reliable") and r.get("of_copy"):
        return 2 if r.get("vs_torch_note") else 3
    return 1 if r.get("ms") is not None else 0


def _kept(rounds: list[list[dict]]) -> list[dict]:
    """The rows of one measurement taken in `rounds` of turns (each round's compared with
    torch's of that round) that the results keep: one round's, so that every ratio is
    between rows shown side by side; the round with the most rows that have a time, then
    the one whose rows say most (the sum of _rank), the earliest of equals. So a round in
    which a process stopped or a copy moved does not replace one that measured more."""
    return max(rounds, key=lambda rows: (sum(r.get("ms") is not None for r in rows),
                                         sum(_rank(r) for r in rows)))


def _worth_again(rows: list[dict], running: set[str]) -> str:
    """Why another round may give `rows` (the kept round of a measurement) what they
    lack: a number, for a row of a backend still running that was slowed throughout
    (_flag_slowed); a ratio, for a reliable row without one of a backend still running.
    "" when there is none, and also when a stopped backend has a time in `rows` (a later
    round could only be kept by trading that time away for others', which the bench does
    not do); and for ratios, when torch has stopped or its prepared row has no time (no
    ratio without it, and its failures, unsupported or no prepare_benchmark, repeat)."""
    if any(r.get("ms") is not None and r["backend"] not in running for r in rows):
        return ""
    for r in rows:
        if r["error"].startswith(SLOWED) and r["backend"] in running:
            return f"{r['backend']} {r['variant']} (round {r['round']}): {r['error']}"
    if "torch" not in running or any(
            r.get("ms") is None for r in rows
            if r["backend"] == "torch" and r["variant"] == "prepared"):
        return ""
    for r in rows:
        if _rank(r) == 2 and r["backend"] in running:
            return f"{r['backend']} {r['variant']} (round {r['round']}): {r['vs_torch_note']}"
    return ""


def _key(r: dict, pass_field: str = "pass") -> tuple:
    """What one measurement is, variants aside (plan items spell the pass `pass_`)."""
    return (r["series"], r["op"], r["dtype"], tuple(r["shape"]), r[pass_field])


def _groups(items: list[dict]) -> list[list[dict]]:
    """The plan in groups of one measurement each (its variants together), in order."""
    groups: dict[tuple, list[dict]] = {}
    for item in items:
        groups.setdefault(_key(item, "pass_"), []).append(item)
    return list(groups.values())


def _not_measured(name: str, items: list[dict], why: str) -> list[dict]:
    """A record for each of `items` that `name` did not measure, saying `why`."""
    return [dict(_record(name, item), pid=None, error=why) for item in items]


#: Seconds between one process's turn and the next's: threads of the last that still
#: spin (OpenMP's wait before it sleeps) have stopped before the next one's copy is timed.
TURN_PAUSE_S = 0.05
#: Rounds of turns one measurement gets until every backend's reliable row has a ratio
#: to torch's of the same round (see _kept for the round the results keep).
ROUNDS = 3


def run_bench(backends=None, *, quick=False, curve=True, repeat=10, progress=print,
              timeout: float = 3600.0, items: list[dict] | None = None) -> dict:
    """Each backend in its own process, over the same plan (`items`, default
    `plan(quick, curve)`). The processes take turns, one measurement (both variants) at a
    time, the first to go alternating, so each backend's figures for a measurement are
    taken seconds apart from the others': timed one whole backend after the other, the
    two processes often sat in different states of the machine (copies of the same bytes
    at 36 against 57 GB/s), and no ratio between them could be given. A process waits,
    idle, while another measures. `timeout` is per turn. One that stops (dies, times
    out) has the rest of its measurements recorded as not measured, with the reason, and
    so has a backend that could not be loaded. A measurement is taken in up to ROUNDS
    rounds of turns (see the module doc), each compared with torch's of its round."""
    from normspec.impls import registry

    from .runner import BackendNotUsable
    from .worker import Worker

    doc = results.new_document()
    doc["runs"].append(run_info(0, platform.node() or "local"))
    label = doc["runs"][0]["run"]
    items = items if items is not None else plan(quick, curve)
    rows: list[dict] = []
    workers: list[tuple[str, Worker]] = []
    unavailable: dict[str, str] = {}

    def keep(rec: dict) -> None:
        rows.append(rec)
        progress(_line(rec))
    finished = 0  # rows of the measurements whose every round is done
    explicit = bool(backends)
    try:
        # a backend asked for twice is timed once (as a run checks it once)
        for name in list(dict.fromkeys(backends)) if explicit else registry.default_backends():
            worker = Worker(name, label, timing=True)
            worker.start()
            loaded = worker.wait_loaded(120.0)
            called = worker.entry.get("name", name) if loaded else name
            if loaded and called in (n for n, _ in workers):
                worker.stop()
                raise BackendNotUsable(f"two backends asked for call themselves {called!r}; "
                                       "rows could not be told apart (give one another name)")
            if loaded:
                workers.append((called, worker))
                continue
            worker.stop()
            if explicit:  # asked for by name: refused before anything is timed, as run does
                raise BackendNotUsable(f"backend {name!r} could not be used: {worker.error}")
            unavailable[name] = f"not measured: unavailable: {worker.error}"
            progress(f"{name}: {unavailable[name]}")
        stopped: dict[int, str] = {}
        for i, group in enumerate(_groups(items)):
            finished = len(rows)
            rounds: list[list[dict]] = []
            for round_ in range(1, ROUNDS + 1):
                start = len(rows)
                turns = list(enumerate(workers))
                for w, (name, worker) in (turns if (i + round_) % 2 else turns[::-1]):
                    if w in stopped:
                        rows.extend(_not_measured(name, group, stopped[w]))
                        continue
                    time.sleep(TURN_PAUSE_S)
                    got = len(rows)
                    out = worker.run_job(("bench", group, repeat), timeout=timeout,
                                         on_record=keep)
                    for r in rows[got:]:
                        r["round"] = round_
                    if out.how != "done":
                        why = (f"timed out after {timeout:g} s" if out.how == "timeout"
                               else out.detail)
                        stopped[w] = f"not measured: {name}'s bench process stopped ({why})"
                        progress(f"{name}: {stopped[w]}")
                        rows.extend(_not_measured(name, group[len(rows) - got:], stopped[w]))
                rounds.append(rows[start:])
                del rows[start:]
                _flag_slowed(rounds)
                running = {name for w, (name, _) in enumerate(workers) if w not in stopped}
                why = _worth_again(_kept(rounds), running)
                if not why or round_ == ROUNDS:
                    break
                progress(f"measured again (round {round_ + 1} of at most {ROUNDS}): {why}")
            rows.extend(_kept(rounds))
            for name, why in unavailable.items():
                rows.extend(_not_measured(name, group, why))
    except KeyboardInterrupt:
        # Ctrl-C: the measurements finished so far are the results (the one in progress,
        # not yet compared across its rounds, is dropped), and the run says it stopped
        doc["runs"][0].update(complete=False, stopped_by="SIGINT")
        del rows[finished:]
    finally:
        for _, worker in workers:
            worker.stop()
    for r in rows:
        r["run"] = label
    doc["benchmarks"] = rows
    return doc


def _line(r: dict) -> str:
    head = (f"{r['backend']:>7} {r['variant']:<8} {r['op']:<10} {r['pass']:<16} "
            f"{r['dtype']:<8} {str(r['shape']):<14}")
    if not r.get("reliable"):
        return f"{head} {r['error']}"
    return (f"{head} {r['ms']:9.3f} ms {r['gbps']:7.2f} GB/s  copy {r['copy_gbps']:6.2f} GB/s "
            f"({100 * r['of_copy']:5.1f}% of copy)")


def summary(rows: list[dict]) -> str:
    """The table as the issue reads it: one line per measurement and backend/variant,
    % of copy and x torch, or why there is no number."""
    lines = [f"{'series':<12} {'shape':<14} {'dtype':<8} {'op':<10} {'pass':<16} "
             f"{'backend':<16} {'% of copy':>9} {'x torch':>8}"]
    order = {k: i for i, k in enumerate(dict.fromkeys(_key(r) for r in rows))}
    for r in sorted(rows, key=lambda r: (order[_key(r)], r["backend"], r["variant"])):
        who = f"{r['backend']} {r['variant']}"
        if r.get("reliable"):
            vs = f"{r['vs_torch']:.2f}x" if r.get("vs_torch") else "-"
            nums = f"{100 * r['of_copy']:8.0f}% {vs:>8}"
            if r.get("vs_torch_note"):
                nums += f"  {r['vs_torch_note']}"
        else:
            nums = f"{'-':>9} {'-':>8}  {r['error'][:60]}"
        lines.append(f"{r['series']:<12} {str(r['shape']):<14} {r['dtype']:<8} {r['op']:<10} "
                     f"{r['pass']:<16} {who:<16} {nums}")
    lines.append("% of copy: against the copy of the same bytes in the row's own process; "
                 "x torch: its % of copy over torch's prepared call's, of the same round")
    return "\n".join(lines)


def main(args) -> int:
    """`normspec bench`; a backend asked for that cannot be used raises
    runner.BackendNotUsable before anything is timed (the command refuses it)."""
    doc = run_bench(args.backend, quick=args.quick, curve=not args.no_curve)
    path = results.write(doc, args.json)
    stopped = doc["runs"][0].get("stopped_by")
    try:
        print("\n" + summary(doc["benchmarks"]))
        print(f"\nbenchmarks: {path}  (pass it to `normspec report` to plot them)"
              + (f"; stopped by {stopped}: partial" if stopped else ""))
    except OSError:  # stdout gone: the file is written
        pass
    return 130 if stopped else 0
