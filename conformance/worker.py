"""A backend in a process of its own, so that nothing it does can take the run down.

The run's process never imports a framework: each backend is loaded in a spawned child
that runs one (check, dtype) unit at a time and sends every record back as soon as its
case finishes. The parent enforces the timeout: a unit that overruns, or a child that
dies (a segfault, an abort, an out-of-memory kill), costs that unit alone, with the
records its finished cases already sent; the child is killed outright, so no thread of a
hung backend lingers to print at exit or hold the process open, and a new child is
started for the next unit. A child also dies with its parent (PR_SET_PDEATHSIG on
Linux, and EOF on its pipe everywhere), so a killed run leaves no orphans working on.
Children ignore SIGINT: on Ctrl-C the parent decides, and kills them.

`normspec bench` uses the same children for its timings (a "bench" job instead of a
unit), so each backend is timed in a process of its own, with nothing else loaded.
"""

from __future__ import annotations

import io
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

from .results import Record

LOAD_TIMEOUT_MIN_S = 120.0  # a framework import on a busy 2-core machine can take a while
#: The longest message a child may send (a record with its repro is a few KB).
MAX_MESSAGE_BYTES = 1 << 28


class Garbled(Exception):
    """A child's message that is not one: the backend wrote to the harness's pipe, or a
    process it forked is answering beside the worker."""


def _send(conn, *msg) -> None:
    """Child -> parent: the message as JSON (with the sender's pid), never a pickle: the
    parent unpickling what the backend put in a record or a deviation entry would run
    the backend's code in the run's own process (found by a review: a `str` subclass
    whose __reduce__ called os._exit ended the run, with no results file), and a stray
    or forged write would raise anything at all there."""
    conn.send_bytes(json.dumps([os.getpid(), *msg]).encode())


def _plain(value, what: str):
    """`value` as plain JSON data (str subclasses and enums become their text, tuples
    lists); TypeError naming `what` when it holds anything else."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not plain data (str, numbers, lists, dicts): {exc}") from None


def _receive(conn, pid: int | None) -> list:
    """The next message of the child `pid`, checked: a list [pid, kind, ...]."""
    raw = conn.recv_bytes(MAX_MESSAGE_BYTES)
    try:
        msg = json.loads(raw)
    except Exception:  # noqa: BLE001 - not JSON, or JSON too deep to decode (RecursionError)
        raise Garbled(f"the harness's pipe carried {raw[:40]!r}, not a message (did the "
                      "backend write to it?)") from None
    if not (isinstance(msg, list) and len(msg) >= 2 and isinstance(msg[1], str)):
        raise Garbled(f"the harness's pipe carried {str(msg)[:80]!r}, not a message")
    if msg[0] != pid:
        raise Garbled(f"process {msg[0]} wrote to the harness's pipe beside the backend's "
                      f"worker {pid} (did the backend fork a process that returned into "
                      "the harness?)")
    return msg[1:]


@dataclass
class Outcome:
    """How a unit ended: "done", "timeout" or "died" (with the reason), and how many
    records arrived before that."""

    how: str
    received: int
    detail: str = ""
    compile_s: float | None = None  # the backend's compile time in the unit, if it says


def hypothesis_home() -> str:
    """Where Hypothesis keeps its files during a run: a per-user cache, not the current
    folder (HYPOTHESIS_STORAGE_DIRECTORY, when set, wins)."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        return os.environ["HYPOTHESIS_STORAGE_DIRECTORY"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "normspec", "hypothesis")


