"""`normspec bench`: forward and forward+backward time of each backend, op and dtype, as
effective bandwidth beside a memory copy of the same bytes measured in the same run.

Normalization reads and writes every element once; a copy of the same bytes (torch
`Tensor.copy_`, multi-threaded) is the physical limit, so the ratio to it is the figure of
merit, and ratios between backends measured side by side are the only comparisons this
reports: never a bare time, the machine is shared and noisy.

Bytes counted: forward reads x and writes y (2 N D s); forward+backward also reads x and
g and writes dx (5 N D s in all); the parameter vectors are negligible.

A backend can offer `prepare_benchmark(op, x, normalized_shape, weight, bias, eps,
grad_output)` (grad_output None for a forward) returning a zero-argument callable on
arrays already in its own format, so conversions to and from NumPy are not timed;
without it the protocol call is timed, and
the record says so. What each callable includes is the adapter's to say in its
docstring: torch's functional ops allocate their output at every call (there is no `out=`
for layer_norm), which is what a torch user pays; the numba kernels write into buffers
allocated once, as the memory-copy baseline does.
"""

from __future__ import annotations

import platform
import statistics
import time

import numpy as np
from normspec.impls import registry

from . import results
from .cases import dtype_of
from .runner import run_info

SHAPES = {"full": [(8192, 4096), (2, 1 << 20), (256, 1000)], "quick": [(512, 1024), (2, 70_003)]}
OPS = ("layer_norm", "rms_norm")
DTYPES = ("float32", "float16", "bfloat16")
PASSES = ("forward", "forward+backward")


def _time(fn, repeat: int, budget_s: float = 2.0) -> float:
    """Median seconds of `fn` after two warm-up calls, at most `repeat` timed calls or
    about `budget_s` seconds of them."""
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
    return statistics.median(times)


def copy_seconds(nbytes: int, repeat: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    return _time(lambda: dst.copy_(src), repeat)


def _protocol_callable(backend, op, x, shape, w, b, eps, g):
    if op == "layer_norm":
        return lambda: backend.layer_norm(x, shape, w, b, eps, g)
    return lambda: backend.rms_norm(x, shape, w, eps, g)


def bench_one(loaded, op, dtype, shape, pass_, repeat, copy_cache) -> dict:
    backend = loaded.backend
    rec = {"backend": loaded.name, "op": op, "dtype": dtype, "shape": list(shape),
           "pass": pass_, "ms": None, "gbps": None, "copy_gbps": None, "of_copy": None,
           "vs_torch": None, "timed": "", "error": ""}
    caps = backend.capabilities
    if not caps.supports(op, dtype) or (pass_ != "forward" and not caps.has_gradient(op, dtype)):
        rec["error"] = "unsupported (capabilities)"
        return rec
    skip = backend.benchmark_skip_reason
    if skip:
        rec["error"] = f"not timed: {skip}"
        return rec
    dt = dtype_of(dtype)
    rng = np.random.default_rng(0)
    x = rng.normal(0.5, 2.0, size=shape).astype(dt)
    d = shape[-1]
    w, b = np.ones(d, dt), (np.zeros(d, dt) if op == "layer_norm" else None)
    backward = pass_ != "forward"
    # a random upstream gradient: with g = 1, dx is 0 up to rounding, and converting a
    # row of tiny numbers to float16 (subnormals) would time NumPy's slow path instead
    g = rng.normal(0.0, 1.0, size=shape).astype(dt) if backward else None
    try:
        fn = backend.prepare_benchmark(op, x, (d,), w, b, 1e-5, g)
        if fn is not None:
            rec["timed"] = "native call (prepare_benchmark)"
        else:
            fn = _protocol_callable(backend, op, x, (d,), w, b, 1e-5, g)
            rec["timed"] = "protocol call, NumPy conversions included"
        seconds = _time(fn, repeat)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run is reported
        rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec
    elem = int(np.prod(shape)) * dt.itemsize
    moved = elem * (5 if backward else 2)
    key = (moved,)
    if key not in copy_cache:
        copy_cache[key] = copy_seconds(moved // 2, repeat)
    rec["ms"] = seconds * 1e3
    rec["gbps"] = moved / seconds / 1e9
    rec["copy_gbps"] = moved / copy_cache[key] / 1e9
    rec["of_copy"] = rec["gbps"] / rec["copy_gbps"]
    return rec


def run_bench(backends=None, *, quick=False, repeat=10, progress=print) -> dict:
    doc = results.new_document()
    doc["runs"].append(run_info(0, platform.node() or "local"))
    names = backends or registry.default_backends()
    loaded = []
    for n in names:
        lb = registry.load(n)
        if lb.available:
            loaded.append(lb)
        else:
            progress(f"{n}: unavailable: {lb.error}")
    copy_cache: dict = {}
    for shape in SHAPES["quick" if quick else "full"]:
        for dtype in DTYPES:
            for op in OPS:
                for pass_ in PASSES:
                    row = [bench_one(lb, op, dtype, shape, pass_, repeat, copy_cache)
                           for lb in loaded]
                    torch_row = next((r for r in row if r["backend"] == "torch" and r["gbps"]),
                                     None)
                    for r in row:
                        if torch_row and r["gbps"]:
                            r["vs_torch"] = r["gbps"] / torch_row["gbps"]
                        r["run"] = doc["runs"][0]["run"]
                        doc["benchmarks"].append(r)
                        progress(_line(r))
    return doc


def _line(r) -> str:
    head = f"{r['backend']:>7} {r['op']:<10} {r['pass']:<16} {r['dtype']:<8} {str(r['shape']):<14}"
    if not r["gbps"]:
        return f"{head} {r['error']}"
    vs = f"{r['vs_torch']:.2f}x torch" if r["vs_torch"] else ""
    return (f"{head} {r['ms']:9.3f} ms {r['gbps']:7.2f} GB/s  copy {r['copy_gbps']:6.2f} GB/s "
            f"({100 * r['of_copy']:5.1f}% of copy) {vs}")


def main(args) -> int:
    doc = run_bench(args.backend, quick=args.quick)
    path = results.write(doc, args.json)
    print(f"\nbenchmarks: {path}  (pass it to `normspec report` to plot them)")
    return 0
