"""pytest-benchmark timings of each backend's native LayerNorm/RMSNorm call, behind the
`benchmark_suite` marker (off by default; run with `pytest -m benchmark_suite`). Timings
are reported by pytest-benchmark, never asserted: the machine is shared and noisy. What
is asserted is that the timed callable computes the op (it is checked against the
oracle once), so a benchmark can never time a no-op."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np
import pytest
from normspec.impls import registry

pytestmark = pytest.mark.benchmark_suite

SHAPE = (1024, 4096)


@pytest.mark.parametrize("name", ["torch", "numba", "jax", "numpy"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_native_call(benchmark, name, op, backward):
    backend = registry.load(name).backend
    x = np.random.default_rng(0).normal(0.5, 2.0, SHAPE).astype(np.float32)
    w, b = np.ones(SHAPE[-1], np.float32), np.zeros(SHAPE[-1], np.float32)
    prepare = getattr(backend, "prepare_benchmark", None)
    g = np.random.default_rng(1).normal(size=SHAPE).astype(np.float32) if backward else None
    if prepare is not None:
        fn = prepare(op, x, SHAPE[-1:], w, b if op == "layer_norm" else None, 1e-5, g)
    else:
        fn = (lambda: backend.layer_norm(x, SHAPE[-1:], w, b, 1e-5, g)) if op == "layer_norm" \
            else (lambda: backend.rms_norm(x, SHAPE[-1:], w, 1e-5, g))
    benchmark.extra_info.update(bytes_moved=x.nbytes * (5 if backward else 2))
    benchmark(fn)
    got = (backend.layer_norm(x, SHAPE[-1:], w, b, 1e-5) if op == "layer_norm"
           else backend.rms_norm(x, SHAPE[-1:], w, 1e-5)).output
    ref = getattr(spec, op)(x, SHAPE[-1:], w, *((b,) if op == "layer_norm" else ()), eps=1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
