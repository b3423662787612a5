"""Results are never lost or clobbered, and bad arguments are refused before any work.

Every test drives the `normspec` command as a user would, in a temporary folder of its
own, and looks at what is on disk afterwards."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from normspec.conformance import results
from test_report import Page, screenshot_pixels

TESTS = Path(__file__).resolve().parent
NONFINITE = ["InfOutput", "NanOutput", "InfGradient", "NanRunningStats"]


def normspec(cwd, *args, timeout=600, extra_env=None, **kw):
    env = dict(os.environ, PYTHONPATH=str(TESTS), HYPOTHESIS_STORAGE_DIRECTORY=str(cwd / ".hyp"),
               **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "normspec", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, **kw)


def start(cwd, *args):
    env = dict(os.environ, PYTHONPATH=str(TESTS), HYPOTHESIS_STORAGE_DIRECTORY=str(cwd / ".hyp"))
    return subprocess.Popen([sys.executable, "-m", "normspec", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def strict(path: Path):
    def reject(name):
        raise AssertionError(f"{path} holds the non-standard JSON constant {name}")
    return json.loads(path.read_text(encoding="utf-8"), parse_constant=reject)


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if ".hyp" not in p.parts)


# ------------------------------------------------------------------ non-finite values
@pytest.fixture(scope="module")
def nonfinite_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("nonfinite")
    proc = normspec(cwd, "run", *[a for b in NONFINITE for a in ("--backend", f"nonfinite_backends:{b}")],
                    "--check", "F2.values", "--check", "F3.values", "--check", "F2.grad",
                    "--check", "F4.running_stats", "--dtype", "float32", "--examples", "2")
    return cwd, proc


def test_a_run_with_inf_and_nan_completes_and_fails(nonfinite_run):
    cwd, proc = nonfinite_run
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "results: results/" in proc.stdout and "report:  reports/" in proc.stdout


def test_non_finite_values_are_strict_json_and_read_back_as_numbers(nonfinite_run):
    cwd, _ = nonfinite_run
    (path,) = (cwd / "results").glob("*.json")
    raw = strict(path)
    got = {r["backend"]: r["worst"].get("got") for r in raw["records"] if r["status"] == "fail"}
    assert got == {"InfOutput": "inf", "NanOutput": "nan", "InfGradient": "-inf",
                   "NanRunningStats": "nan"}
    fails = [r for r in results.read(path)["records"] if r["status"] == "fail"]
    assert fails and all(isinstance(r["max_ulp"], float) and math.isinf(r["max_ulp"])
                         for r in fails)
    assert not list((cwd / "results").glob("*.jsonl"))  # the finished run's stream is folded in


def test_the_report_shows_the_values_and_renders(nonfinite_run, tmp_path):
    cwd, _ = nonfinite_run
    (report,) = (cwd / "reports").glob("*.html")
    page = Page()
    page.feed(report.read_text(encoding="utf-8"))
    text = " ".join(page.text)
    for value in ("got inf", "got nan", "got -inf"):
        assert value in text
    assert "error inf ULPs" in text
    pixels = screenshot_pixels(report, tmp_path)
    assert pixels.std() > 10


def test_encode_never_fails_and_round_trips():
    import numpy as np

    rec = results.Record(backend="b", check="c", claim="F2", op="layer_norm", dtype="float32",
                         case="x", status="fail", max_ulp=math.inf, bound_ulp=np.float32(3.5),
                         max_abs=math.nan, max_rel=-math.inf,
                         worst={"ulp": np.float64(np.inf), "got": "nan", "index": np.int64(2),
                                "odd": object()})
    text = results.dumps(rec.to_json())
    back = results.decode_record(json.loads(text))
    assert back["max_ulp"] == math.inf and back["max_rel"] == -math.inf
    assert math.isnan(back["max_abs"]) and back["bound_ulp"] == 3.5
    assert back["worst"]["ulp"] == math.inf and back["worst"]["index"] == 2
    assert back["worst"]["got"] == "nan"  # a printed value stays text


# ------------------------------------------------------------------ nothing lost
def _wait_for_records(cwd: Path, proc, at_least: int, limit_s: float = 180.0) -> Path:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        streams = list((cwd / "results").glob("*.jsonl"))
        if streams and streams[0].read_text().count('"record"') >= at_least:
            return streams[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError("the run wrote no records in time")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signalled_run_keeps_its_records_and_reports_them_incomplete(tmp_path, sig):
    proc = start(tmp_path, "run", "--backend", "nonfinite_backends:Slow", "--check", "F2",
                 "--check", "F3", "--label", "slow")
    _wait_for_records(tmp_path, proc, 3)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15, "stopping took too long"
    assert proc.returncode == 128 + sig.value, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"stopped by {sig.name}" in lines[0], err
    assert "partial results: results/" in lines[0]
    (path,) = (tmp_path / "results").glob("*.json")
    doc = results.read(path)
    run = doc["runs"][0]
    assert run["complete"] is False and run["stopped_by"] == sig.name
    assert len(doc["records"]) >= 3 and run["not_reached"]
    # the unit the stop cut short is not reached, not an error of the backend's
    assert [] == [r["message"] for r in doc["records"] if r["status"] == "error"]
    assert not list((tmp_path / "results").glob("*.jsonl"))
    rep = normspec(tmp_path, "report", "-o", "again.html")
    assert rep.returncode == 0 and "1 incomplete run(s)" in rep.stdout, rep.stderr
    assert "incomplete run" in (tmp_path / "again.html").read_text(encoding="utf-8")


def test_a_worker_killed_from_two_threads_at_once_closes_its_pipe_once():
    """A stop kills each backend process from the main thread while the thread that drove
    it stops it too: the pipe must be closed once (a second close of the same descriptor
    failed with EBADF and ended stopped runs with a traceback, exit code 1)."""
    import threading

    from normspec.conformance.worker import Worker

    class Pipe:
        closes = 0

        def close(self):
            time.sleep(0.2)  # both threads are inside kill() by now
            Pipe.closes += 1
            if Pipe.closes > 1:
                raise OSError(9, "Bad file descriptor")

    worker = Worker("numpy", "test")
    worker.conn = Pipe()
    errors = []

    def kill():
        try:
            worker.kill()
        except OSError as exc:
            errors.append(exc)
    threads = [threading.Thread(target=kill) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (Pipe.closes, errors) == (1, [])


def test_a_stop_requested_inside_the_wait_for_the_slots_is_acted_on_after_it(monkeypatch):
    """A signal lands between two bytecodes of the main thread, which spends the run in
    concurrent.futures' wait(), where a lock may be taken outside any try/finally: raised
    there, Stopped left the lock held and the stopped run hung in the pool's shutdown.
    The handler only records the stop; the run acts on it after the wait."""
    import threading

    from normspec.conformance import runner

    held = threading.Lock()
    calls = []

    def wait_with_a_signal(*args, **kwargs):
        held.acquire()  # as concurrent.futures does, outside any try/finally
        if not calls:
            runner.request_stop("SIGTERM")  # what the CLI's handler does
        calls.append(1)
        held.release()
        return real_wait(*args, **kwargs)
    real_wait = runner.wait
    monkeypatch.setattr(runner, "wait", wait_with_a_signal)
    doc = runner.run(["nonfinite_backends:Slow"], checks=["F2.values"], dtypes=["float32"],
                     examples=2)
    assert not held.locked(), "the stop was raised inside the wait, holding its lock"
    run = doc["runs"][0]
    assert (run["stopped_by"], run["complete"], len(calls)) == ("SIGTERM", False, 1)
    assert runner.STOPS.pending == ""  # nothing left for a next run


def test_ctrl_c_in_a_program_that_calls_run_itself_stops_it_safely(monkeypatch):
    """A program calling runner.run with Python's own SIGINT handler: a Ctrl-C that lands
    inside concurrent.futures' wait() must not be raised there (a KeyboardInterrupt left
    its lock held and the run hung); it stops the run like the CLI's, and the program's
    handler is back afterwards."""
    import threading

    from normspec.conformance import runner

    held = threading.Lock()
    calls = []

    def wait_with_a_ctrl_c(*args, **kwargs):
        held.acquire()  # as concurrent.futures does, outside any try/finally
        if not calls:
            handler = signal.getsignal(signal.SIGINT)
            calls.append(handler)
            handler(signal.SIGINT, None)  # what a Ctrl-C here runs
        held.release()
        return real_wait(*args, **kwargs)
    real_wait = runner.wait
    monkeypatch.setattr(runner, "wait", wait_with_a_ctrl_c)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (whatever ran us)
    try:
        doc = runner.run(["nonfinite_backends:Slow"], checks=["F2.values"],
                         dtypes=["float32"], examples=2)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert not held.locked(), "the Ctrl-C was raised inside the wait, holding its lock"
    assert doc["runs"][0]["stopped_by"] == "SIGINT"


@pytest.mark.parametrize("when", ["loading", "writing"])
def test_a_stop_while_loading_or_while_writing_is_not_a_crash(tmp_path, monkeypatch, when):
    """A signal before any check ran ends the run with 128 + its number and one line, no
    traceback, and a results file that says the run stopped before any check; one after
    the last check (while the results are written) changes nothing: the run is complete
    and written. Found by reviews: IndexError and exit 1 while loading; the finished
    run's results thrown away, or a traceback, while writing; no file at all after a
    stop while loading, where a partial results file is promised."""
    from normspec.conformance import cli, runner

    monkeypatch.chdir(tmp_path)
    real_load, real_write = runner._Run.load, cli.results.write

    def load(self, names):
        if when == "loading":
            runner.request_stop("SIGTERM")
        return real_load(self, names)

    def write(doc, path):
        if when == "writing":
            runner.request_stop("SIGTERM")
        return real_write(doc, path)
    monkeypatch.setattr(runner._Run, "load", load)
    monkeypatch.setattr(cli.results, "write", write)
    rc = cli.main(["run", "--backend", "numpy", "--check", "E1.worked_example", "--dtype",
                   "float32", "--no-html", "--json", "r.json"])
    if when == "loading":
        assert rc == 128 + signal.SIGTERM.value
        run = results.read(tmp_path / "r.json")["runs"][0]
        assert (run["complete"], run["stopped_by"]) == (False, "SIGTERM")
        assert not (tmp_path / "r.jsonl").exists()
        # every unit asked for is listed as not reached (none was: found by a review)
        assert run["not_reached"] == [["numpy", "E1.worked_example", "float32"]]
    else:
        assert rc == 0
        assert results.read(tmp_path / "r.json")["runs"][0]["complete"] is True
    assert runner.STOPS.pending == ""  # (a later run in this process is not stopped by it)


def test_a_closed_stdout_does_not_cost_the_results(tmp_path, monkeypatch):
    """`normspec run | tee log` stopped by Ctrl-C stops tee as well: the next progress
    line, printed in a slot thread, raised BrokenPipeError, and the run ended with exit 0,
    no line and no results file (found by a review). Progress goes quiet instead."""
    from normspec.conformance import cli

    class Gone:  # (its flush of nothing succeeds, as a closed pipe's does)
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdout", Gone())
    rc = cli.main(["run", "--backend", "numpy", "--check", "E1.worked_example", "--dtype",
                   "float32", "--no-html", "--json", "r.json"])
    assert rc == 0
    assert results.read(tmp_path / "r.json")["runs"][0]["complete"] is True


def test_a_backend_process_ignores_the_signals_that_stop_the_run():
    """A Ctrl-C or SIGTERM reaches the whole process group; the backend processes leave
    stopping to the run, which kills them itself (killed by the signal, they were recorded
    as backend deaths: found by a review)."""
    from normspec.conformance.worker import Worker

    worker = Worker("numpy", "test")
    assert worker.start() and worker.wait_loaded(60)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(worker.proc.pid, sig)
        time.sleep(0.5)
        assert worker.alive
    finally:
        worker.close()
    assert not worker.alive and not worker.start()  # and closed, it starts no process


def test_a_killed_run_leaves_a_readable_stream(tmp_path):
    proc = start(tmp_path, "run", "--backend", "nonfinite_backends:Slow", "--check", "F2",
                 "--check", "F3", "--label", "slow")
    stream = _wait_for_records(tmp_path, proc, 3)
    proc.kill()
    proc.communicate(timeout=60)
    doc = results.read(stream)
    assert doc["runs"][0]["complete"] is False and "killed" in doc["runs"][0]["stopped_by"]
    assert len(doc["records"]) >= 3
    rep = normspec(tmp_path, "report")  # the latest run: the stream, as no document exists
    assert rep.returncode == 0, rep.stderr
    html = next((tmp_path / "reports").glob("*.html")).read_text(encoding="utf-8")
    assert "incomplete run" in html and "killed" in html


def _written_stream(path: Path, records: int) -> None:
    """A finished stream of one backend's one unit with `records` pass records."""
    stream = results.Stream(path, run={"run": "r", "id": "x", "created": "2026-12-02T01:00:00"},
                            tolerances=[], plan=[["b", "F2.values", "float32"]])
    stream.backend({"name": "b", "available": True, "run": "r"})
    for k in range(records):
        stream.record(results.Record(backend="b", check="F2.values", claim="F2",
                                     op="layer_norm", dtype="float32", case=f"case {k}",
                                     status="pass", run="r").to_json())
    stream.done(("b", "F2.values", "float32"))
    stream.end(complete=True, stopped_by="", duration_s=1.0)
    stream.close()


