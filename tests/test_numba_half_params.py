"""A float16/bfloat16 call's gamma and beta reach the numba kernels as their own 16-bit
patterns when given in x's dtype (no NumPy cast, which took 10 of the 12 ms of a
[2, 2^20] float16 forward), and are decoded by the kernels for the backward: the
results' bits must be those of the same values given as float32, which take NumPy's
casts (a NaN's payload aside: NaN in both is the same, as _numba_codec says)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("numba")

from normspec.impls import numba_kernels  # noqa: E402

#: gamma's first values: finite ones (a NaN or inf would make every dx NaN, which any
#: gamma then gives), or non-finite ones.
GAMMA_HEADS = {"finite": [-0.0, 6e-8, -3.0, 1e4, 0.0], "nonfinite": [np.nan, np.inf, -np.inf]}


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        np.all((a.view(np.uint16) == b.view(np.uint16)) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("rows", [2, 40])  # float32 and float64 dgamma/dbeta sums
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("head", sorted(GAMMA_HEADS))
def test_params_in_dtype_give_the_float32_route_bits(dt, rows, op, head):
    backend = numba_kernels.make_backend()
    rng = np.random.default_rng(rows)
    d = 37
    x = rng.normal(0.3, 2.0, (rows, d)).astype(dt)
    g = rng.normal(0.0, 1.0, (rows, d)).astype(dt)
    w = rng.normal(1.0, 0.5, d)
    w[:len(GAMMA_HEADS[head])] = GAMMA_HEADS[head]
    w16, b16 = w.astype(dt), rng.normal(0.0, 1.0, d).astype(dt)
    for grad in (None, g):
        if op == "layer_norm":
            got = backend.layer_norm(x, (d,), w16, b16, 1e-5, grad)
            want = backend.layer_norm(x, (d,), w16.astype(np.float32), b16.astype(np.float32),
                                      1e-5, grad)
        else:
            got = backend.rms_norm(x, (d,), w16, 1e-5, grad)
            want = backend.rms_norm(x, (d,), w16.astype(np.float32), 1e-5, grad)
        for name in ("output", "grad_input", "grad_weight", "grad_bias"):
            a, b = getattr(got, name), getattr(want, name)
            if b is None:
                assert a is None, f"{name}: got an array, the float32 route gives None"
                continue
            assert _same(a, b), (f"{name} ({np.dtype(dt).name} {op}, {rows} rows, "
                                 f"gradients {grad is not None}): bits differ at "
                                 f"{np.flatnonzero(a.view(np.uint16) != b.view(np.uint16))[:5]}")
