"""The HTML report: parsed (the matrix, every failure, no external URL), merged from
several runs, and rendered in headless Chromium, whose screenshot must not be blank."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from normspec.conformance import cli, results, runner
from normspec.conformance.claims import claim_text
from normspec.reports import html

CHECKS = ["F2.values", "B1.layer_norm_shift", "F3.values", "F4.running_stats"]


class Page(HTMLParser):
    """Collects tables (as rows of cell texts), attribute URLs and all text."""

    def __init__(self):
        super().__init__()
        self.tables, self.urls, self.text = [], [], []
        self._row, self._cell = None, None

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action") and value:
                self.urls.append(value)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Two runs, as two tox envs would write them: one with a broken backend."""
    out = tmp_path_factory.mktemp("results")
    good = runner.run(["numpy"], checks=CHECKS, dtypes=["float32", "float16"], examples=3,
                      label="env-good")
    bad = runner.run(["broken_backends:NaiveVariance"], checks=CHECKS,
                     dtypes=["float32", "float16"], examples=3, label="env-broken")
    results.write(good, out / "good.json")
    results.write(bad, out / "bad.json")
    report = out / "conformance.html"
    assert cli.main(["report", str(out), "-o", str(report)]) == 0
    return good, bad, report


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_matrix_has_every_check_and_both_runs(merged):
    good, bad, report = merged
    page = parse(report)
    matrix = next(t for t in page.tables if t and t[0] and t[0][0] == "check")
    assert sorted(matrix[0][1:]) == ["NaiveVariance", "numpy"]
    check_rows = {row[0] for row in matrix[2:]}
    assert set(CHECKS) <= check_rows
    symbols = {cell.split()[0] for row in matrix[2:] if row[0] in CHECKS for cell in row[1:] if cell}
    assert {"✓", "✗"} <= symbols
    # magnitudes: a passing measured cell shows its error as a fraction of the bound (< 1),
    # a failing one a multiple of it (> 1)
    magnitudes = {cell.split()[0]: float(cell.split()[-1]) for row in matrix[2:]
                  if row[0] == "B1.layer_norm_shift" for cell in row[1:] if len(cell.split()) == 2}
    assert magnitudes["✓"] < 1 < magnitudes["✗"]


def test_cells_link_to_their_findings(merged):
    _, _, report = merged
    raw = report.read_text(encoding="utf-8")
    links = set(re.findall(r'href="#(finding-\d+)"', raw))
    assert links and all(f'id="{a}"' in raw for a in links)


def test_a_cell_with_a_refusal_and_a_pass_shows_both():
    from normspec.reports.html import _cell

    recs = [{"status": "refused", "max_ulp": None, "bound_ulp": None},
            {"status": "pass", "max_ulp": 0.5, "bound_ulp": 2.0}]
    cell = _cell(recs, {id(recs[0]): "finding-3"})
    assert cell["text"] == "⊘ ✓ 0.25" and cell["href"] == "#finding-3"


def test_every_failure_is_in_the_report(merged):
    _, bad, report = merged
    text = " ".join(parse(report).text)
    failures = [r for r in bad["records"] if r["status"] == "fail"]
    assert failures, "the broken backend must fail something"
    for r in failures:
        assert r["message"][:120] in text
    assert "B1" in text and claim_text("B1")[:60] in text
    assert "env-broken" in text and "env-good" in text


def test_the_report_needs_no_network(merged):
    _, _, report = merged
    page = parse(report)
    assert [] == [u for u in page.urls if not u.startswith("#")]
    raw = report.read_text(encoding="utf-8")
    assert re.search(r"url\(\s*['\"]?https?:", raw) is None
    assert "<script src" not in raw and "<link " not in raw


def test_summary_matches_the_json(merged, capsys):
    _, bad, _ = merged
    cli.print_summary(bad)
    out = capsys.readouterr().out
    fails = sum(r["status"] == "fail" for r in bad["records"])
    assert f"{fails} failing record(s) (" in out


def test_a_message_cut_for_the_console_says_so(capsys):
    """A line cut mid-word with no mark read as the whole message (found by a new user)."""
    long = "got x, but the spec says " + "y" * 400
    doc = {"backends": [], "runs": [], "records": [
        {"backend": "b", "check": "F2.values", "dtype": "float32", "case": "c", "status": "fail",
         "message": long, "diagnosis": {}}]}
    cli.print_summary(doc)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  [fail]"))
    assert line.endswith("...") and long[:cli.CONSOLE_TEXT - 5] in line and long not in line


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    message = "headless Chromium is needed (Debian: apt-get install chromium)"
    if os.environ.get("CI"):
        pytest.fail(message + "; .ci/run installs it")
    pytest.skip(message)