def test_a_damaged_line_costs_that_line_alone(tmp_path):
    """A hole of NUL bytes in the middle of a stream (what a crash leaves on some
    filesystems) refused the whole stream ("line 101 is not valid JSON"), and bytes that
    are not UTF-8 after its last line made it unreadable (found by a review). Every line
    that reads is kept; the lost ones are counted, on stderr and in the report."""
    path = tmp_path / "r.jsonl"
    _written_stream(path, 6)
    lines = path.read_bytes().split(b"\n")
    lines[3] = b"\0" * len(lines[3])  # line 4, the second record
    path.write_bytes(b"\n".join(lines) + b"\xff\xfe\x00\x81 after the end")
    doc = results.read(path)
    assert [r["case"] for r in doc["records"]] == [f"case {k}" for k in (0, 2, 3, 4, 5)]
    assert doc["runs"][0]["unreadable_lines"] == [4, len(lines)]
    proc = normspec(tmp_path, "report", "r.jsonl", "-o", "r.html")
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"r.jsonl: 2 line(s) could not be read (line 4, {len(lines)})" in line, line
    page = Page()
    page.feed((tmp_path / "r.html").read_text(encoding="utf-8"))
    text = " ".join(" ".join(page.text).split())
    assert "damaged stream" in text and "2 line(s) of its stream could not be read" in text
    assert "records may be missing" in text  # on the backend's verdict