def _kill_group(pid: int) -> None:
    """SIGKILL to the process group a worker child leads (see _child_main)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass  # gone already, or the child could not make its group (then pid is not one)


#: The environment variable that marks a worker child's processes: the child is spawned
#: with it (Worker.start), so every process it starts inherits it, and one that leaves
#: its process group (setsid: a daemon) still carries it in the environment it began
#: with (/proc/<pid>/environ), where _kill_tagged finds it. A process that the backend
#: starts with an environment of its own making does not carry it.
TAG = "NORMSPEC_WORKER_TAG"
#: Held while the run's environment holds a child's tag (the spawn inherits it).
_SPAWN_LOCK = threading.Lock()


def _tagged(tag: str) -> list[int]:
    """The processes (Linux: /proc) that began with TAG=tag in their environment."""
    entry = f"{TAG}={tag}".encode()
    found: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found  # not Linux: the process group is all there is
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue  # gone meanwhile, or another user's
    return found


def _kill_tagged(tag: str) -> None:
    """SIGKILL to every process that carries a worker's tag (those that left its process
    group), until none is left: one may fork while the others are being killed."""
    if not tag:
        return
    for _ in range(10):
        pids = [p for p in _tagged(tag) if p != os.getpid()]
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the pipe's EOF still ends the child
        pass


#: glibc's mallopt parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Blocks up to this size come from the heap, not from mappings of their own: the
#: largest M_MMAP_THRESHOLD that mallopt(3) documents for 64-bit glibc (older glibc
#: refuses more).
HEAP_BLOCK_MAX = 32 << 20
#: Free memory at the heap's top that glibc keeps instead of returning it.
KEPT_TOP_BYTES = 1 << 30


def _keep_freed_memory() -> bool:
    """Have glibc's malloc serve blocks up to HEAP_BLOCK_MAX from its heap and keep the
    memory the process frees there: every check makes temporaries as large as the
    compared arrays (the oracle, the scales, ulp() and the comparison, a dozen of 4 MB at
    131072 x 4), and by default each is a new mapping whose every page faults on first
    touch (~1.5 us a page in this VM: ulp() of 131072 x 4 took 7 ms, 1.0 ms with the
    pages kept; a backend's in-process run of every check 10-30% sooner). The cost: a
    process's resident memory stays at its heap's high point (measured: a full run's
    processes peaked at 2.2 GB in all, as without it). Where memory comes from, not what
    is computed: no record of a full run changed. Whether it took effect: False where
    mallopt is missing (not glibc) or refuses the threshold, and then the trim threshold
    is left alone too (setting it alone would freeze glibc's adaptive mmap threshold at
    128 KB, every 4 MB temporary a fresh mapping)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_MAX)
                    and libc.mallopt(_M_TRIM_THRESHOLD, KEPT_TOP_BYTES))
    except Exception:  # noqa: BLE001 - no libc with mallopt: the default allocator
        return False