def screenshot_pixels(report: Path, tmp_path: Path, width: int = 1280) -> np.ndarray:
    """The report rendered by headless Chromium, as a grey-level pixel array."""
    shot = tmp_path / "shot.png"
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
           f"--window-size={width},1600", f"--screenshot={shot}", report.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), proc.stderr[-2000:]
    from PIL import Image

    return np.asarray(Image.open(shot).convert("L"), dtype=np.float64)


def test_report_renders_in_headless_chromium(merged, tmp_path):
    _, _, report = merged
    pixels = screenshot_pixels(report, tmp_path, width=1400)
    assert pixels.shape[0] > 500 and pixels.shape[1] >= 1400
    assert pixels.std() > 10, "the screenshot is blank"
    assert len(np.unique(pixels)) > 30, "the screenshot has almost no content"


def _counts_shown(page: str) -> tuple[Counter, Counter, Counter]:
    """What a report says the records are, three ways: the header's counts, the verdict
    rows' summed, the matrix cells' (their hover titles) summed."""
    head = re.search(r"(\d+) records from \d+ run\(s\):\s*(.*?)\.\s*Legend", page, re.S)
    header = Counter({s: int(n) for n, s in re.findall(r"(\d+) (\w+)", head.group(2))})
    verdicts = Counter()
    section = page[page.index('id="verdicts"'):page.index('id="matrix"')]
    for row in re.findall(r"<tr><td>.*?</tr>", section, re.S):
        numbers = re.findall(r'<td class="[^"]*">(\d+)</td>', row)
        verdicts.update(dict(zip(results.STATUSES, map(int, numbers), strict=True)))
    matrix = Counter()
    for title in re.findall(r'<td class="cell \w+" title="([^"]*)"', page):
        matrix.update({s: int(n) for n, s in re.findall(r"(\d+) (\w+)", title.split(";")[0])})
    return +header, +verdicts, +matrix


def _record(backend, run, status, check="F2.values", dtype="float32", case="x"):
    return {"backend": backend, "check": check, "claim": check.split(".")[0], "op": "layer_norm",
            "dtype": dtype, "case": case, "status": status, "run": run}


def test_the_header_the_verdicts_and_the_matrix_count_every_record(merged, tmp_path):
    """A backend that did not load (--record-unavailable) had its load error in the
    header's count and in no verdict row (looked up as "name (label)", counted as
    "name") nor in the matrix (found by a review). Merged with runs of two labels, a
    re-run that supersedes, and a record whose backend no file lists: every record is
    counted once, in the header, the rows of its backend and the matrix alike."""
    good, bad, _ = merged
    run = {"run": "env-good", "id": "x", "created": "2026-12-02T05:00:00+00:00",
           "host": good["runs"][0]["host"]}
    gone = {**results.new_document(), "runs": [run],
            "backends": [{"name": "gone:make", "available": False, "run": "env-good",
                          "error": "ModuleNotFoundError"}],
            "records": [_record("gone:make", "env-good", "error", "load", "-"),
                        _record("numpy", "env-good", "fail", "F2.values", "float32"),
                        _record("unlisted", "env-good", "pass")]}
    docs = [good, bad, gone]
    out = tmp_path / "r.html"
    html.write_report(docs, out)
    header, verdicts, matrix = _counts_shown(out.read_text(encoding="utf-8"))
    kept = results.merge([results.validate(json.loads(results.dumps(d))) for d in docs])
    assert kept["superseded"]  # (the later numpy F2.values float32 displaced the first)
    assert header == verdicts == matrix == Counter(r["status"] for r in kept["records"])
    assert header["error"] >= 1


def test_a_record_without_a_run_label_counts_in_its_files_run():
    """Records written without their run's label (a record's `run` is optional in the
    format) are the file's one run's: its backend's row counts them, in one column."""
    doc = {**results.new_document(), "runs": [{"run": "r"}],
           "backends": [{"name": "b", "available": True, "run": "r"}],
           "records": [{k: v for k, v in _record("b", "r", "fail").items() if k != "run"}]}
    context = html.build_context(results.merge([results.validate(doc)]))
    assert context["columns"] == ["b"]
    assert [(v["column"], v["counts"]) for v in context["verdicts"]] == [("b", {"fail": 1})]


def test_rendering_leaves_the_documents_as_they_were(merged, tmp_path):
    """The run renders its report from the document it then summarizes and counts for
    its exit code: the render must not change it (it copies only the document's lists,
    not every record, so this holds what that relies on), non-finite measures as written
    ("inf") included."""
    good, bad, _ = merged
    odd = {**results.new_document(), "runs": [{"run": "odd"}],
           "backends": [{"name": "b", "available": True, "run": "odd"}],
           "records": [{**_record("b", "odd", "fail"), "max_ulp": "inf", "run": ""}]}
    docs = [good, bad, odd]
    before = json.loads(json.dumps(docs))
    html.write_report(docs, tmp_path / "r.html")
    assert json.loads(json.dumps(docs)) == before
