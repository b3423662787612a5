"""The HTML conformance report: results JSON (one file or many, merged) in, one
self-contained HTML file out. It knows the results schema and nothing about frameworks
or the oracle. Jinja2 with autoescape renders it; matplotlib draws the plots as inline
SVG, so the file opens from disk with no network."""

from __future__ import annotations

import html as html_text
import io
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

import jinja2
import numpy as np
from normspec.conformance import results
from normspec.conformance.claims import CLAIMS, claim_text

from .bench_plots import bench_plot, curve_plot

STATUS_ORDER = ("fail", "error", "deviation", "refused", "unsupported", "pass")
SYMBOL = {"pass": "✓", "fail": "✗", "deviation": "≈", "refused": "⊘", "unsupported": "–",
          "error": "!"}


def _worst_status(statuses) -> str:
    for s in STATUS_ORDER:
        if s in statuses:
            return s
    return "unsupported"


def _column_namer(doc):
    """(backend name, run label) -> its column: the name, or "name (label)" where the
    name is seen under several labels, in the backends or in the records. The verdicts,
    the columns and the cells all name a backend so: the verdict of a backend that did
    not load looked its records up under another key than they were counted under, and
    showed none of them (found by a review)."""
    labels = defaultdict(set)
    for b in doc["backends"]:
        labels[b["name"]].add(b["run"])
    for r in doc["records"]:
        labels[r["backend"]].add(r["run"])
    return lambda name, run: name if len(labels[name]) <= 1 else f"{name} ({run})"


def _column_keys(doc, column) -> list[str]:
    """One column per backend and run label with records, or available: a backend that
    did not load has one only for its load error, which is then in the matrix too."""
    keys = []
    for name, run in [(b["name"], b["run"]) for b in doc["backends"] if b["available"]] + \
            [(r["backend"], r["run"]) for r in doc["records"]]:
        if column(name, run) not in keys:
            keys.append(column(name, run))
    return keys


def _dtypes(doc) -> list[str]:
    """The dtype columns: the known dtypes that have records, in order, then any other a
    record names ("-" of a load error), so that every record has a cell."""
    named = {r["dtype"] for r in doc["records"]}
    return [d for d in results.DTYPES if d in named] + sorted(named - set(results.DTYPES))


def _clean_svg(svg: str) -> str:
    svg = re.sub(r"<\?xml[^>]*>", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg)
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    return svg.strip()


def _figure_svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return _clean_svg(buf.getvalue())


def _drawn(plot, *args) -> str | None:
    """A plot's SVG, or a line saying why it could not be drawn: the records are the
    report, and a plot that fails on what a backend named itself (matplotlib refuses a
    lone surrogate) must not cost the page."""
    try:
        return plot(*args)
    except Exception as exc:  # noqa: BLE001 - any failure of the drawing library
        import matplotlib.pyplot as plt

        plt.close("all")
        return (f'<p class="muted">This plot could not be drawn '
                f"({html_text.escape(type(exc).__name__)}: {html_text.escape(str(exc)[:300])})."
                "</p>")


def _ratio(r) -> float | None:
    """A record's worst error as a fraction of its bound; inf past a bound of 0 or for
    inf/NaN errors; None when it measured nothing."""
    if r.get("max_ulp") is None or r.get("bound_ulp") is None:
        return None
    err, bnd = float(r["max_ulp"]), float(r["bound_ulp"])
    if not math.isfinite(err):
        return math.inf
    if bnd <= 0:
        return math.inf if err > 0 else 0.0
    return err / bnd


#: How each status is drawn in the error plot (colour, marker): a point's status is its
#: verdict, so a deviation far above the line never reads as an unexplained failure.
PLOT_STYLE = {"pass": ("#2da44e", "o"), "fail": ("#cf222e", "x"), "deviation": ("#bf8700", "^"),
              "error": ("#8250df", "s")}