def test_the_line_a_run_in_progress_is_writing_is_not_damage(tmp_path):
    """A report of a live run counted the half-written last line as damaged ("records may
    be missing"; found by a review): an unterminated last line that starts a JSON object,
    in a stream with no end line, is a line still being written."""
    path = tmp_path / "r.jsonl"
    _written_stream(path, 3)
    text = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[0] + b"\n"  # no end line yet
    path.write_bytes(text + b'{"record": {"backend": "numpy", "che')
    assert results.read(path)["runs"][0]["unreadable_lines"] == []
    path.write_bytes(text + b"\0\0\0\0")  # a hole of NUL bytes at the end is damage
    assert results.read(path)["runs"][0]["unreadable_lines"] == [len(text.split(b"\n"))]


def test_a_small_run_after_a_big_one_leaves_it_intact(tmp_path):
    big = normspec(tmp_path, "run", "--backend", "numpy", "--check", "F2", "--check", "F3",
                   "--label", "big", "--quiet")
    assert big.returncode == 0, big.stderr
    (big_json,) = (tmp_path / "results").glob("*-big.json")
    digest = hashlib.sha256(big_json.read_bytes()).hexdigest()
    small = normspec(tmp_path, "run", "--backend", "numpy", "--check", "F2.values",
                     "--dtype", "float32", "--label", "big", "--quiet")
    assert small.returncode == 0, small.stderr
    runs = sorted((tmp_path / "results").glob("*.json"))
    assert len(runs) == 2 and len(list((tmp_path / "reports").glob("*.html"))) == 2
    assert hashlib.sha256(big_json.read_bytes()).hexdigest() == digest
    latest = (tmp_path / "results" / "latest").read_text().strip()
    newest = [p for p in runs if p != big_json][0]
    assert latest == newest.stem
    assert not (tmp_path / ".hypothesis").exists()


def test_json_and_html_go_exactly_where_told(tmp_path):
    proc = normspec(tmp_path, "run", "--backend", "numpy", "--check", "F2.values", "--dtype",
                    "float32", "--json", "out/r.json", "--html", "page.html", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert files(tmp_path) == ["out", "out/r.json", "page.html"]


# ------------------------------------------------------------------ survival
def test_a_hung_check_is_stopped_without_noise_and_the_run_goes_on(tmp_path):
    proc = normspec(tmp_path, "run", "--backend", "broken_backends:Hangs", "--check", "F2.values",
                    "--check", "F3.values", "--dtype", "float32", "--timeout", "3", "--quiet")
    assert proc.returncode == 1
    assert "terminate called" not in proc.stderr and proc.stderr == "", proc.stderr
    doc = results.read(next((tmp_path / "results").glob("*.json")))
    by_check = {}
    for r in doc["records"]:
        by_check.setdefault(r["check"], set()).add(r["status"])
    assert "error" in by_check["F2.values"] and by_check["F3.values"] == {"pass"}
    assert any("timed out after 3 s" in r["message"] for r in doc["records"])


def test_a_crashing_backend_costs_that_check_alone(tmp_path):
    proc = normspec(tmp_path, "run", "--backend", "nonfinite_backends:Segfaults", "--check",
                    "F2.values", "--check", "F3.values", "--dtype", "float32", "--quiet")
    assert proc.returncode == 1
    doc = results.read(next((tmp_path / "results").glob("*.json")))
    died = [r for r in doc["records"] if r["check"] == "F2.values" and r["status"] == "error"]
    assert died and "SIGSEGV" in died[0]["message"]
    assert {r["status"] for r in doc["records"] if r["check"] == "F3.values"} == {"pass"}


def test_a_backend_process_that_dies_starting_is_reported_at_once(tmp_path):
    """A script piped to `python -` calls the runner: multiprocessing's spawned child
    looks for the main script '<stdin>' and dies before it takes its end of the pipe,
    which the parent never sees close. The run says so within seconds, not after the
    load timeout (120 s)."""
    script = ("from normspec.conformance import runner\n"
              "try:\n"
              "    runner.run(['numpy'], checks=['E1'], dtypes=['float32'], label='x')\n"
              "except runner.BackendNotUsable as exc:\n"
              "    print('NOT USABLE:', exc)\n")
    start_t = time.monotonic()
    proc = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, text=True,
                          capture_output=True, timeout=120)
    assert time.monotonic() - start_t < 60
    assert "NOT USABLE:" in proc.stdout and "died while loading it" in proc.stdout, proc.stdout


# ------------------------------------------------------------------ bad arguments
BAD_RUN = [
    (["--seed", "-1"], "'-1'"), (["--seed", "x"], "'x'"), (["--examples", "0"], "'0'"),
    (["--examples", "-3"], "'-3'"), (["--timeout", "0"], "'0'"), (["--timeout", "nan"], "'nan'"),
    (["--jobs", "0"], "'0'"), (["--dtype", "float8"], "'float8'"),
    (["--check", "NOPE"], "'NOPE'"), (["--backend", "nosuch"], "'nosuch'"),
    (["--backend", "nosuch_module:make"], "'nosuch_module:make'"),
    (["--backend", "json:loads"], "'json:loads'"), (["--label", ""], "label"),
    (["--json", "/proc/normspec/r.json"], "/proc/normspec/r.json"),
    (["--shard", "0/3"], "'0/3'"), (["--shard", "4/3"], "'4/3'"), (["--shard", "2"], "'2'"),
    (["--replicas", "1"], "'1'"),
    # found by a review: an empty path fell back to the default; a .jsonl results file was
    # written that normspec could not read back; a report over a results file; a label
    # too long for a file name failed once the backends had loaded; a run of nothing
    # said "conforms"
    (["--json", ""], "the path is empty"), (["--html", ""], "the path is empty"),
    (["--json", "r.jsonl"], "r.jsonl"), (["--html", "r.json"], "r.json"),
    (["--json", "results/latest"], "names the latest run"),
    (["--label", "x" * 150], "150 characters"),
    (["--shard", "7/100"], "nothing to run"),
    (["--json", "r.json", "--html", "r.json"], "r.json"),
    (["--json", "/dev/null"], "/dev/null"),
    # what a new user needed: the near miss, where the module must be, the missing folder
    (["--check", "B9.determinstic"], "did you mean B9.deterministic?"),
    (["--backend", "my_missing_backend:make"], "my_missing_backend on PYTHONPATH"),
    (["--json", "/proc/normspec/r.json"], "/proc/normspec does not exist"),
]


@pytest.mark.parametrize("args,names", BAD_RUN, ids=[" ".join(a) for a, _ in BAD_RUN])
def test_a_bad_run_argument_is_refused_before_any_work(tmp_path, args, names):
    proc = normspec(tmp_path, "run", "--backend", "numpy", "--check", "F2.values", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], proc.stderr
    assert proc.stdout == "" and files(tmp_path) == []


BAD_REPORT = {
    "truncated.json": '{"schema": "normspec-results", "version": 2, "runs": [',
    "not-json.json": "hello",
    "wrong-schema.json": '{"schema": "other", "version": 2}',
    "no-records.json": '{"schema": "normspec-results", "version": 2, "runs": [], "backends": []}',
    "bad-record.json": '{"schema": "normspec-results", "version": 2, "runs": [], "backends": [],'
                       ' "records": [{"backend": "x"}]}',
    "nan-token.json": '{"schema": "normspec-results", "version": 2, "runs": [], "backends": [],'
                      ' "records": [], "x": NaN}',
    "future.json": '{"schema": "normspec-results", "version": 99}',
    # readable, but of types the report would meet as a traceback
    "measure-text.json": '{"schema": "normspec-results", "version": 2, "runs": [], "backends":'
                         ' [], "records": [{"backend": "b", "check": "c", "claim": "F2", "op":'
                         ' "layer_norm", "dtype": "float32", "case": "x", "status": "pass",'
                         ' "max_ulp": "abc"}]}',
    "versions-null.json": '{"schema": "normspec-results", "version": 2, "runs": [{"run": "r",'
                          ' "versions": null}], "backends": [], "records": []}',
    "capabilities-text.json": '{"schema": "normspec-results", "version": 2, "runs": [],'
                              ' "backends": [{"name": "b", "available": true, "run": "r",'
                              ' "capabilities": "x"}], "records": []}',
    "reasons-null.json": '{"schema": "normspec-results", "version": 2, "runs": [], "backends":'
                         ' [{"name": "b", "available": true, "run": "r", "conventions":'
                         ' {"reasons": null}}], "records": []}',
    "tolerance-number.json": '{"schema": "normspec-results", "version": 2, "runs": [],'
                             ' "backends": [], "records": [], "tolerances": [1, 2]}',
}


