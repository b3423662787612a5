"""The half-precision forward's statistics (numba, _numba_rows._half_stats): float32
block sums around a shift, trusted only where their error bound holds, else summed
again in float64. Checked here against float64 statistics of the same decoded values:
1/std within the bound its docstring derives (2^-12.4 relative, even were the sums
compiled scalar) on every row, and to float64 accuracy on the rows that must fall back
(the shift's samples are outliers, or bfloat16 squares overflow float32). Measured with
the fallback disabled, those rows' float32 sums were off by ~2e-5, under the bound,
so only the second assertion shows the fallback is taken."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba")

from normspec.impls import numba_kernels  # noqa: E402

FORMATS = [(0, np.float16), (1, ml_dtypes.bfloat16)]
RSTD_BOUND = 2.0 ** -12.4


def _rows(dt, rng):
    d = 4096
    normal = rng.standard_normal((6, d)) * 3 + 1
    offset = rng.standard_normal((4, d)) + 300  # mean far from 0, small spread
    outliers = rng.standard_normal((4, d))
    outliers[:, :16] = 40.0  # the shift's samples are outliers: c^2 is large
    far = rng.standard_normal((2, 1 << 16))
    far[:, :16] = 1000.0  # c ~ 64: float32 sums around this shift lose the variance
    short = rng.standard_normal((3, 11)) + 5  # fewer elements than SHIFT_SAMPLES
    rows = [(normal, False), (offset, False), (outliers, True), (far, True),
            (short, False)]
    if dt is ml_dtypes.bfloat16:
        rows.append((rng.standard_normal((2, d)) * 1e25, True))  # float32 squares overflow
    return [(r.astype(dt), fallback) for r, fallback in rows]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize(("fmt", "dt"), FORMATS)
def test_statistics_within_their_bound(fmt, dt, op):
    backend = numba_kernels.make_backend()
    for x, fallback in _rows(dt, np.random.default_rng(5)):
        d = x.shape[1]
        params = numba_kernels._half_params(np.ones(d, np.float32), np.zeros(d, np.float32), d, dt)
        _, mean, rstd = backend._half_forward(op, x.view(np.uint16), fmt, params, 1e-5)
        x64 = x.astype(np.float64)
        mu = x64.mean(1) if op == "layer_norm" else np.zeros(len(x))
        expected = 1 / np.sqrt(((x64 - mu[:, None]) ** 2).mean(1) + 1e-5)
        rel = np.abs(rstd / expected - 1)
        assert rel.max() <= RSTD_BOUND, (
            f"rstd off by {rel.max():.3g} relative, bound {RSTD_BOUND:.3g} ({dt.__name__} "
            f"{op}, rows of {d}, mean {mu.mean():.3g})")
        if fallback and op == "layer_norm":
            assert rel.max() <= 1e-9, f"rstd off by {rel.max():.3g}: not summed in float64"
        if op == "layer_norm":
            spread = 1 / expected
            assert np.all(np.abs(mean - mu) <= RSTD_BOUND * spread + 1e-12 * np.abs(mu))
