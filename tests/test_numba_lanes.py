"""The backward's row sums (_numba_lanes.lane_sums) add in exactly the order their module
says: lane k takes elements k, k + LANES, ... in turn, float32 rows (and decoded 16-bit
rows, with F16C and with the portable decoder) in float32 over `block_steps` steps
before the float64 lane takes that partial sum; float64 rows straight into the float64
lanes; written over the lanes or, with accumulate=1, added to them. Checked bit for bit
against that order written out in NumPy, so a reassociation
(a fast-math flag, a changed loop) fails. And a row whose float32 partial sums overflow
is summed again in float64 (_numba_backward.row_sums): dx and dgamma/dbeta stay finite
where the spec's are."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba")

import numba  # noqa: E402
from normspec.impls import numba_kernels, numpy_ref  # noqa: E402
from normspec.impls._numba_backward import as_f32, to_f64  # noqa: E402
from normspec.impls._numba_lanes import BLOCK_STEPS, LANES, lane_sums  # noqa: E402
from normspec.impls._numba_rows import decode_bf16, decode_f16  # noqa: E402
from portable_codec import decoders, portable  # noqa: E402

CONVERT = {"float64": to_f64, "float32": as_f32, "float16": decode_f16,
           "bfloat16": decode_bf16}
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
      "float64": np.float64}


#: What lanes hold before lane_sums: written over (accumulate=0), added to (1).
START = 12345.0


def _compiled(cv, block_steps, accumulate):
    """lane_sums on lanes holding START, compiled now: under the caller's F16C setting,
    not loaded from a cache (block_steps and accumulate must be compile-time constants)."""
    @numba.njit(cache=False)
    def run(xr, wr, gr, m, s, whole):
        lanes = np.full((2, LANES), START)
        lane_sums(xr, wr, gr, m, s, lanes, whole, block_steps, cv, accumulate)
        return lanes
    return run


def _expected(x, w, g, m, s, whole, block_steps, start):
    """The documented order, in NumPy scalars of the compute type, from lanes of `start`."""
    ct = w.dtype.type
    step = 1 if ct is np.float64 else block_steps
    out = np.full((2, LANES), start)
    for k in range(LANES):
        for start in range(0, whole // LANES, step):
            a, b = ct(0), ct(0)
            for i in range(start, min(whole // LANES, start + step)):
                j = i * LANES + k
                h = ct(g[j]) * w[j]
                a += h
                b += h * ((ct(x[j]) - m) * s)
            out[0, k] += np.float64(a)
            out[1, k] += np.float64(b)
    return out


@pytest.mark.parametrize(("dtype", "decoder"), [
    *((dtype, "host") for dtype in CONVERT),
    ("float16", "portable"), ("bfloat16", "portable"),  # (only 16-bit rows are decoded)
    ("float32", "in float64")])  # float32 rows, float64 mean and gamma (BatchNorm's)
def test_lane_sums_add_in_the_documented_order(dtype, decoder):
    half = dtype in ("float16", "bfloat16")
    wide = dtype == "float64" or decoder == "in float64"
    if wide:
        cv = to_f64
    elif decoder == "portable":  # uncached decoders, compiled under the patch (portable_codec)
        cv = dict(zip(("float16", "bfloat16"), decoders(), strict=True))[dtype]
    else:
        cv = CONVERT[dtype]
    runs = {(n, acc): _compiled(cv, n, acc) for n in (BLOCK_STEPS, 3, 1) for acc in (0, 1)}
    rng = np.random.default_rng(5)
    ct = np.float64 if wide else np.float32
    for d in (16, 48, 128, 256 + 32, 1000):
        whole = d - d % LANES
        x = (rng.standard_normal(d) * 3 + 1).astype(NP[dtype])
        g = rng.standard_normal(d).astype(NP[dtype])
        x[3] = g[7] = 1e-6  # float16 subnormals, for the portable decoder
        w = (1 + rng.standard_normal(d) / 4).astype(ct)
        m, s = ct(x.astype(np.float64).mean()), ct(0.7)
        for (block_steps, accumulate), run in runs.items():
            with portable(decoder == "portable"):
                got = run(x.view(np.uint16) if half else x, w,
                          g.view(np.uint16) if half else g, m, s, whole)
            expected = _expected(x.astype(np.float32) if half else x, w,
                                 g.astype(np.float32) if half else g, m, s, whole, block_steps,
                                 START if accumulate else 0.0)
            assert np.array_equal(got, expected), (dtype, d, block_steps, accumulate,
                                                   np.abs(got - expected).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_near_the_largest_float_do_not_overflow_in_partial_sums(dtype):
    """Terms of 2e38 (float32's and bfloat16's range) that a float32 partial sum of two
    would take to inf: in the row sums (two in one lane's block of steps) and in
    dL/dbeta (three in one column, the `bwd` layout of >= COLUMN_ROWS rows). Found by a
    review: dx was -inf over the whole row, dL/dbeta inf."""
    nb, ref = numba_kernels.make_backend(), numpy_ref.make_backend()
    rng = np.random.default_rng(0)
    for rows, d, big, names in (
            (3, 128, [(r, c) for r in range(3) for c in (0, 16)], ("grad_input",)),
            (64, 32, [(0, 5), (1, 5), (2, 5)], ("grad_input", "grad_bias", "grad_weight"))):
        x = rng.standard_normal((rows, d)).astype(NP[dtype])
        g = rng.standard_normal((rows, d)).astype(NP[dtype])
        for i, (r, c) in enumerate(big):
            g[r, c] = -2e38 if (rows, i) == (64, 2) else 2e38
        w, b = np.ones(d, NP[dtype]), np.zeros(d, NP[dtype])
        with np.errstate(over="ignore"):  # dL/dgamma, dL/dbeta may round to inf, rightly
            got = nb.layer_norm(x, (d,), w, b, 1e-5, grad_output=g)
        spec = ref.layer_norm(x.astype(np.float64), (d,), np.ones(d), np.zeros(d), 1e-5,
                              grad_output=g.astype(np.float64))
        for name in names:  # (the first case's dL/dbeta, 6e38, is inf in float32 too)
            expected = getattr(spec, name)
            value = np.asarray(getattr(got, name)).astype(np.float64)
            assert (np.abs(expected) < np.finfo(np.float32).max).all()  # finite in float32
            assert np.isfinite(value).all(), (
                f"{dtype} [{rows}, {d}]: got non-finite {name} "
                f"{value[~np.isfinite(value)][:3]}, but the spec says "
                f"{expected[~np.isfinite(value)][:3]}")
            assert np.allclose(value, expected, rtol=2e-2, atol=1e-3 * np.abs(expected).max())
