"""Processes for data-parallel adapters (DP): a group of replica processes that run a
framework's own collectives, started by the adapter and owned by it.

The harness already runs each backend in a process of its own (conformance/worker.py),
a daemon that multiprocessing forbids to have children, and a framework may need its
environment set before it starts (JAX's XLA_FLAGS device count); so the replicas are
plain subprocesses (`python -m normspec.impls._replica_child`), one per rank, each
loading a *replica module* that defines `replica_setup(rank, world, port)` and
`replica_run(state, job)`. Jobs and answers cross stdin/stdout as length-prefixed
pickles.

The group is started once and reused while every rank answers (a framework import and
a process-group rendezvous cost seconds); it is killed, and started afresh at the next
call, when a rank dies, when the ranks disagree (one raised and another did not: the
collectives are then out of step), or when a call overruns its timeout. A child also dies
with its parent (PR_SET_PDEATHSIG on Linux, EOF on stdin everywhere), so a killed
backend process leaves no replica behind.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time

HEADER = struct.Struct("!Q")
#: below the harness's default unit timeout (120 s), so a group that cannot start says
#: which replica and why before the unit's own timeout would stop the backend process
START_TIMEOUT_S = 100.0  # R framework imports at once on a busy 2-core machine
CALL_TIMEOUT_S = 60.0


class ReplicaError(Exception):
    """Every rank raised the same kind of exception (consistently: the group lives on).
    `kind` is the exception's type name, `message` its text."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class ReplicaFailure(RuntimeError):
    """The group could not answer: a rank died, hung or disagreed; it was killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


class ReplicaGroup:
    """`world` processes running `module` (a replica module, see the module docstring),
    with extra environment `env`."""

    def __init__(self, module: str, world: int, env: dict[str, str] | None = None):
        self.module, self.world, self.env = module, world, dict(env or {})
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []
        self.buffers: dict[int, bytes] = {}

    # ---------------------------------------------------------------- lifecycle
    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start every rank and wait until each has set up (raises ReplicaFailure)."""
        self.close()
        port = free_port()
        env = dict(os.environ, **self.env)
        for rank in range(self.world):
            log = tempfile.TemporaryFile()
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "normspec.impls._replica_child", self.module, str(rank),
                 str(self.world), str(port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env))
        self.buffers = {p.stdout.fileno(): b"" for p in self.procs}
        answers = self._collect(timeout, "starting")
        bad = [a for a in answers if a[0] != "ready"]
        if bad:
            self.close()
            raise ReplicaFailure(f"a replica could not start: {bad[0][1]}: {bad[0][2]}")

    def close(self) -> None:
        """Kill every rank and wait for it; nothing of the group is left running."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process in D state
                pass
            for stream in (p.stdin, p.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        for log in self.logs:
            log.close()
        self.procs, self.logs, self.buffers = [], [], {}

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit; the children die with us
            pass

    # ---------------------------------------------------------------- calls
    def run(self, jobs: list, timeout: float = CALL_TIMEOUT_S) -> list:
        """Send jobs[rank] to each rank; return their answers in rank order. Raises
        ReplicaError when every rank raised, ReplicaFailure (and kills the group) when
        a rank died, overran or disagreed with the others."""
        if not self.alive:
            self.start()
        try:
            for p, job in zip(self.procs, jobs, strict=True):
                _send(p.stdin, ("job", job))
        except (OSError, ValueError) as exc:
            self.close()
            raise ReplicaFailure(f"a replica was gone ({exc})") from None
        answers = self._collect(timeout, "running")
        errors = [a for a in answers if a[0] == "error"]
        if errors and len(errors) == len(answers):
            return self._raise(errors[0])
        if errors:
            self.close()
            kind, message = errors[0][1], errors[0][2]
            raise ReplicaFailure(f"replicas disagreed: {len(errors)} of {self.world} raised "
                                 f"{kind}: {message}")
        return [a[1] for a in answers]

    @staticmethod
    def _raise(error):
        raise ReplicaError(error[1], error[2])

    def _tail(self, rank: int) -> str:
        log = self.logs[rank]
        log.seek(0)
        text = log.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(text[-3:])[-600:]

    def _collect(self, timeout: float, doing: str) -> list:
        """One answer from every rank, or ReplicaFailure (the group is then killed)."""
        deadline = time.monotonic() + timeout
        answers: dict[int, tuple] = {}
        by_fd = {p.stdout.fileno(): rank for rank, p in enumerate(self.procs)}
        while len(answers) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = sorted(set(range(self.world)) - set(answers))
                self.close()
                raise ReplicaFailure(f"replica(s) {waiting} did not answer within {timeout:g} s "
                                     f"while {doing}; the group was killed")
            fds = [fd for fd, rank in by_fd.items() if rank not in answers]
            ready, _, _ = select.select(fds, [], [], min(remaining, 0.5))
            for fd in ready:
                rank = by_fd[fd]
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    code = self.procs[rank].wait()
                    tail = self._tail(rank)
                    self.close()
                    raise ReplicaFailure(f"replica {rank} died while {doing} (exit code {code})"
                                         + (f": {tail}" if tail else ""))
                self.buffers[fd] += chunk
                buf = self.buffers[fd]
                if len(buf) >= HEADER.size:
                    (n,) = HEADER.unpack(buf[:HEADER.size])
                    if len(buf) >= HEADER.size + n:
                        answers[rank] = pickle.loads(buf[HEADER.size:HEADER.size + n])
                        self.buffers[fd] = buf[HEADER.size + n:]
        return [answers[r] for r in range(self.world)]


def reraise(err: ReplicaError):
    """The replicas' exception in the adapter's process: the same built-in type with the
    same text (a framework's own type becomes RuntimeError naming it)."""
    import builtins

    kind = getattr(builtins, err.kind, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not NotImplementedError:
        raise kind(err.message) from None
    raise RuntimeError(f"{err.kind}: {err.message}") from None


def per_step(answers: list[dict], field: str, steps: int):
    """answers[rank][field][step] regrouped as [step][rank] (None if a rank has none)."""
    if any(a.get(field) is None for a in answers):
        return None
    return [[a[field][t] for a in answers] for t in range(steps)]


def data_parallel_result(answers: list[dict], steps: int):
    """A DataParallelResult from each rank's answer (a dict of per-step lists)."""
    from .protocol import DataParallelResult

    return DataParallelResult(*(per_step(answers, f, steps) for f in DataParallelResult._fields))
