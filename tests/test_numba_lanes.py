"""The backward's row sums (_numba_lanes.lane_sums) add in exactly the order their module
says: lane k takes elements k, k + LANES, ... in turn, float32 rows (and decoded 16-bit
rows) in float32 over BLOCK_STEPS steps before the float64 lane takes that partial sum;
float64 rows straight into the float64 lanes. Checked bit for bit against that order
written out in NumPy, so a reassociation (a fast-math flag, a changed loop) fails."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba")

from normspec.impls._numba_backward import as_f32, to_f64  # noqa: E402
from normspec.impls._numba_jit import strict  # noqa: E402
from normspec.impls._numba_lanes import BLOCK_STEPS, LANES, lane_sums  # noqa: E402
from normspec.impls._numba_rows import decode_bf16, decode_f16  # noqa: E402


def _sums(cv):
    @strict
    def run(xr, wr, gr, m, s, whole):
        lanes = np.zeros((2, LANES))
        lane_sums(xr, wr, gr, m, s, lanes, whole, cv)
        return lanes
    return run


_RUNS = {"float64": _sums(to_f64), "float32": _sums(as_f32), "float16": _sums(decode_f16),
         "bfloat16": _sums(decode_bf16)}


def _expected(x, w, g, m, s, whole):
    """The documented order, in NumPy scalars of the compute type."""
    ct = w.dtype.type
    out = np.zeros((2, LANES))
    for k in range(LANES):
        for start in range(0, whole // LANES, 1 if ct is np.float64 else BLOCK_STEPS):
            stop = min(whole // LANES, start + (1 if ct is np.float64 else BLOCK_STEPS))
            a, b = ct(0), ct(0)
            for i in range(start, stop):
                j = i * LANES + k
                h = ct(g[j]) * w[j]
                a += h
                b += h * ((ct(x[j]) - m) * s)
            out[0, k] += np.float64(a)
            out[1, k] += np.float64(b)
    return out


@pytest.mark.parametrize("dtype", list(_RUNS))
def test_lane_sums_add_in_the_documented_order(dtype):
    rng = np.random.default_rng(5)
    npdt = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}.get(dtype, np.dtype(dtype))
    ct = np.float64 if dtype == "float64" else np.float32
    for d in (16, 48, 128, 256 + 32, 1000):
        whole = d - d % LANES
        x = (rng.standard_normal(d) * 3 + 1).astype(npdt)
        g = rng.standard_normal(d).astype(npdt)
        w = (1 + rng.standard_normal(d) / 4).astype(ct)
        m, s = ct(x.astype(np.float64).mean()), ct(0.7)
        half = dtype in ("float16", "bfloat16")
        got = _RUNS[dtype](x.view(np.uint16) if half else x, w,
                           g.view(np.uint16) if half else g, m, s, whole)
        expected = _expected(x.astype(np.float32) if half else x, w,
                             g.astype(np.float32) if half else g, m, s, whole)
        assert np.array_equal(got, expected), (dtype, d, np.abs(got - expected).max())
