"""Rows whose spread is beyond float32 (bfloat16 and float32 values near 3.4e38): the
numba forward normalizes them in float64 (_numba_rows.EXTREME_RSTD). In float32, x - mean
overflowed to -inf and 1/std was subnormal; the spec's answers are ordinary numbers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba")

from normspec.impls import numba_kernels  # noqa: E402

TOP = {"bfloat16": float(np.array(3.39e38).astype(ml_dtypes.bfloat16)), "float32": 3.4e38}
ROWS = [[1, 1, 1, -1], [1, -1, 1, -1], [1, 0.5, 0, -0.25], [1, -1, 1e-30, 0]]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rows_near_the_largest_finite_value(op, dtype):
    backend = numba_kernels.make_backend()
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    x = (np.array(ROWS) * TOP[dtype]).astype(npdt)
    d = x.shape[1]
    if op == "layer_norm":
        got = backend.layer_norm(x, (d,), None, None, 1e-5).output
    else:
        got = backend.rms_norm(x, (d,), None, 1e-5).output
    x64 = x.astype(np.float64)
    mean = x64.mean(1, keepdims=True) if op == "layer_norm" else 0.0
    expected = ((x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(1, keepdims=True) + 1e-5))
    got64 = np.asarray(got).astype(np.float64)
    # one ulp of the dtype at the row's scale (its largest |value|, about 1.7 here)
    ulp = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -23
    assert np.all(np.isfinite(got64)), f"got {got64}, but the spec says {expected}"
    assert np.abs(got64 - expected).max() <= ulp, f"got {got64}, but the spec says {expected}"