def error_plot(doc) -> str | None:
    """Worst error per record as a fraction of its bound, per backend and dtype, each
    point drawn by its status."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = defaultdict(list)
    labels = set()
    for r in doc["records"]:
        ratio = _ratio(r)
        if ratio is None or r["status"] not in PLOT_STYLE:
            continue
        ratio = 1e9 if not math.isfinite(ratio) else max(ratio, 1e-4)  # inf at the top edge
        labels.add((r["backend"], r["dtype"]))
        points[r["status"]].append(((r["backend"], r["dtype"]), ratio))
    if not labels:
        return None
    order = sorted(labels)
    where = {k: i for i, k in enumerate(order)}
    fig, ax = plt.subplots(figsize=(min(13.5, max(6, 0.45 * len(order))), 3.8))
    rng = np.random.default_rng(0)  # a fixed jitter, so the same run draws the same picture
    for status, pts in points.items():
        colour, marker = PLOT_STYLE[status]
        xs = [where[k] + rng.uniform(-0.25, 0.25) for k, _ in pts]
        ax.scatter(xs, [v for _, v in pts], s=10, c=colour, marker=marker, alpha=0.6,
                   label=f"{status} ({len(pts)})", linewidths=0.8)
    ax.set_xticks(range(len(order)), [f"{b}\n{d}" for b, d in order], fontsize=7)
    ax.set_yscale("log")
    ax.axhline(1.0, color="#cf222e", lw=1, ls="--")
    ax.set_ylabel("worst error / bound (log)")
    ax.legend(fontsize=7, loc="upper left", ncol=4)
    ax.set_title("Error per record relative to its tolerance bound (above the line: beyond the "
                 "bound; a deviation is explained by a declared convention or entry)", fontsize=9)
    return _figure_svg(fig)


def _cell(records: list[dict], anchor: dict) -> dict:
    """One matrix cell: every status its records have (a refusal beside a pass shows
    both), the worst error relative to its bound, and a link to its first finding."""
    counts = Counter(r["status"] for r in records)
    if not records:
        return {"status": "none", "text": "", "title": "not run", "href": ""}
    worst = _worst_status(counts)
    shown = [s for s in STATUS_ORDER if counts.get(s) and s != "unsupported"] or ["unsupported"]
    ratios = [x for x in (_ratio(r) for r in records) if x is not None]
    magnitude = ""
    if ratios:
        top = max(ratios)
        magnitude = "inf" if not math.isfinite(top) else (f"{top:.2g}" if top < 10 else f"{top:.0f}")
    text = " ".join(SYMBOL[s] for s in shown) + (f" {magnitude}" if magnitude else "")
    title = ", ".join(f"{n} {s}" for s, n in counts.items())
    if magnitude:
        title += f"; worst error {magnitude} x its bound"
    found = [anchor[id(r)] for r in records if id(r) in anchor]
    return {"status": worst, "text": text, "title": title,
            "href": f"#{found[0]}" if found else ""}


def build_context(doc: dict) -> dict:
    column = _column_namer(doc)
    columns = _column_keys(doc, column)
    dtypes = _dtypes(doc)
    findings = [r for r in doc["records"] if r["status"] in ("fail", "error", "deviation", "refused")]
    findings.sort(key=lambda r: (STATUS_ORDER.index(r["status"]), r["backend"], r["check"]))
    anchor = {id(r): f"finding-{i}" for i, r in enumerate(findings)}
    cells = defaultdict(lambda: defaultdict(list))
    titles = {}
    for r in doc["records"]:
        cells[r["check"]][(column(r["backend"], r["run"]), r["dtype"])].append(r)
        titles.setdefault(r["check"], r)
    claims = defaultdict(list)
    for check_id, rec in titles.items():
        claims[rec["claim"]].append(check_id)
    order = list(CLAIMS) + sorted(c for c in claims if c not in CLAIMS)
    matrix = []
    for claim in order:
        if claim not in claims:
            continue
        rows = []
        for check_id in claims[claim]:
            rows.append({"check": check_id,
                         "cells": [_cell(cells[check_id].get((col, d), []), anchor)
                                   for col in columns for d in dtypes]})
        matrix.append({"claim": claim, "text": claim_text(claim), "rows": rows,
                       "anchor": "claim-" + claim.replace("/", "-"), "detail": CLAIMS.get(claim)})
    findings = [dict(r, claim_text=claim_text(r["claim"]), anchor=anchor[id(r)]) for r in findings]
    unfinished = doc.get("unfinished", [])
    tables = doc.get("tolerance_tables") or (
        [{"rows": doc["tolerances"], "runs": []}] if doc["tolerances"] else [])
    return {"doc": doc, "columns": columns, "dtypes": dtypes, "matrix": matrix,
            "verdicts": _verdicts(doc, column, unfinished), "findings": findings,
            "statuses": results.STATUSES, "stopped": _stopped_runs(doc, unfinished),
            "incomplete": _incomplete_notice(unfinished), "tolerance_tables": tables,
            "symbols": SYMBOL, "error_svg": _drawn(error_plot, doc),
            "bench_svg": _drawn(bench_plot, doc, _figure_svg),
            "curve_svg": _drawn(curve_plot, doc, _figure_svg),
            "total": Counter(r["status"] for r in doc["records"])}


def _verdicts(doc: dict, column, unfinished: list[dict]) -> list[dict]:
    """One row per backend and run label, with the counts of its records: every record
    is counted in the row of its backend, a load error's in its unavailable backend's
    row, and a record whose backend no file lists in a row of its own (the header's
    counts, the rows' and the matrix's agree). Incompleteness is judged on the merged
    units (`unfinished`), not per file: a killed run merged with a run that finished its
    units is whole, and a stopped bench says nothing of the checks of its label."""
    counts: dict[tuple, Counter] = defaultdict(Counter)
    for r in doc["records"]:
        counts[(r["backend"], r["run"])][r["status"]] += 1
    open_units = Counter((u["backend"], u["run"]) for u in unfinished)
    damaged: Counter = Counter()
    for run in doc["runs"]:
        damaged[run["run"]] += len(run.get("unreadable_lines") or [])
    partial = doc.get("missing_shards", {})
    entries = list(doc["backends"])
    listed = {(b["name"], b["run"]) for b in entries}
    entries += [{**results.BACKEND_DEFAULTS, "name": name, "run": run, "available": True,
                 "unlisted": True} for name, run in counts if (name, run) not in listed]
    verdicts = []
    for b in entries:
        c = counts[(b["name"], b["run"])]
        failing = c["fail"] + c["error"]
        if not b["available"]:
            line = f"unavailable: {b['error']}"
        elif failing:
            line = f"does not conform: {failing} failing record(s)"
        else:
            line = "conforms to every check it supports"
        if b["available"] and c["deviation"]:
            line += f"; {c['deviation']} documented deviation(s)"
        if b.get("unlisted"):
            line += " (its files do not list this backend: only its records are known)"
        if open_units[(b["name"], b["run"])]:
            line += (f" (incomplete: {open_units[(b['name'], b['run'])]} unit(s) of it not "
                     "finished or with no record, listed above)")
        if b["run"] in partial:
            line += f" (shard(s) {', '.join(partial[b['run']])} of its run are not in this report)"
        if damaged[b["run"]]:
            line += (f" ({damaged[b['run']]} line(s) of its run's stream could not be read: "
                     "records may be missing)")
        verdicts.append({"column": column(b["name"], b["run"]), "backend": b, "counts": dict(c),
                         "line": line, "failing": failing})
    return verdicts


def _stopped_runs(doc: dict, unfinished: list[dict]) -> list[dict]:
    """The runs that did not finish, each with how many of its unreached units no other
    run here finished (`still_open`): the rest are whole in this report."""
    still = {(u["backend"], u["run"], u["check"], u["dtype"]) for u in unfinished}
    return [{"run": run, "still_open": sum((u[0], run["run"], u[1], u[2]) in still
                                           for u in run["not_reached"])}
            for run in doc["runs"] if not run.get("complete", True)]


def _incomplete_notice(unfinished: list[dict]) -> list[dict]:
    """The merge's unfinished units, one entry per backend and run label: how many were
    not finished, how many have no record though planned, and which."""
    groups: dict[tuple, dict] = {}
    for u in unfinished:
        g = groups.setdefault((u["backend"], u["run"]), {"backend": u["backend"], "run": u["run"],
                                                         "not_finished": [], "no_record": []})
        g[u["why"].replace(" ", "_")].append(f"{u['check']} {u['dtype']}")
    return list(groups.values())


def render(docs: list[dict], names: list[str] | None = None) -> str:
    env = jinja2.Environment(loader=jinja2.PackageLoader("normspec.reports", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]),
                             undefined=jinja2.StrictUndefined)
    # in-memory documents hold records as written (inf as "inf"): read them as numbers
    doc = results.merge([results.validate(results.top_copy(d), "results") for d in docs],
                        names)
    return env.get_template("report.html.j2").render(**build_context(doc))


def write_report(docs: list[dict], path, names: list[str] | None = None) -> Path:
    """Render, then write atomically: a failed render leaves no half-written file.
    `names`: the documents' files, which the report names where it leaves records of one
    out (results.merge)."""
    path = Path(path)
    page = render(docs, names)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    # a lone surrogate (a backend's bytes decoded with surrogateescape) as its escape
    tmp.write_text(page, encoding="utf-8", errors="backslashreplace")
    tmp.replace(path)
    return path
