"""The `normspec` command: backends, checks, run, report, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from normspec.impls import registry

from . import results, runner

DEFAULT_JSON = "results/results.json"
DEFAULT_HTML = "reports/conformance.html"


def _print_table(rows: list[list[str]], out=None) -> None:
    out = out or sys.stdout
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for n, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip(), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)


# ------------------------------------------------------------------ backends
def cmd_backends(args) -> int:
    entries = [runner.backend_entry(lb, "local") for lb in registry.load_all()]
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    for e in entries:
        state = "available" if e["available"] else f"unavailable: {e['error']}"
        print(f"{e['name']}  ({e['source']})")
        print(f"  version:     {e['version'] or '-'}")
        print(f"  status:      {state}")
        if e["available"]:
            caps, conv = e["capabilities"], e["conventions"]
            print(f"  ops:         {', '.join(caps.get('ops', []))}")
            print(f"  dtypes:      {', '.join(caps.get('dtypes', []))}")
            print(f"  gradients:   {', '.join(caps.get('gradients', [])) or '-'}")
            print(f"  no-grad mode: {caps.get('no_grad_mode')}, momentum=None: "
                  f"{caps.get('cumulative_momentum')}, track_running_stats=False: "
                  f"{caps.get('untracked_stats')}")
            print(f"  default eps: {conv.get('default_eps')}")
            print(f"  momentum:    {conv.get('native_momentum')}")
            print(f"  running var: {conv.get('running_var_estimator')}")
            print(f"  eps = 0:     {conv.get('eps_zero')}")
            print(f"  half compute: {conv.get('half_compute_dtype')}")
            if e["deviations"]:
                print(f"  deviations:  {len(e['deviations'])} documented")
        print()
    return 0


def cmd_checks(args) -> int:
    rows = [["check", "claim", "ops", "title"]]
    for c in runner.select_checks(None):
        rows.append([c.id, c.claim, ",".join(c.ops) or "all", c.title])
    _print_table(rows)
    return 0


# ------------------------------------------------------------------ run
def _run_one(kwargs: dict) -> dict:
    """One backend in a worker process (spawned: no framework state is inherited)."""
    progress = print if kwargs.pop("verbose") else None
    return runner.run(progress=lambda m: progress(m, flush=True) if progress else None, **kwargs)


def run_all(args) -> dict:
    names = args.backend or None
    common = dict(checks=args.check or None, dtypes=args.dtype or None, seed=args.seed,
                  examples=args.examples, timeout=args.timeout, label=args.label,
                  shrink=args.shrink, verbose=not args.quiet)
    if args.jobs <= 1:
        return _run_one(dict(common, backends=names))
    wanted = names if names is not None else list(registry.discover())
    doc = results.new_document()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(_run_one, [dict(common, backends=[n]) for n in wanted]))
    for key in ("backends", "records"):
        for part in parts:
            doc[key].extend(part[key])
    doc["runs"] = parts[0]["runs"][:1] if parts else []
    doc["tolerances"] = parts[0]["tolerances"] if parts else []
    if names is None:  # unavailable backends found by discovery are listed, not failed
        doc["records"] = [r for r in doc["records"] if r["check"] != "load"]
    return doc


def print_summary(doc: dict, out=None) -> int:
    """The per-backend status table and every failure; returns the number failing."""
    out = out or sys.stdout
    counts = results.summarize(doc["records"])
    rows = [["backend", "version", *results.STATUSES, "verdict"]]
    for b in doc["backends"]:
        c = counts.get(b["name"], {})
        if not b["available"]:
            rows.append([b["name"], "-", *["-"] * len(results.STATUSES),
                         f"unavailable: {str(b['error'])[:60]}"])
            continue
        failing = sum(c.get(s, 0) for s in results.FAILING)
        verdict = "conforms" if failing == 0 else f"{failing} failing"
        if c.get("deviation"):
            verdict += f", {c['deviation']} documented deviations"
        rows.append([b["name"], b["version"][:28], *[c.get(s, 0) for s in results.STATUSES], verdict])
    print(file=out)
    _print_table(rows, out)
    bad = [r for r in doc["records"] if r["status"] in results.FAILING]
    if bad:
        print(f"\n{len(bad)} failing record(s):", file=out)
        for r in bad:
            print(f"  [{r['status']}] {r['backend']} {r['check']} {r['dtype']} ({r['case']}): "
                  f"{r['message'][:300]}", file=out)
    return len(bad)


def cmd_run(args) -> int:
    start = time.perf_counter()
    try:
        doc = run_all(args)
    except ValueError as exc:  # a bad --check or --dtype: the user's to fix
        print(f"normspec run: {exc}", file=sys.stderr)
        return 2
    doc["runs"][0]["duration_s"] = round(time.perf_counter() - start, 1)
    json_path = results.write(doc, args.json)
    failing = print_summary(doc)
    print(f"\nresults: {json_path}  ({len(doc['records'])} records, "
          f"{doc['runs'][0]['duration_s']} s)")
    if not args.no_html:
        from normspec.reports import html

        html_path = html.write_report([doc], args.html)
        print(f"report:  {html_path}")
    return 1 if failing else 0


# ------------------------------------------------------------------ report
def cmd_report(args) -> int:
    from normspec.reports import html

    docs, files = [], []
    for f in map(Path, args.files):
        # a folder stands for every results file in it (tox envs write to one folder)
        files += sorted(f.glob("*.json")) if f.is_dir() else [f]
    if not files:
        print(f"normspec report: no results files in {' '.join(args.files)}", file=sys.stderr)
        return 2
    for f in files:
        try:
            docs.append(results.read(f))
        except (OSError, ValueError) as exc:
            print(f"normspec report: cannot read {f}: {exc}", file=sys.stderr)
            return 2
    path = html.write_report(docs, args.output)
    print(f"report: {path} ({len(docs)} result file(s), "
          f"{sum(len(d['records']) for d in docs)} records)")
    return 0


# ------------------------------------------------------------------ bench
def cmd_bench(args) -> int:
    from . import bench

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="normspec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("backends", help="list every backend found, with capabilities")
    b.add_argument("--json", action="store_true", help="print JSON instead of text")
    b.set_defaults(fn=cmd_backends)

    c = sub.add_parser("checks", help="list the conformance checks and their claim ids")
    c.set_defaults(fn=cmd_checks)

    r = sub.add_parser("run", help="run the conformance checks, write JSON and HTML")
    r.add_argument("--backend", action="append", metavar="NAME|module:factory",
                   help="backend to check (repeatable); default: every backend found")
    r.add_argument("--check", action="append", metavar="ID",
                   help="check id or claim id prefix (repeatable), e.g. F2 or B1.layer_norm_shift")
    r.add_argument("--dtype", action="append", choices=["float32", "float16", "bfloat16", "float64"],
                   help="dtype (repeatable); default: all four")
    r.add_argument("--json", default=DEFAULT_JSON, help=f"results path (default {DEFAULT_JSON})")
    r.add_argument("--html", default=DEFAULT_HTML, help=f"report path (default {DEFAULT_HTML})")
    r.add_argument("--no-html", action="store_true", help="write the JSON only")
    r.add_argument("--seed", type=int, default=0, help="Hypothesis seed, recorded (default 0)")
    r.add_argument("--examples", type=int, default=10,
                   help="Hypothesis examples per drawn case (default 10)")
    r.add_argument("--timeout", type=float, default=120.0,
                   help="seconds one check may take on one backend and dtype (default 120)")
    r.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="backends checked in parallel processes (default: cores)")
    r.add_argument("--label", default=None, help="run label in the results (default: tox env "
                   "or host name)")
    r.add_argument("--shrink", action="store_true", help="let Hypothesis shrink failures")
    r.add_argument("--quiet", action="store_true", help="no per-check progress lines")
    r.set_defaults(fn=cmd_run)

    rep = sub.add_parser("report", help="merge results JSON files into one HTML report")
    rep.add_argument("files", nargs="+", help="results JSON files, or folders of them")
    rep.add_argument("-o", "--output", default=DEFAULT_HTML)
    rep.set_defaults(fn=cmd_report)

    be = sub.add_parser("bench", help="benchmark every backend against a memory copy")
    be.add_argument("--backend", action="append")
    be.add_argument("--json", default="results/bench.json")
    be.add_argument("--quick", action="store_true", help="small shapes only")
    be.set_defaults(fn=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `normspec checks | head`: the reader left, nothing is wrong
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