#: set in each backend process before its framework loads, unless the user set them:
#: OpenMP worker threads (torch, numba, oneDNN) otherwise spin after every parallel
#: region, and with two backend processes on two cores each spins on the core the other
#: needs (measured here: torch's and numba's BatchNorm matrix and B9 checks, 137 s wall
#: spinning, 17 s passive). Waiting passively changes no result, only who holds a core.
#: `normspec bench` does not set them (Worker(timing=True)): a benchmark times the
#: runtime as users run it, one backend process at a time.
CHILD_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class _DroppingWriter(io.RawIOBase):
    """A file descriptor written to until a write to it fails (its reader is gone:
    EPIPE; or it was never open: EBADF); from then on what is written is dropped, and
    the writer still says it wrote it. A backend's print is never a finding."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self.dropping = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while len(view) and not self.dropping:
            try:
                view = view[os.write(self._fd, view):]
            except OSError:
                self.dropping = True
        return size


def _backend_output_to_stderr() -> None:
    """Send everything the child prints to the run's stderr, and drop it once stderr
    cannot take it: the child reports on its own pipe, never on stdout, and stdout is
    the user's (`normspec run | head -1`): a backend that printed inside an op, into a
    pipe its reader had closed, had every record of its checks an error "raised
    BrokenPipeError" (all 24 records of F2.values, `| head -1`). File descriptor 1 becomes a copy of 2,
    so a C library's printf goes there too (a write into a closed pipe fails quietly:
    Python ignores SIGPIPE); sys.stdout and sys.stderr become one stream on fd 2 that
    drops what it cannot write, so that a stderr closed as well (`2>&1 | head -1`)
    costs nothing either. Called before the backend is imported."""
    try:
        os.dup2(2, 1)
    except OSError:  # no stderr at all: what is written to fd 1 goes nowhere
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.close(null)
        except OSError:
            pass
    encoding = getattr(sys.__stderr__, "encoding", None) or "utf-8"
    stream = io.TextIOWrapper(io.BufferedWriter(_DroppingWriter(2)), encoding=encoding,
                              errors="backslashreplace", line_buffering=True)
    sys.stdout = sys.stderr = stream


def _child_main(conn, requested: str, label: str, timing: bool = False) -> None:
    _backend_output_to_stderr()
    try:
        # a process group of its own, which the parent kills whole (Worker.kill): a
        # process the backend forks would otherwise outlive the run (PR_SET_PDEATHSIG is
        # not inherited across fork; found by a review)
        os.setpgid(0, 0)
    except OSError:
        pass
    if not timing:
        for key, value in CHILD_ENV.items():
            os.environ.setdefault(key, value)
        _keep_freed_memory()
    # the parent starts this process as a daemon (so that it never waits for it at
    # exit), which multiprocessing takes to forbid it processes of its own: a backend
    # that runs a process pool was an error (found by a review). Its processes die with
    # it: Worker.kill kills its process group.
    multiprocessing.current_process().daemon = False
    # the parent stops the run (a Ctrl-C or a SIGTERM reaches the whole process group)
    # and kills this process itself: a signal meant for the run would otherwise end the
    # backend mid-check and be recorded as its death (found by a review). Blocked since
    # the spawn (Worker.start), so one that came during the start-up is dropped here.
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    _die_with_parent()
    from normspec.conformance import context

    context.BACKEND_INTERRUPTS_ARE_FINDINGS = True
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(hypothesis_home())
    from normspec.impls import registry

    from . import deviations
    from .checks import all_checks
    from .unit import backend_entry, run_check

    try:
        loaded = registry.load(requested)
    except registry.UnknownBackend as exc:
        loaded = registry.LoadedBackend(requested, requested, error=str(exc))
    bad = [f"deviation entry {i}: {p}" for i, d in enumerate(loaded.deviations)
           for p in deviations.problems(d)]
    if bad:
        loaded = registry.LoadedBackend(loaded.name, loaded.source, error="; ".join(bad))
    try:
        said = (_plain(backend_entry(loaded, label), "its name, version, capabilities or "
                       "conventions"), _plain(list(loaded.deviations), "a deviation entry"))
    except TypeError as exc:
        loaded = registry.LoadedBackend(str(loaded.name), str(loaded.source), error=str(exc))
        said = (_plain(backend_entry(loaded, label), "the entry"), [])
    _send(conn, "loaded", *said)
    if not loaded.available:
        return
    checks = {c.id: c for c in all_checks()}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        kind, job = msg[0], msg[1]

        def emit(rec, job=job):
            """A record of this job (a bench's is a dict, a check's a Record)."""
            _send(conn, "record", job, rec if isinstance(rec, dict) else rec.to_json())
        if kind == "bench":
            from .bench import measure

            n = measure(loaded, msg[2], repeat=msg[3], emit=emit)
            _send(conn, "done", job, n, None)
            continue
        check_id, dtype, seed, examples, shrink = msg[2:]
        before = _compile_seconds(loaded.backend)
        records = run_check(loaded, checks[check_id], dtype, seed=seed, examples=examples,
                            timeout=None, shrink=shrink, emit=emit)
        after = _compile_seconds(loaded.backend)
        spent = None if before is None or after is None else max(after - before, 0.0)
        _send(conn, "done", job, len(records), spent)


def _compile_seconds(backend) -> float | None:
    """The backend's compile_seconds(), None where it has none, it fails, or it is not a
    finite number of seconds (a NaN printed "nan s" in the time table: a red team)."""
    try:
        value = backend.compile_seconds()
        value = None if value is None else float(value)
    except Exception:  # noqa: BLE001 - a third party's broken optional method
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _signal_name(exitcode: int | None) -> str:
    if exitcode is None:
        return "it stopped answering"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class Worker:
    """The parent's handle on one backend's child process."""

    def __init__(self, requested: str, label: str, *, timing: bool = False):
        """`timing`: a benchmark's process, its OpenMP wait policy and its allocator left
        as users have them (a conformance worker sets CHILD_ENV and _keep_freed_memory)."""
        self.requested, self.label, self.timing = requested, label, timing
        self.proc: Any = None
        self.conn: Any = None
        self._group_killed = False  # (see kill)
        #: the mark of this worker's processes (see TAG); a new one at each start
        self.tag = ""
        self.entry: dict = {}
        self.deviations: list = []
        self.error: str | None = None
        #: the backend's compile seconds in the last unit executed (None: not known)
        self.last_compile_s: float | None = None
        #: kill() runs in two threads at once when a run is stopped (the stopping main
        #: thread, and the slot thread that was driving this worker)
        self._kill_lock = threading.Lock()
        #: set by close(): no process is started any more
        self.closed = False
        #: jobs sent so far (each job's number, see run_job)
        self._jobs = 0
        #: the last unit execute() ran, "<check> <dtype>", and how it ended (an Outcome's
        #: `how`): what a record says when the process is found gone
        self.last_unit: tuple[str, str] = ("", "")
        #: set when a process started again (after the last one was lost) did not load:
        #: the message of the error record every later unit gets at once, without another
        #: start (see execute)
        self.given_up = ""

    # ------------------------------------------------------------ lifecycle
    def start(self) -> bool:
        """Spawn the child; `wait_loaded` collects its answer. False (nothing started)
        once the worker is closed: a stopped run starts no process again."""
        with self._kill_lock:
            if self.closed:
                self.error = "the run was stopped"
                return False
            ctx = multiprocessing.get_context("spawn")
            # started now if at all, before the mask below: starting its own process it
            # unblocks SIGINT and SIGTERM, which let the first worker start unmasked (a
            # Ctrl-C then printed that worker's traceback; found by a review)
            resource_tracker.ensure_running()
            parent, child = ctx.Pipe()
            self.proc = ctx.Process(target=_child_main,
                                    args=(child, self.requested, self.label, self.timing),
                                    name=f"normspec-{self.requested}", daemon=True)
            self.tag = uuid.uuid4().hex
            # the child starts with the stop signals blocked (the mask survives the spawn)
            # until it ignores them: a Ctrl-C during its start-up printed its traceback
            mask = (signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
                    if hasattr(signal, "pthread_sigmask") else None)
            try:
                with _SPAWN_LOCK:
                    before = os.environ.get(TAG)
                    os.environ[TAG] = self.tag  # the spawn's environment (see TAG)
                    try:
                        self.proc.start()
                    finally:
                        if before is None:
                            del os.environ[TAG]
                        else:
                            os.environ[TAG] = before
            finally:
                if mask is not None:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            child.close()
            self.conn, self._group_killed = parent, False
        return True

    def wait_loaded(self, timeout: float, interrupt=None) -> bool:
        """True when the backend loaded and is available; else `error` says why.
        `interrupt()` is called between the short waits (the run's checkpoint: it raises
        to stop the run)."""
        timeout = max(timeout, LOAD_TIMEOUT_MIN_S)
        deadline = time.monotonic() + timeout
        msg, garbled = None, ""
        try:
            # in short waits: a child that dies before it takes its end of the pipe (in
            # multiprocessing's start-up, e.g. a main script it cannot find) never closes
            # it, so only its exit tells
            while (remaining := deadline - time.monotonic()) > 0:
                if interrupt is not None:
                    interrupt()
                if self.conn.poll(min(remaining, 0.5)):
                    msg = _receive(self.conn, self.proc.pid)
                    break
                if not self.proc.is_alive():
                    msg = _receive(self.conn, self.proc.pid) if self.conn.poll(0) else None
                    break
        except (EOFError, OSError, AttributeError):  # (AttributeError: killed meanwhile)
            msg = None
        except Garbled as exc:
            msg, garbled = None, str(exc)
        if msg is not None and (msg[0] != "loaded" or len(msg) != 3
                                or not isinstance(msg[1], dict) or not isinstance(msg[2], list)):
            msg, garbled = None, f"its process answered {str(msg)[:80]!r}, not what it loaded"
        if msg is None:
            # the pipe closed or the process ended before the deadline: it died
            why = (garbled or (f"loading it took longer than {timeout:g} s"
                               if time.monotonic() >= deadline
                               else f"its process died while loading it ({self._exit()})"))
            self.kill()
            self.error = why
            if not self.entry:
                from normspec.impls.registry import LoadedBackend

                from .unit import backend_entry

                self.entry = backend_entry(LoadedBackend(self.requested, self.requested,
                                                         error=why), self.label)
            return False
        _, self.entry, self.deviations = msg
        self.error = self.entry.get("error")
        if not self.entry.get("available"):
            self.kill()
            return False
        return True

    def restart(self, timeout: float) -> bool:
        self.kill()
        return self.start() and self.wait_loaded(timeout)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def _exit(self) -> str:
        proc = self.proc
        if proc is None:
            return "never started"
        proc.join(2.0)
        return _signal_name(proc.exitcode)

    def kill(self) -> None:
        """Kill the child and close the pipe, once, from any thread: the pipe is taken
        under a lock before it is closed. (Two threads closing one Connection both
        passed its `is not None` test, and the second closed a file descriptor already
        closed: EBADF, which ended a stopped run with a traceback and exit code 1
        instead of its partial results, 2 runs in 12 on this loaded 2-core machine; it
        could as well have closed a descriptor reused meanwhile.)"""
        with self._kill_lock:
            proc, conn, self.conn = self.proc, self.conn, None
            if proc is not None and proc.pid is not None:
                if not self._group_killed:
                    # the child and whatever it forked; once per process, at the first
                    # kill, while its id is still its group's (never again later, when
                    # the reaped id may name another process group); then what left
                    # the group, by its tag
                    self._group_killed = True
                    _kill_group(proc.pid)
                    _kill_tagged(self.tag)
                if proc.is_alive():
                    proc.kill()
                proc.join(5.0)
            if conn is not None:
                conn.close()

    def close(self) -> None:
        """Kill the child, and start none again (the run is being stopped)."""
        with self._kill_lock:
            self.closed = True
        self.kill()

    def stop(self) -> None:
        """Ask the child to finish; kill it if it does not."""
        conn = self.conn
        if conn is not None and self.alive:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
            # polled, not joined: join waits on a pipe a forked grandchild holds open too
            deadline = time.monotonic() + 5.0
            while self.proc.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
        self.kill()

    # ------------------------------------------------------------ units
    def run_unit(self, check_id: str, dtype: str, *, seed: int, examples: int, shrink: bool,
                 timeout: float, on_record) -> Outcome:
        """Run one unit; `on_record(dict)` is called for each record as it arrives."""
        return self.run_job(("unit", check_id, dtype, seed, examples, shrink),
                            timeout=timeout, on_record=on_record)

    def run_job(self, message: tuple, *, timeout: float, on_record) -> Outcome:
        """Send one job (a unit, or a bench plan: its kind, then what it needs) and
        collect its records until the child says it is done, the timeout passes or the
        child dies. Every job has a number of its own, which its records and its "done"
        carry; the child must send at least one record for a unit, and as many as its
        "done" says. Anything else (a message from another process, one that is not a
        message, a count that does not add up) ends the job as "broke": the child is
        killed, and its records so far are kept."""
        received = 0
        self._jobs += 1
        job = self._jobs
        try:
            self.conn.send((message[0], job, *message[1:]))
        except (OSError, ValueError, AttributeError):
            return Outcome("died", 0, f"its process was gone ({self._exit()})")
        deadline = time.monotonic() + timeout

        def broke(why: str) -> Outcome:
            self.kill()
            return Outcome("broke", received, f"the backend's process broke the harness's "
                                              f"protocol: {why}")
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                return Outcome("timeout", received)
            try:
                if not self.conn.poll(min(remaining, 0.5)):
                    # a dead child whose pipe a process it forked holds open never
                    # closes it: only its exit tells (found by a review: a crash waited
                    # out the whole timeout and was recorded as a hang)
                    if not self.proc.is_alive() and not self.conn.poll(0):
                        return Outcome("died", received, f"its process died ({self._exit()})")
                    continue
                msg = _receive(self.conn, self.proc.pid)
            except (EOFError, OSError, AttributeError) as exc:
                if self.proc is not None:
                    self.proc.join(2.0)  # (a dying process closes its pipe, then exits)
                if self.proc is not None and self.proc.is_alive():
                    # the pipe failed under a live child (a length header past
                    # MAX_MESSAGE_BYTES closes it): that child answers no more, and
                    # the next unit must start a fresh one (found by a review)
                    return broke(f"its pipe failed ({type(exc).__name__}: {exc})")
                return Outcome("died", received, f"its process died ({self._exit()})")
            except Garbled as exc:
                return broke(str(exc))
            kind, rest = msg[0], msg[1:]
            if not rest or rest[0] != job:
                return broke(f"a {kind!r} message of job {rest[0] if rest else None!r} came "
                             f"during job {job}")
            if kind == "record" and len(rest) == 2 and isinstance(rest[1], dict):
                received += 1
                on_record(rest[1])
            elif kind == "done" and len(rest) == 3:
                said = rest[1]
                if said != received:
                    return broke(f"it said {said!r} records and sent {received}")
                if received == 0 and message[0] == "unit":
                    return broke("it ended the unit with no record")
                spent = rest[2] if isinstance(rest[2], (int, float)) else None
                return Outcome("done", received, compile_s=spent)
            else:
                return broke(f"a message {str(msg)[:80]!r} it does not send")

    def execute(self, check_id: str, dtype: str, *, seed: int, examples: int, shrink: bool,
                timeout: float, on_record=None, stopping=None) -> list[dict]:
        """One unit's records, whatever the backend does: a process that is gone is
        started again first; a timeout or a death becomes an error record that says how
        many cases had finished (their records are kept). Once a process started again
        fails to load (it dies, or hangs past the load timeout), no process is started
        again: this unit and every later one get an error record at once saying where
        the process was lost and why the new one did not load (`given_up`). A backend
        whose second load hung had each of its units wait the load timeout, 120 s: 6 min
        for the 4 units of one check, about 10 hours for a full run."""
        records: list[dict] = []

        def keep(rec: dict) -> None:
            records.append(rec)
            if on_record is not None:
                on_record(rec)

        name = self.entry.get("name", self.requested)
        base = dict(backend=name, check=check_id, claim=check_id.split(".")[0], op="-",
                    dtype=dtype, seed=seed)
        t0 = time.perf_counter()
        if stopping is not None and stopping.is_set():
            return records  # (a process the stop killed is not started again)
        if self.given_up:
            keep(Record(**base, case="not run", status="error", message=self.given_up).to_json())
            return records
        if not self.alive and not self.restart(timeout):
            if not (stopping is not None and stopping.is_set()):
                lost = self._lost()
                self.given_up = (f"the backend's process {lost} and could not be started "
                                 f"again ({self.error}): this check was not run")
                keep(Record(**base, case="restart", status="error",
                            message=f"the backend could not be started again after its "
                            f"process {lost}: {self.error}; its later checks are not run"
                            ).to_json())
            return records
        self.last_compile_s = None
        out = self.run_unit(check_id, dtype, seed=seed, examples=examples, shrink=shrink,
                            timeout=timeout, on_record=keep)
        self.last_unit = (f"{check_id} {dtype}", out.how)
        self.last_compile_s = out.compile_s
        if out.how != "done" and not (stopping is not None and stopping.is_set()):
            # (a process the run itself killed on Ctrl-C is not the backend's failure)
            why = (f"timed out after {timeout:g} s (the backend hung or is too slow); its "
                   "process was stopped" if out.how == "timeout" else out.detail)
            keep(Record(**base, case=out.how, status="error",
                        duration_s=round(time.perf_counter() - t0, 3),
                        message=f"{why}; {out.received} case(s) had finished").to_json())
        return records

    def _lost(self) -> str:
        """Where the process that is gone was lost, in words: "died in F2.values
        float32", "was stopped in ... (it timed out)", "died after ..." (it finished
        that unit)."""
        unit, how = self.last_unit
        if not unit:
            return "died before its first check"
        return {"done": f"died after {unit}", "timeout": f"was stopped in {unit} (it timed out)",
                "broke": f"was stopped in {unit} (it broke the harness's protocol)",
                }.get(how, f"died in {unit}")