def _with(field: str, value, part: str = "record") -> str:
    """A results file whose one fail record (or tolerance, benchmark) is whole but for
    `field` (dotted: "worst.ulp"), which is `value`, or missing where `value` is ...."""
    record = {"backend": "b", "check": "F2.values", "claim": "F2", "op": "layer_norm",
              "dtype": "float32", "case": "x", "status": "fail", "message": "m",
              "worst": {"index": [0], "expected": "1", "got": "2", "ulp": 3.0, "bound": 1.0},
              "diagnosis": {"op": "layer_norm", "matches": ["v"], "tried": ["v"],
                            "details": {"v": {"description": "d", "seen_in": "s"}}}}
    entry = {"record": record,
             "tolerance": {"quantity": "q", "base_ulps": 1.0, "fixed": 0.0, "growth": 1.0,
                           "reason": "r"},
             "benchmark": {"backend": "b", "op": "layer_norm", "dtype": "float32",
                           "shape": [4, 8], "pass": "forward", "ms": 1.0, "of_copy": 0.5,
                           "reliable": True}}[part]
    *outer, last = field.split(".")
    for key in outer:
        entry = entry[key]
    if value is ...:
        del entry[last]
    else:
        entry[last] = value
    doc = {"schema": "normspec-results", "version": 2, "runs": [{"run": "r"}],
           "backends": [{"name": "b", "available": True, "run": "r"}],
           "records": [record] if part == "record" else [],
           "tolerances": [entry] if part == "tolerance" else [],
           "benchmarks": [entry] if part == "benchmark" else []}
    return json.dumps(doc)


def _stream(*lines) -> str:
    """A stream: a header line planning one unit, then `lines` (objects, or text as is)."""
    head = {"stream": "normspec-results", "version": 2, "run": {"run": "r"}, "tolerances": [],
            "plan": [["b", "F2.values", "float32"]]}
    return "\n".join(x if isinstance(x, str) else json.dumps(x) for x in (head, *lines)) + "\n"


#: Fields of the wrong type or missing, deep in a file the report reads (found by a
#: review: each ended `normspec report` with a traceback, exit code 1): the field and the
#: file are named, exit code 2.
BAD_FIELDS = {
    "worst-ulp-text.json": (_with("worst.ulp", "big"), "worst.ulp"),
    "worst-bound-null.json": (_with("worst.bound", None), "worst.bound"),
    "worst-no-ulp.json": (_with("worst.ulp", ...), "worst.ulp"),
    "matches-number.json": (_with("diagnosis.matches", 5), "diagnosis.matches"),
    "details-list.json": (_with("diagnosis.details", [1]), "diagnosis.details"),
    "details-text.json": (_with("diagnosis.details", {"a": "s"}), "diagnosis.details['a']"),
    "tolerance-no-base.json": (_with("base_ulps", ..., "tolerance"), "base_ulps"),
    "bench-ms-text.json": (_with("ms", "fast", "benchmark"), "ms"),
    "bench-of-copy-text.json": (_with("of_copy", "x", "benchmark"), "of_copy"),
    "done-number.jsonl": (_stream({"done": 5}), "done"),
    "done-null.jsonl": (_stream({"done": None}), "done"),
    "done-nested.jsonl": (_stream({"done": [[1], 2, 3]}), "done"),
    "end-number.jsonl": (_stream({"end": 5}), "end line"),
    "plan-number.jsonl": (_stream().replace('[["b", "F2.values", "float32"]]', "[5]"),
                          "plan[0]"),
    "unknown-line.jsonl": (_stream({"what": 1}), "line 2"),
}
BAD_REPORT.update({name: text for name, (text, _) in BAD_FIELDS.items()})
# a damaged line costs that line alone, but the header's: whose records the rest are
BAD_REPORT["header-damaged.jsonl"] = "\0" * 40 + "\n" + _stream().split("\n", 1)[1] + \
    '{"done": ["b", "F2.values", "float32"]}\n'


@pytest.mark.parametrize("name", sorted(BAD_FIELDS))
def test_a_field_of_the_wrong_type_is_named(tmp_path, name):
    text, field = BAD_FIELDS[name]
    (tmp_path / name).write_text(text, encoding="utf-8")
    proc = normspec(tmp_path, "report", name, "-o", "r.html")
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert name in line and field in line, line
    assert not (tmp_path / "r.html").exists()


def test_the_whole_files_the_bad_ones_are_made_from_are_reported(tmp_path):
    """(the cases above are refused for their one field, not for the rest of them)"""
    (tmp_path / "whole.json").write_text(_with("message", "m"), encoding="utf-8")
    (tmp_path / "bench.json").write_text(_with("ms", 2.0, "benchmark"), encoding="utf-8")
    (tmp_path / "tol.json").write_text(_with("reason", "r", "tolerance"), encoding="utf-8")
    (tmp_path / "s.jsonl").write_text(_stream({"done": ["b", "F2.values", "float32"]},
                                              {"end": {"complete": True}}), encoding="utf-8")
    for name in ("whole.json", "bench.json", "tol.json", "s.jsonl"):
        proc = normspec(tmp_path, "report", name, "-o", f"{name}.html")
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", sorted(BAD_REPORT) + ["missing.json", "(latest)"])
def test_a_bad_report_input_is_refused_without_output(tmp_path, name):
    if name in BAD_REPORT:
        (tmp_path / name).write_text(BAD_REPORT[name], encoding="utf-8")
    before = files(tmp_path)
    proc = normspec(tmp_path, "report", *([] if name == "(latest)" else [name]))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and (name in lines[0] or "latest" in lines[0]), proc.stderr
    assert files(tmp_path) == before


