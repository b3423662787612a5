"""pytest-benchmark timings of each backend's LayerNorm/RMSNorm, behind the
`benchmark_suite` marker (off by default; run with `pytest -m benchmark_suite`): the
callable `normspec bench` times as "prepared" (the backend's prepare_benchmark), or its
protocol call where it has none (numpy), chosen by the bench's own timed_callable.
Timings are reported by pytest-benchmark, never asserted: the machine is shared and
noisy. What is asserted: the protocol call's output equals the oracle's (a prepared
callable returns the backend's own arrays, which only the backend can read:
tests/test_numba_scratch.py and tests/test_bench.py check numba's and torch's)."""

from __future__ import annotations

import ml_dtypes
import normspec.spec as spec
import numpy as np
import pytest
from normspec.conformance import bench
from normspec.impls import registry

pytestmark = pytest.mark.benchmark_suite

SHAPE = (1024, 4096)


DTYPES = {"float32": (np.float32, 1e-4), "float16": (np.float16, 4e-3),
          "bfloat16": (ml_dtypes.bfloat16, 3e-2)}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", ["torch", "numba", "jax", "numpy"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_native_call(benchmark, name, op, backward, dtype):
    backend = registry.load(name).backend
    dt, tol = DTYPES[dtype]
    x = np.random.default_rng(0).normal(0.5, 2.0, SHAPE).astype(dt)
    w, b = np.ones(SHAPE[-1], dt), np.zeros(SHAPE[-1], dt)
    g = np.random.default_rng(1).normal(size=SHAPE).astype(dt) if backward else None
    bias = b if op == "layer_norm" else None
    fn, _ = (bench.timed_callable(backend, "prepared", op, x, w, bias, g)
             or bench.timed_callable(backend, "protocol", op, x, w, bias, g))
    benchmark.extra_info.update(bytes_moved=x.nbytes * (5 if backward else 2))
    benchmark(fn)
    got = (backend.layer_norm(x, SHAPE[-1:], w, b, 1e-5) if op == "layer_norm"
           else backend.rms_norm(x, SHAPE[-1:], w, 1e-5)).output
    x64, w64, b64 = (a.astype(np.float64) for a in (x, w, b))
    ref = getattr(spec, op)(x64, SHAPE[-1:], w64, *((b64,) if op == "layer_norm" else ()),
                            eps=1e-5)
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=tol, atol=tol)
