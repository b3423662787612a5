"""The HTML conformance report: results JSON (one file or many, merged) in, one
self-contained HTML file out. It knows the results schema and nothing about frameworks
or the oracle. Jinja2 with autoescape renders it; matplotlib draws the plots as inline
SVG, so the file opens from disk with no network."""

from __future__ import annotations

import copy
import io
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

import jinja2
from normspec.conformance import results
from normspec.conformance.claims import CLAIMS, claim_text

STATUS_ORDER = ("fail", "error", "deviation", "refused", "unsupported", "pass")
SYMBOL = {"pass": "✓", "fail": "✗", "deviation": "≈", "refused": "⊘", "unsupported": "–",
          "error": "!"}


def _worst_status(statuses) -> str:
    for s in STATUS_ORDER:
        if s in statuses:
            return s
    return "unsupported"


def _column_keys(doc) -> list[str]:
    """One column per backend; a backend seen in several runs gets one per run."""
    runs_of = defaultdict(list)
    for b in doc["backends"]:
        if b["run"] not in runs_of[b["name"]]:
            runs_of[b["name"]].append(b["run"])
    keys = []
    for b in doc["backends"]:
        if not b["available"]:
            continue  # listed in the verdicts with the reason; no column of empty cells
        key = b["name"] if len(runs_of[b["name"]]) == 1 else f"{b['name']} ({b['run']})"
        if key not in keys:
            keys.append(key)
    return keys


def _record_column(rec, doc) -> str:
    runs = {b["run"] for b in doc["backends"] if b["name"] == rec["backend"]}
    return rec["backend"] if len(runs) <= 1 else f"{rec['backend']} ({rec['run']})"


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


def error_plot(doc) -> str | None:
    """Worst error per record as a fraction of its bound, per backend and dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = defaultdict(list)
    for r in doc["records"]:
        if r.get("max_ulp") is None or r.get("bound_ulp") in (None, 0):
            continue
        ratio = float(r["max_ulp"]) / float(r["bound_ulp"])
        ratio = 1e6 if not math.isfinite(ratio) else ratio  # inf and NaN at the top edge
        groups[(r["backend"], r["dtype"])].append(max(ratio, 1e-4))
    if not groups:
        return None
    labels = sorted(groups)
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(labels)), 3.6))
    ax.boxplot([groups[k] for k in labels], showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), [f"{b}\n{d}" for b, d in labels], fontsize=7)
    ax.set_yscale("log")
    ax.axhline(1.0, color="#c0392b", lw=1, ls="--")
    ax.set_ylabel("worst error / bound (log)")
    ax.set_title("Error per record relative to its tolerance bound (above the line fails)")
    return _figure_svg(fig)


def bench_plot(doc) -> str | None:
    """Effective bandwidth of each benchmark beside the memory copy of the same bytes."""
    rows = [b for b in doc.get("benchmarks", []) if b.get("gbps")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{b['backend']} {b['op']} {b['pass']}\n{b['dtype']} {b['shape']}" for b in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows)), 4))
    xs = range(len(rows))
    ax.bar(xs, [b["gbps"] for b in rows], color="#2e86c1", label="backend")
    ax.scatter(xs, [b["copy_gbps"] for b in rows], color="#c0392b", marker="_", s=300,
               label="memory copy, same bytes", zorder=3)
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
    ax.set_ylabel("GB/s (bytes read + written / time)")
    ax.legend(fontsize=8)
    ax.set_title("Effective bandwidth against the memory-copy limit (one run)")
    return _figure_svg(fig)


def build_context(doc: dict) -> dict:
    columns = _column_keys(doc)
    dtypes = [d for d in results.DTYPES
              if any(r["dtype"] == d for r in doc["records"])]
    cells = defaultdict(lambda: defaultdict(list))
    titles = {}
    for r in doc["records"]:
        cells[r["check"]][(_record_column(r, doc), r["dtype"])].append(r["status"])
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
            row = {"check": check_id, "cells": []}
            for col in columns:
                for d in dtypes:
                    sts = cells[check_id].get((col, d), [])
                    c = Counter(sts)
                    worst = _worst_status(c) if sts else None
                    row["cells"].append({
                        "status": worst or "none", "symbol": SYMBOL.get(worst, ""),
                        "title": ", ".join(f"{n} {s}" for s, n in c.items()) or "not run"})
            rows.append(row)
        matrix.append({"claim": claim, "text": claim_text(claim), "rows": rows})
    counts = defaultdict(Counter)
    for r in doc["records"]:
        counts[_record_column(r, doc)][r["status"]] += 1
    verdicts = []
    incomplete = {run["run"] for run in doc["runs"] if not run.get("complete", True)}
    for b in doc["backends"]:
        col = b["name"] if b["name"] in columns else f"{b['name']} ({b['run']})"
        c = counts[col]
        failing = c["fail"] + c["error"]
        if not b["available"]:
            line = f"unavailable: {b['error']}"
        elif failing:
            line = f"does not conform: {failing} failing record(s)"
        else:
            line = "conforms to every check it supports"
        if b["available"] and c["deviation"]:
            line += f"; {c['deviation']} documented deviation(s)"
        if b["run"] in incomplete:
            line += " (incomplete run: not every check ran)"
        verdicts.append({"column": col, "backend": b, "counts": dict(c), "line": line,
                         "failing": failing})
    findings = [dict(r, claim_text=claim_text(r["claim"]))
                for r in doc["records"] if r["status"] in ("fail", "error", "deviation", "refused")]
    findings.sort(key=lambda r: (STATUS_ORDER.index(r["status"]), r["backend"], r["check"]))
    return {"doc": doc, "columns": columns, "dtypes": dtypes, "matrix": matrix,
            "verdicts": verdicts, "findings": findings, "statuses": results.STATUSES,
            "symbols": SYMBOL, "error_svg": error_plot(doc), "bench_svg": bench_plot(doc),
            "total": Counter(r["status"] for r in doc["records"])}


def render(docs: list[dict]) -> str:
    env = jinja2.Environment(loader=jinja2.PackageLoader("normspec.reports", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]),
                             undefined=jinja2.StrictUndefined)
    # in-memory documents hold records as written (inf as "inf"): read them as numbers
    doc = results.merge([results.validate(copy.deepcopy(d), "results") for d in docs])
    return env.get_template("report.html.j2").render(**build_context(doc))


def write_report(docs: list[dict], path) -> Path:
    """Render, then write atomically: a failed render leaves no half-written file."""
    path = Path(path)
    page = render(docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