HOSTILE = {  # backend -> (exit code, status of its LayerNorm records, words of the message)
    "RaisesUnprintable": (1, "error", "_Unprintable: (its message could not be read"),
    "RaisesSurrogate": (1, "error", "ValueError: byte \\udcff here"),
    "RaisesKeyboardInterrupt": (1, "error", "raised KeyboardInterrupt"),
    "RaisesSystemExit": (1, "error", "raised SystemExit: 0"),
    "RaisesHugeMessage": (1, "error", "characters ...]"),
    "SurrogateName": (0, "pass", ""),
    "NoReasonsTable": (0, "pass", ""),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_what_a_backend_says_cannot_cost_the_results_or_the_report(tmp_path, name):
    """Exceptions that cannot be printed, lone surrogates, a KeyboardInterrupt or a
    SystemExit of the backend's own, megabytes of message, a name a plot cannot draw, a
    reasons table that is None: each LayerNorm record says what happened, and the
    results and the report are written."""
    code, status, words = HOSTILE[name]
    proc = normspec(tmp_path, "run", "--backend", f"broken_backends:{name}", "--check",
                    "F2.values", "--dtype", "float32", "--json", "r.json", "--html", "r.html",
                    errors="backslashreplace")  # the name as printed: surrogate-escaped bytes
    assert proc.returncode == code, proc.stderr[-2000:]
    doc = strict(tmp_path / "r.json")
    assert doc["records"] and {r["status"] for r in doc["records"]} == {status}
    assert all(words in r["message"] and len(r["message"]) < 5000 for r in doc["records"])
    assert (tmp_path / "r.html").stat().st_size > 0
    assert normspec(tmp_path, "report", "r.json", "-o", "again.html").returncode == 0


def test_a_report_is_never_written_over_its_own_results(tmp_path):
    ran = normspec(tmp_path, "run", "--backend", "numpy", "--check", "E1", "--json", "r.json",
                   "--no-html", "--quiet")
    assert ran.returncode == 0, ran.stderr
    before = (tmp_path / "r.json").read_bytes()
    proc = normspec(tmp_path, "report", "r.json", "-o", "./r.json")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "r.json" in proc.stderr and (tmp_path / "r.json").read_bytes() == before


def test_a_run_of_nothing_is_refused(tmp_path):
    """A check whose dtypes the run leaves out: 0 records, and a verdict "conforms"
    (found by a review)."""
    proc = normspec(tmp_path, "run", "--backend", "numpy", "--check", "F2/F3.subnormals",
                    "--dtype", "float32")
    assert proc.returncode == 2 and "nothing to run" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and files(tmp_path) == []


def test_a_report_is_never_written_over_results_or_the_latest_pointer(tmp_path):
    """`report -o results/b.json` replaced another run's results with HTML, and `-o
    results/latest` the pointer, after which `normspec report` crashed (found by a review)."""
    ran = normspec(tmp_path, "run", "--backend", "numpy", "--check", "E1", "--no-html", "--quiet")
    assert ran.returncode == 0, ran.stderr
    stem = (tmp_path / "results" / "latest").read_text(encoding="utf-8").strip()
    before = files(tmp_path)
    for out in ("other.json", "stream.jsonl", "results/latest", f"results/{stem}.json"):
        proc = normspec(tmp_path, "report", "-o", out)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert out in proc.stderr and files(tmp_path) == before
    (tmp_path / "results" / "latest").write_text("<html>" * 100, encoding="utf-8")
    proc = normspec(tmp_path, "report")
    assert proc.returncode == 2 and "does not name a run" in proc.stderr, proc.stderr


def test_two_runs_started_together_take_two_names(tmp_path):
    """Both took the same name (chosen before their backends loaded, written after), and
    the second ended with a traceback (found by a review)."""
    procs = [start(tmp_path, "run", "--backend", "numpy", "--check", "E1", "--dtype", "float32",
                   "--no-html", "--quiet", "--label", "same") for _ in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    made = sorted(p.name for p in (tmp_path / "results").glob("*.json"))
    assert len(made) == 3 and not list((tmp_path / "results").glob(".*.lock")), made


def test_a_report_refuses_to_count_a_run_twice_or_to_add_two_backends_together(tmp_path):
    ran = normspec(tmp_path, "run", "--backend", "numpy", "--check", "E1", "--json", "a.json",
                   "--no-html", "--quiet", "--label", "here")
    assert ran.returncode == 0, ran.stderr
    twice = normspec(tmp_path, "report", "a.json", "a.json", "-o", "x.html")
    assert twice.returncode == 2 and "count twice" in twice.stderr, twice.stderr
    again = normspec(tmp_path, "run", "--backend", "numpy", "--check", "E1", "--json", "b.json",
                     "--no-html", "--quiet", "--label", "here")
    assert again.returncode == 0, again.stderr
    assert normspec(tmp_path, "report", "a.json", "b.json", "-o", "x.html").returncode == 0
    other = json.loads((tmp_path / "b.json").read_text(encoding="utf-8"))
    other["backends"][0]["version"] = "9.9.9"
    (tmp_path / "b.json").write_text(json.dumps(other), encoding="utf-8")
    mixed = normspec(tmp_path, "report", "a.json", "b.json", "-o", "y.html")
    assert mixed.returncode == 2 and "two backends under one name" in mixed.stderr, mixed.stderr
    assert len(mixed.stderr.strip().splitlines()) == 1 and not (tmp_path / "y.html").exists()


def test_records_of_a_restarted_process_stay_under_the_listed_name(tmp_path):
    """The process started after a crash names the backend after its own pid: its records
    are still filed under the name the results list, so the report shows them."""
    proc = normspec(tmp_path, "run", "--backend", "nonfinite_backends:SegfaultsNamedByPid",
                    "--check", "F2.values", "--check", "F3.values", "--dtype", "float32",
                    "--json", "r.json", "--no-html", "--quiet")
    assert proc.returncode == 1, proc.stderr
    doc = strict(tmp_path / "r.json")
    (listed,) = [b["name"] for b in doc["backends"]]
    assert {r["backend"] for r in doc["records"]} == {listed}
    assert any(r["check"] == "F3.values" and r["status"] == "pass" for r in doc["records"])


def test_processes_a_backend_forks_end_with_its_worker(tmp_path):
    """A backend that forks: the run ends when its checks do (no wait on the forked
    process's pipes), and the forked processes are killed with the worker."""
    orphans = tmp_path / "orphans.txt"
    start_s = time.monotonic()
    proc = normspec(tmp_path, "run", "--backend", "nonfinite_backends:ForksAChild", "--check",
                    "E1", "--dtype", "float32", "--json", "r.json", "--no-html", "--quiet",
                    extra_env={"NORMSPEC_TEST_ORPHAN_FILE": str(orphans)})
    took = time.monotonic() - start_s
    assert proc.returncode == 0, proc.stderr
    assert orphans.read_text(encoding="utf-8").strip(), "the backend never forked"
    time.sleep(4)
    assert "still alive" not in orphans.read_text(encoding="utf-8")
    assert took < 30


@pytest.mark.parametrize("args,names", [(["--backend", "nosuch"], "'nosuch'"),
                                        (["--json", "/proc/normspec/b.json"], "/proc/normspec")])
def test_a_bad_bench_argument_is_refused_before_any_work(tmp_path, args, names):
    proc = normspec(tmp_path, "bench", "--quick", "--backend", "numpy", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], proc.stderr
    assert proc.stdout == "" and files(tmp_path) == []


def test_a_backend_that_ran_almost_nothing_does_not_just_conform():
    import io

    from normspec.conformance import cli

    def rec(status):
        return {"backend": "b", "status": status, "check": "c", "claim": "F2", "op": "layer_norm",
                "dtype": "float32", "case": "x", "message": ""}
    doc = {"backends": [{"name": "b", "version": "1", "available": True}],
           "records": [rec("pass")] * 4 + [rec("unsupported")] * 10}
    out = io.StringIO()
    cli.print_summary(doc, out)
    assert "conforms (where it ran: 10 of 14 cases not run)" in out.getvalue()


def test_a_load_error_is_filed_under_the_name_the_results_list(tmp_path):
    """A backend refused at load (--record-unavailable): its error record carries the
    name its backends entry has, not the module:factory it was asked for by."""
    proc = normspec(tmp_path, "run", "--backend", "broken_backends:BadDeviationEntry",
                    "--check", "E1", "--dtype", "float32", "--record-unavailable",
                    "--json", "r.json", "--no-html", "--quiet")
    assert proc.returncode == 1, proc.stderr
    doc = strict(tmp_path / "r.json")
    (listed,) = [b["name"] for b in doc["backends"]]
    (record,) = doc["records"]
    assert (record["check"], record["backend"]) == ("load", listed)


def test_a_run_stopped_while_loading_is_the_latest_and_reports(tmp_path, monkeypatch):
    """Stopped before any check, without --json: its results file is written under
    results/, results/latest names it, and `normspec report` with no file reports it."""
    from normspec.conformance import cli, runner

    monkeypatch.chdir(tmp_path)
    real_load = runner._Run.load

    def load(self, names):
        runner.request_stop("SIGINT")
        return real_load(self, names)
    monkeypatch.setattr(runner._Run, "load", load)
    rc = cli.main(["run", "--backend", "numpy", "--check", "E1.worked_example", "--dtype",
                   "float32", "--no-html", "--label", "early"])
    assert rc == 128 + signal.SIGINT.value
    stem = (tmp_path / "results" / "latest").read_text(encoding="utf-8").strip()
    assert stem.endswith("-early")
    run = results.read(tmp_path / "results" / f"{stem}.json")["runs"][0]
    assert (run["complete"], run["stopped_by"]) == (False, "SIGINT")
    monkeypatch.setattr(runner._Run, "load", real_load)
    assert cli.main(["report", "-o", "r.html"]) == 0 and (tmp_path / "r.html").exists()


def test_two_runs_of_one_label_started_in_one_second_merge(tmp_path):
    """Runs are told apart by their id, not by label and time to the second: two runs
    of one label created in the same second merged as 'the same run twice' (found by a
    clean-clone CI run, where two quick runs of E1 started within one second)."""
    for name in ("a.json", "b.json"):
        ran = normspec(tmp_path, "run", "--backend", "numpy", "--check", "E1", "--json", name,
                       "--no-html", "--quiet", "--label", "here")
        assert ran.returncode == 0, ran.stderr
    a = json.loads((tmp_path / "a.json").read_text(encoding="utf-8"))
    b = json.loads((tmp_path / "b.json").read_text(encoding="utf-8"))
    assert a["runs"][0]["id"] != b["runs"][0]["id"]
    b["runs"][0]["created"] = a["runs"][0]["created"]
    (tmp_path / "b.json").write_text(json.dumps(b), encoding="utf-8")
    merged = normspec(tmp_path, "report", "a.json", "b.json", "-o", "x.html")
    assert merged.returncode == 0, merged.stderr
    twice = normspec(tmp_path, "report", "b.json", "b.json", "-o", "y.html")
    assert twice.returncode == 2 and "count twice" in twice.stderr, twice.stderr


def _records_of(tmp_path, *args, timeout=600):
    proc = normspec(tmp_path, "run", *args, "--dtype", "float32", "--jobs", "1", "--json",
                    "r.json", "--no-html", "--quiet", timeout=timeout)
    return proc, results.read(tmp_path / "r.json")


def test_a_backend_that_forks_into_the_harness_loses_no_check(tmp_path):
    """Both processes answered on one pipe: a unit's records came twice and a later unit
    had none, in a run that said complete and exited 0 (found by a review). Now every
    check has its records, once, or an error record saying what happened (the forked
    process may also hang, on a lock a thread held at the fork, and then the worker
    alone answers: nothing is lost either way)."""
    proc, doc = _records_of(tmp_path, "--backend", "hostile_backends:ForksIntoTheHarness",
                            "--backend", "numpy", "--check", "F2.values", "--check",
                            "F3.values", "--check", "B1")
    assert doc["runs"][0]["complete"] is True and proc.returncode in (0, 1), proc.stderr
    counts: dict = {}
    for r in doc["records"]:
        counts.setdefault(r["check"], {}).setdefault(r["backend"], []).append(r)
    assert len(counts) == 4
    for check, by in counts.items():
        forked, clean = by["forksintotheharness"], by["numpy"]
        broke = [r for r in forked if r["status"] == "error"]
        if broke:
            assert len(broke) == 1 and ("wrote to the harness's pipe beside" in broke[0]["message"]
                                        or "not a message" in broke[0]["message"]), broke
            assert len(forked) <= len(clean) + 1
        else:
            assert len(forked) == len(clean) and {r["status"] for r in forked} == {"pass"}, check
    assert proc.returncode == (1 if any(r["status"] == "error" for r in doc["records"]) else 0)


def test_bytes_on_the_harness_pipe_cost_one_check_not_the_run(tmp_path):
    proc, doc = _records_of(tmp_path, "--backend", "hostile_backends:WritesOnThePipe",
                            "--check", "F2.values", "--check", "F3.values")
    assert proc.returncode == 1, proc.stderr
    broke = [r for r in doc["records"] if r["status"] == "error"]
    assert [r["check"] for r in broke] == ["F2.values"]
    assert "not a message" in broke[0]["message"]
    assert {r["status"] for r in doc["records"] if r["check"] == "F3.values"} == {"pass"}


@pytest.mark.parametrize("name", ["SendsDeepJson", "SendsAHugeLength"])
def test_what_cannot_be_read_off_the_pipe_costs_one_check(tmp_path, name):
    """A message too deep to decode ended the run with a traceback and no results file; a
    length header past the limit closed the pipe under a live worker, and every later
    check of the backend was recorded as a death (found by a review)."""
    proc, doc = _records_of(tmp_path, "--backend", f"hostile_backends:{name}", "--check",
                            "F2.values", "--check", "F3.values", "--check", "B1.rms_norm_shift")
    assert proc.returncode == 1 and doc["runs"][0]["complete"], proc.stderr
    broke = [r for r in doc["records"] if r["status"] == "error"]
    assert [r["check"] for r in broke] == ["F2.values"], broke
    assert "broke the harness's protocol" in broke[0]["message"]
    assert {r["status"] for r in doc["records"] if r["check"] != "F2.values"} == {"pass"}


def test_a_death_is_told_from_a_hang_though_a_child_holds_the_pipe(tmp_path):
    start_s = time.monotonic()
    proc, doc = _records_of(tmp_path, "--backend", "hostile_backends:DiesLeavingAChild",
                            "--check", "F2.values", "--timeout", "60")
    assert time.monotonic() - start_s < 45
    (died,) = [r for r in doc["records"] if r["status"] == "error"]
    assert "died (exit code 3)" in died["message"], died["message"]


@pytest.mark.parametrize("closed", [(1,), (2,), (1, 2)], ids=["stdout", "stderr", "both"])
def test_a_backend_that_prints_into_a_closed_pipe_loses_no_record(closed, capfd):
    """`normspec run | head -1`: the backend processes shared the run's stdout, and a
    correct backend that printed inside an op had every record of its checks an error,
    "raised BrokenPipeError", once head had exited. Its prints now go to stderr (a C
    library's writes on fd 1 too), and what a closed stderr cannot take is dropped: its
    records are those of the same backend silent."""
    from normspec.conformance import runner

    capfd.readouterr()
    read_end, write_end = os.pipe()
    os.close(read_end)  # (a reader that has exited: every write fails with EPIPE)
    saved = {fd: os.dup(fd) for fd in closed}
    try:
        for fd in closed:  # (the backend processes inherit the run's descriptors)
            os.dup2(write_end, fd)
        doc = runner.run(["hostile_backends:PrintsInsideOps", "numpy"],
                         checks=["F2.values", "E1"], dtypes=["float32"], examples=2,
                         label="ci", jobs=1)
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(write_end)
    err = capfd.readouterr().err
    by = {name: sorted((r["check"], r["dtype"], r["case"], r["status"], r["message"],
                        str(r["max_ulp"])) for r in doc["records"] if r["backend"] == name)
          for name in ("printsinsideops", "numpy")}
    assert doc["runs"][0]["complete"] and by["numpy"]
    assert by["printsinsideops"] == by["numpy"]
    assert {r["status"] for r in doc["records"]} == {"pass"}
    if 2 not in closed:  # what it printed is on stderr, for the user to see
        assert "PrintsInsideOps: print\n" in err and "PrintsInsideOps: print to stderr" in err
        assert "PrintsInsideOps: written on fd 1" in err


def test_a_backend_that_cannot_be_started_again_costs_one_load_wait(tmp_path, monkeypatch):
    """A backend that died in a check and whose next load hung: each later check started
    a process again and waited the load timeout for it (120 s at least: 6 minutes for
    the 4 units of one check, ~10 hours for a full run). The process is started again
    once; that start failing, the units left get an error record at once, naming where
    the process was lost and why the new one did not load."""
    from normspec.conformance import runner, worker

    loads = tmp_path / "loads.txt"
    monkeypatch.setenv("NORMSPEC_TEST_LOADS", str(loads))
    monkeypatch.setattr(worker, "LOAD_TIMEOUT_MIN_S", 0.0)  # (the load waits --timeout)
    doc = runner.run(["hostile_backends:DiesThenHangsLoading"],
                     checks=["F2.values", "F3.values"], dtypes=["float32", "float64", "float16"],
                     examples=2, timeout=3.0, label="ci", jobs=1)
    assert len(loads.read_text(encoding="utf-8").split()) == 2  # the first, and one restart
    run = doc["runs"][0]
    assert run["complete"] and run["planned"] == 6
    died, restart, *rest = doc["records"]
    assert len(rest) == 4
    assert {r["status"] for r in doc["records"]} == {"error"}
    assert sorted((r["check"], r["dtype"]) for r in doc["records"]) == sorted(
        (c, d) for c in ("F2.values", "F3.values") for d in ("float32", "float64", "float16"))
    assert (died["check"], died["dtype"], died["case"]) == ("F2.values", "float32", "died")
    assert "died (exit code 9)" in died["message"]
    assert restart["case"] == "restart" and restart["message"] == (
        "the backend could not be started again after its process died in F2.values "
        "float32: loading it took longer than 3 s; its later checks are not run")
    for r in rest:
        assert r["case"] == "not run" and r["message"] == (
            "the backend's process died in F2.values float32 and could not be started "
            "again (loading it took longer than 3 s): this check was not run"), r


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # killed, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="processes are found in /proc")
def test_a_daemon_a_backend_starts_ends_with_its_process(tmp_path):
    """A process that left the worker's process group (setsid) outlived the run (the
    README said so), and held the run's output open through the resource tracker's pipe
    it inherited: a caller reading that output (CI) waited for the daemon to end. It is
    now found by the tag its environment inherited, and killed with the worker."""
    pid_file = tmp_path / "daemon.pid"
    try:
        proc = normspec(tmp_path, "run", "--backend", "hostile_backends:LeavesADaemon",
                        "--check", "F2.values", "--dtype", "float32", "--jobs", "1", "--json",
                        "r.json", "--no-html", "--quiet", timeout=90,
                        extra_env={"DAEMON_PID_FILE": str(pid_file)})
        assert proc.returncode == 0, proc.stderr
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid)
    finally:
        if pid_file.exists():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_base_exception_from_a_backend_is_an_error_record_of_its_case(tmp_path):
    proc, doc = _records_of(tmp_path, "--backend", "hostile_backends:RaisesABaseException",
                            "--check", "E1", "--check", "F3.values")
    errors = [r for r in doc["records"] if r["status"] == "error"]
    assert errors and all("_KernelAbort: the kernel aborted" in r["message"] for r in errors)
    assert not any("died" in r["message"] for r in errors)
    assert {r["status"] for r in doc["records"] if r["check"] == "F3.values"} == {"pass"}


def test_a_backend_may_run_processes_of_its_own(tmp_path):
    proc, doc = _records_of(tmp_path, "--backend", "hostile_backends:RunsAProcessPool",
                            "--check", "E1")
    assert proc.returncode == 0, [r["message"] for r in doc["records"] if r["status"] != "pass"]


def test_what_a_backend_declares_never_runs_in_the_run_process(tmp_path):
    """Deviation entries and capabilities reach the run as plain data: a reason whose
    unpickling called os._exit ended the run with no results (found by a review)."""
    proc, doc = _records_of(tmp_path, "--backend", "hostile_backends:ReasonRunsCode",
                            "--check", "F2.values")
    assert proc.returncode == 0 and doc["runs"][0]["complete"], proc.stderr
    assert doc["backends"][0]["deviations"] == [{"check": "F2.values", "reason": "documented"}]
    proc = normspec(tmp_path, "run", "--backend", "hostile_backends:NotPlainDeviation",
                    "--check", "F2.values", "--json", "n.json", "--no-html", "--quiet")
    assert proc.returncode == 2
    assert "not plain data" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_merge_counts_a_check_run_twice_once_the_later_run(tmp_path):
    """A full run, then one check again under the same label: `normspec report results/`
    added both runs' records of that check (found by a new user: numba 1443 pass, 101
    of them twice)."""
    for checks in (("F2.values", "F3.values"), ("F2.values",)):
        args = [a for c in checks for a in ("--check", c)]
        proc = normspec(tmp_path, "run", "--backend", "numpy", *args, "--dtype", "float32",
                        "--label", "same", "--no-html", "--quiet")
        assert proc.returncode == 0, proc.stderr
        time.sleep(1.1)  # (created times a second apart: which run is later)
    first, second = sorted((tmp_path / "results").glob("*.json"))
    docs = [results.read(first), results.read(second)]
    merged = results.merge(docs, [first.name, second.name])
    counts: dict = {}
    for r in merged["records"]:
        counts[r["check"]] = counts.get(r["check"], 0) + 1
    alone = {c: sum(r["check"] == c for r in docs[0]["records"]) for c in counts}
    assert counts == alone
    (left_out,) = merged["superseded"]
    assert (left_out["check"], left_out["file"], left_out["by"]) == ("F2.values", first.name,
                                                                     second.name)
    assert left_out["records"] == alone["F2.values"]
    proc = normspec(tmp_path, "report", "results", "-o", "m.html")
    assert proc.returncode == 0, proc.stderr
    assert f"{left_out['records']} records of 1 unit(s) superseded" in proc.stdout
    page = (tmp_path / "m.html").read_text(encoding="utf-8")
    assert f"superseded by results/{second.name}" in page


def _doc(label, created, started, records, not_reached=(), host="", check="F2.values"):
    return {"schema": results.SCHEMA, "version": results.VERSION,
            "runs": [{"run": label, "id": f"{label}{created}{started}{host}", "created": created,
                      "started": started, "complete": not not_reached, "host": host,
                      "not_reached": [list(u) for u in not_reached]}],
            "backends": [{"name": "b", "available": True, "run": label}],
            "tolerances": [], "benchmarks": [],
            "records": [{"backend": "b", "check": check, "claim": "F2", "op": "layer_norm",
                         "dtype": "float32", "case": f"case {k}", "status": status,
                         "run": label} for k, status in enumerate(records)]}


def _report(tmp_path, capsys, **docs):
    """`normspec report` of these documents (name: document), in this process: (exit
    code, stdout, stderr, the page's text or None)."""
    from normspec.conformance import cli

    paths = []
    for name, doc in docs.items():
        paths.append(str(tmp_path / f"{name}.json"))
        (tmp_path / f"{name}.json").write_text(json.dumps(doc), encoding="utf-8")
    out = tmp_path / "merged.html"
    rc = cli.main(["report", *paths, "-o", str(out)])
    captured = capsys.readouterr()
    page = None
    if out.exists():
        parsed = Page()
        parsed.feed(out.read_text(encoding="utf-8"))
        page = " ".join(" ".join(parsed.text).split())
    return rc, captured.out, captured.err, page


T1, T2 = "2026-12-02T01:00:00+00:00", "2026-12-02T02:00:00+00:00"


def test_one_unit_run_on_two_hosts_under_one_label_is_refused(tmp_path, capsys):
    """Two machines' runs with one label (tox env names are the same on every machine):
    the merge kept the later machine's records of each unit and left out the earlier's,
    its failures included, with a verdict of "conforms" (found by a review). Which
    machine's records count cannot be told: the merge is refused, as one of two versions
    under one name is."""
    rc, out, err, page = _report(
        tmp_path, capsys, a=_doc("ci", T1, 1.0, ["fail"] * 3, host="machine-A"),
        b=_doc("ci", T2, 2.0, ["pass"] * 3, host="machine-B"))
    assert (rc, out, page) == (2, "", None)
    (line,) = err.strip().splitlines()
    for words in ("'b' of run 'ci'", "F2.values float32", "'machine-A'", "'machine-B'",
                  "a.json", "b.json", "give each machine its own --label"):
        assert words in line, line


def test_other_units_of_one_label_from_two_hosts_merge_into_one_column(tmp_path, capsys):
    """(shards of one label on several machines)"""
    from normspec.reports import html

    a = _doc("ci", T1, 1.0, ["pass"], host="machine-A")
    b = _doc("ci", T2, 2.0, ["fail"], host="machine-B", check="F3.values")
    rc, out, err, page = _report(tmp_path, capsys, a=a, b=b)
    assert rc == 0 and "superseded" not in out, err
    context = html.build_context(results.merge([results.validate(a), results.validate(b)]))
    assert context["columns"] == ["b"] and context["verdicts"][0]["failing"] == 1


def test_a_rerun_says_how_much_of_what_it_left_out_failed_and_whose_it_kept(tmp_path, capsys):
    """The notice said only "18 records of 8 unit(s) are left out: a later run ... holds
    them", though three of them failed, and said "a later run" where the earlier run's
    records were kept (a killed run's half-done unit; found by a review)."""
    whole = _doc("same", T1, 1.0, ["fail"] * 3 + ["pass"] * 3, host="h")
    rc, out, err, page = _report(tmp_path, capsys, whole=whole,
                                 again=_doc("same", T2, 2.0, ["pass"], host="h"))
    assert rc == 0, err
    assert (f"left out: 6 records of 1 unit(s) of {tmp_path / 'whole.json'} (3 fail or error), "
            f"superseded by {tmp_path / 'again.json'}: a later run") in out
    assert "6 records of 1 unit(s) are left out, 3 of them fail or error" in page
    assert "whose run started later" in page
    killed = _doc("same", T2, 2.0, ["fail"], host="h",
                  not_reached=[("b", "F2.values", "float32")])
    rc, out, err, page = _report(tmp_path, capsys, whole=whole, killed=killed)
    assert rc == 0, err
    assert (f"left out: 1 records of 1 unit(s) of {tmp_path / 'killed.json'} (1 fail or error), "
            f"superseded by {tmp_path / 'whole.json'}: the run that finished them") in out
    assert "whose run finished the unit where this one did not" in page
    assert "whose run started later" not in page


def test_a_killed_run_never_displaces_a_unit_an_earlier_run_finished():
    """A run killed in the middle of a check (the unit in its not_reached) came after a
    whole run of it, and its one record hid the whole run's six, three fails among them
    (found by a review)."""
    whole = _doc("same", "2026-12-02T01:00:00+00:00", 1.0, ["fail"] * 3 + ["pass"] * 3)
    killed = _doc("same", "2026-12-02T02:00:00+00:00", 2.0, ["pass"],
                  not_reached=[("b", "F2.values", "float32")])
    merged = results.merge([whole, killed], ["whole.json", "killed.json"])
    assert [r["status"] for r in merged["records"]] == ["fail"] * 3 + ["pass"] * 3
    assert merged["superseded"][0]["file"] == "killed.json"


def test_of_two_runs_in_one_second_the_one_started_later_counts():
    """created is to the second; the later run of that second counts, whatever order the
    files are given in (a folder lists `...Z-label-2.json`, the later, first)."""
    first = _doc("same", "2026-12-02T01:00:00+00:00", 100.25, ["fail"])
    later = _doc("same", "2026-12-02T01:00:00+00:00", 100.75, ["pass"])
    for docs in ([first, later], [later, first]):
        assert [r["status"] for r in results.merge(docs)["records"]] == ["pass"]


def test_incompleteness_is_judged_on_the_merged_units(tmp_path, capsys):
    """A killed run merged with a run that finished every unit it did not, and a stopped
    bench labelled with the host name (as a run without --label is), marked the
    verdicts of the whole run "(incomplete run: not every check ran)" (found by a
    review). A verdict is incomplete where a unit of it is unfinished in the merge."""
    whole = _doc("same", T1, 1.0, ["pass"] * 2, host="h")
    killed = _doc("same", T2, 2.0, ["pass"], host="h",
                  not_reached=[("b", "F2.values", "float32")])
    rc, out, err, page = _report(tmp_path, capsys, whole=whole, killed=killed)
    assert rc == 0 and "(incomplete" not in page, err
    assert "another run in this report finished every one of them" in page
    bench = {**_doc("same", T2, 2.0, [], host="h"), "backends": [],
             "benchmarks": [{"backend": "b", "op": "layer_norm", "dtype": "float32",
                             "shape": [4, 8], "pass": "forward"}]}
    bench["runs"][0].update(complete=False, stopped_by="SIGINT")
    rc, out, err, page = _report(tmp_path, capsys, whole=whole, bench=bench)
    assert rc == 0 and "(incomplete" not in page, err
    alone = _doc("same", T2, 2.0, ["pass"], host="h",
                 not_reached=[("b", "F2.values", "float32"), ("b", "F3.values", "float32")])
    rc, out, err, page = _report(tmp_path, capsys, alone=alone)
    assert "(incomplete: 2 unit(s) of it not finished" in page  # (and without: still said)


def test_a_stream_without_an_end_line_may_be_a_run_in_progress(tmp_path):
    """`normspec report` on a run still running said it was "killed"."""
    path = tmp_path / "r.jsonl"
    _written_stream(path, 2)
    path.write_bytes(b"\n".join(path.read_bytes().split(b"\n")[:-2]) + b"\n")  # (no end)
    run = results.read(path)["runs"][0]
    assert run["stopped_by"] == "not finished: still running, or killed (the stream has no end line)"
    assert run["complete"] is False


def test_each_tolerance_table_is_shown_with_the_runs_that_used_it(tmp_path, capsys):
    """A merged report showed the first file's tolerance table alone, though another run
    used another (found by a review)."""
    old = {**_doc("old", T1, 1.0, ["pass"], host="h"),
           "tolerances": [{"quantity": "output", "base_ulps": 1.0, "reason": "first table"}]}
    new = {**_doc("new", T2, 2.0, ["pass"], host="h"),
           "tolerances": [{"quantity": "output", "base_ulps": 2.0, "reason": "second table"}]}
    same = {**_doc("again", T2, 3.0, ["pass"], host="h"), "tolerances": new["tolerances"]}
    rc, out, err, page = _report(tmp_path, capsys, old=old, new=new, same=same)
    assert rc == 0, err
    assert "Tolerance tables (2: the runs used different ones)" in page
    assert f"Used by old ({T1}): quantity" in page and "first table" in page
    assert f"Used by new ({T2}), again ({T2}): quantity" in page and "second table" in page
