"""The benchmark figures of the report, from the results' `benchmarks` only: the table's
measurements as % of the memory copy, and the cost curve over row widths. Only reliable
measurements are drawn (an unreliable one has no number, only its reason, which the
table beside the figures shows). "prepared" and "protocol" calls are told apart by the
hatching / line style and named in the legend."""

from __future__ import annotations

COLOURS = ["#2e86c1", "#d35400", "#16a085", "#8e44ad", "#7f8c8d", "#c0392b", "#2c3e50"]
VARIANT_NOTE = {"prepared": "prepared", "protocol": "protocol (fresh output)"}


def _reliable(doc, series) -> list[dict]:
    return [b for b in doc.get("benchmarks", [])
            if b.get("reliable") and b.get("of_copy") and series(b.get("series", "table"))]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _who(b: dict, runs: bool = False) -> tuple[str, ...]:
    """The line or bar series a row belongs to: backend and call, and its run where the
    figure draws several runs' rows (merged files), so no run's row hides another's."""
    return (b["backend"], b.get("variant", "prepared")) + ((b.get("run", ""),) if runs else ())


def _name(who: tuple[str, ...]) -> str:
    text = f"{who[0]} {VARIANT_NOTE.get(who[1], who[1])}"
    return f"{text}, run {who[2]}" if len(who) > 2 else text


def _several_runs(rows) -> bool:
    return len({b.get("run", "") for b in rows}) > 1


def _panel_grid(rows):
    """A figure with one panel per (op, pass) of `rows`, two columns, page-wide."""
    plt = _pyplot()
    panels = sorted({(b["op"], b["pass"]) for b in rows})
    cols = min(2, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(13, 3.4 * nrows), squeeze=False)
    return fig, axes, panels


def bench_plot(doc, to_svg) -> str | None:
    """% of the copy of the same bytes (each against the copy in its own process), one
    panel per op and pass, bars grouped by shape and dtype, one bar per backend and
    call; the 100% line is the memory limit."""
    rows = _reliable(doc, lambda s: s == "table")
    if not rows:
        return None
    fig, axes, panels = _panel_grid(rows)
    runs = _several_runs(rows)
    who = sorted({_who(b, runs) for b in rows})
    colours = dict(zip(sorted({w[0] for w in who}), COLOURS, strict=False))
    for ax, (op, pass_) in zip(axes.ravel(), panels, strict=False):
        mine = [b for b in rows if (b["op"], b["pass"]) == (op, pass_)]
        groups = sorted({(str(b["shape"]), b["dtype"]) for b in mine})
        width = 0.8 / max(1, len(who))
        for j, series in enumerate(who):
            named = False  # the series' first bar in this panel names it in the legend
            for i, g in enumerate(groups):
                hit = [b for b in mine if _who(b, runs) == series
                       and (str(b["shape"]), b["dtype"]) == g]
                if hit:
                    ax.bar(i + (j - len(who) / 2 + 0.5) * width, 100 * hit[0]["of_copy"], width,
                           color=colours.get(series[0], "#555"),
                           hatch="//" if series[1] == "protocol" else None, edgecolor="white",
                           label=None if named else _name(series))
                    named = True
        ax.axhline(100, color="#c0392b", lw=1.5, ls="--", label="memory copy")
        ax.set_xticks(range(len(groups)), [f"{sh}\n{dt}" for sh, dt in groups], fontsize=7)
        ax.set_title(f"{op}, {pass_}", fontsize=9)
        ax.set_ylabel("% of copy", fontsize=8)
        ax.legend(fontsize=6, ncol=3)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("Effective bandwidth (bytes read + written / time) as % of a memory copy of "
                 "the same bytes timed before and after it in the same process", fontsize=10)
    fig.tight_layout()
    return to_svg(fig)


def curve_plot(doc, to_svg) -> str | None:
    """The cost curve: % of copy against the row width (log scale) at constant total
    bytes, one panel per op and pass, a line per backend, call and total size."""
    rows = _reliable(doc, lambda s: s.startswith("curve"))
    if not rows:
        return None
    fig, axes, panels = _panel_grid(rows)
    runs = _several_runs(rows)
    lines = sorted({(_who(b, runs), b["series"], b["dtype"]) for b in rows})
    colours = dict(zip(sorted({w[0][0] for w in lines}), COLOURS, strict=False))
    sizes = sorted({s for _, s, _ in lines}, key=lambda s: int(s.split()[-1]))
    markers = dict(zip(sizes, "os^Dv", strict=False))
    # every width measured, reliably or not: one without a number is a gap, not gone
    widths = sorted({b["shape"][-1] for b in doc.get("benchmarks", [])
                     if b.get("series", "table").startswith("curve")})
    handles: dict = {}
    for ax, (op, pass_) in zip(axes.ravel(), panels, strict=False):
        for who, series, dtype in lines:
            got: dict = {}
            for b in rows:  # the first row of a width, as the bar plot takes
                if ((b["op"], b["pass"]) == (op, pass_) and b["series"] == series
                        and b["dtype"] == dtype and _who(b, runs) == who):
                    got.setdefault(b["shape"][-1], 100 * b["of_copy"])
            if not got:
                continue
            elements = int(series.split()[-1])
            label = f"{_name(who)}, {elements / 2**20:g}M {dtype} values"
            # a width without a reliable number is a gap in the line, not a straight
            # segment across it
            (line,) = ax.plot(widths, [got.get(w, float("nan")) for w in widths],
                              color=colours.get(who[0], "#555"),
                              ls="--" if who[1] == "protocol" else "-",
                              marker=markers.get(series, "o"), ms=4, lw=1.2)
            handles.setdefault(label, line)
        copy_line = ax.axhline(100, color="#c0392b", lw=1.5, ls=":")
        handles.setdefault("memory copy (100%)", copy_line)
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths], fontsize=7)
        ax.set_xlabel("row width d (rows = total / d)", fontsize=8)
        ax.set_ylabel("% of copy", fontsize=8)
        ax.set_title(f"{op}, {pass_}", fontsize=9)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=3, fontsize=7,
               bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(handles) + 2) // 3), 1, 0.96))
    fig.suptitle("Cost curve: % of the copy of the same bytes against the row width, "
                 "total bytes held constant", fontsize=10)
    return to_svg(fig)
