"""A row's bits in the numba backend do not depend on its batch. Forward: each row's
sums run in a loop of their own, whatever its place in the chunk. Backward
(_numba_backward): two layouts, rows in chunks (bwd) and, for fewer than COLUMN_ROWS
rows, column tiles (bwd_cols); a row's dx must have the same bits in both.
dgamma/dbeta are sums over the batch and only agree to rounding."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from normspec.conformance.cases import dtype_of  # noqa: E402
from normspec.impls import numba_kernels  # noqa: E402
from normspec.impls._numba_backward import COLUMN_ROWS, TILE  # noqa: E402
from normspec.impls.protocol import DTYPES  # noqa: E402


@pytest.fixture(scope="module")
def backend():
    return numba_kernels.make_backend()


def _run(backend, op, x, w, b, g):
    if op == "layer_norm":
        return backend.layer_norm(x, (x.shape[-1],), w, b, 1e-5, grad_output=g)
    return backend.rms_norm(x, (x.shape[-1],), w, 1e-5, grad_output=g)


def _counting(backend, monkeypatch):
    """The backend with its backward kernels counted by name."""
    calls: dict[str, int] = {}
    for name in ("bwd", "bwd_cols"):
        kernel = backend.k[name]

        def counted(*args, _k=kernel, _n=name):
            calls[_n] = calls.get(_n, 0) + 1
            return _k(*args)
        monkeypatch.setitem(backend.k, name, counted)
    return calls


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_bits_alone_and_anywhere_in_a_batch(backend, op, dtype):
    rng = np.random.default_rng(11)
    npdt = dtype_of(dtype)
    for d in [*range(1, 41), 64, 100, 1000]:
        w = (1 + rng.standard_normal(d) / 4).astype(npdt)
        b = rng.standard_normal(d).astype(npdt)
        for batch in (2, 3, 5, 9):
            x = (rng.standard_normal((batch, d)) * 3 + 1).astype(npdt)
            whole = np.asarray(_run(backend, op, x, w, b, None).output)
            for i in range(batch):
                alone = np.asarray(_run(backend, op, x[i:i + 1], w, b, None).output)
                assert np.array_equal(alone.view(np.uint8), whole[i:i + 1].view(np.uint8)), (
                    f"row {i} of {batch} ({dtype} {op}, d = {d}): alone {alone[0][:4]}..., "
                    f"in the batch {whole[i][:4]}...")


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dx_has_the_same_bits_in_both_layouts(backend, monkeypatch, op, dtype):
    npdt = dtype_of(dtype)
    rng = np.random.default_rng(7)
    d = TILE + 77  # a whole tile and a partial one
    batch = COLUMN_ROWS + 5
    x = (rng.standard_normal((batch, d)) * 3 + 1).astype(npdt)
    g = rng.standard_normal((batch, d)).astype(npdt)
    w = (1 + rng.standard_normal(d) / 4).astype(npdt)
    b = rng.standard_normal(d).astype(npdt)
    spans = ((0, 1), (3, 2), (batch - 7, 7))  # first row, middle rows, last rows
    calls = _counting(backend, monkeypatch)
    whole = _run(backend, op, x, w, b, g)
    few = [_run(backend, op, x[i:i + n], w, b, g[i:i + n]) for i, n in spans]
    assert calls == {"bwd": 1, "bwd_cols": len(spans)}, calls
    for (i, n), res in zip(spans, few, strict=True):
        got = np.asarray(res.grad_input).view(np.uint8)
        expected = np.asarray(whole.grad_input)[i:i + n].view(np.uint8)
        assert np.array_equal(got, expected), (
            f"dx of rows {i}..{i + n} alone differs from the same rows in a batch of "
            f"{batch} ({dtype} {op})")


@pytest.mark.parametrize("rows", [2, 5])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_column_layout_dgamma_dbeta_are_the_sums(backend, op, dtype, rows):
    """The column tiles' dgamma/dbeta against NumPy's float64 sums of the same terms,
    across several tiles and a partial one: two rows (one pass over each tile, the sums
    written once) and five (row by row)."""
    npdt = dtype_of(dtype)
    rng = np.random.default_rng(3)
    d = 3 * TILE + 9
    x = rng.standard_normal((rows, d)).astype(npdt)
    g = rng.standard_normal((rows, d)).astype(npdt)
    w = np.ones(d, npdt)
    res = _run(backend, op, x, w, np.zeros(d, npdt), g)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    mean = x64.mean(-1, keepdims=True) if op == "layer_norm" else 0.0
    ms = ((x64 - mean) ** 2).mean(-1, keepdims=True)
    x_hat = (x64 - mean) / np.sqrt(ms + 1e-5)
    rtol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(np.asarray(res.grad_weight, np.float64),
                               (g64 * x_hat).sum(0), rtol=rtol, atol=rtol)
    if op == "layer_norm":
        np.testing.assert_allclose(np.asarray(res.grad_bias, np.float64), g64.sum(0),
                                   rtol=rtol, atol=rtol)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dx_nan_and_inf_in_the_same_places_in_both_layouts(backend, monkeypatch, op, dtype):
    """Rows with inf in x and NaN in g: dx is NaN in the same places, and has the same bits
    elsewhere, alone, in two rows (the pair pass) and in a batch of COLUMN_ROWS rows.
    (Only a NaN's sign and payload may differ: see _numba_backward.)"""
    npdt = dtype_of(dtype)
    rng = np.random.default_rng(13)
    d, batch = 37, COLUMN_ROWS + 3
    x = (rng.standard_normal((batch, d)) * 3 + 1).astype(npdt)
    g = rng.standard_normal((batch, d)).astype(npdt)
    x[3, 2], g[3, 5], g[4, 0], x[5, 9] = np.inf, np.nan, np.nan, -np.inf
    w = (1 + rng.standard_normal(d) / 4).astype(npdt)
    b = rng.standard_normal(d).astype(npdt)
    calls = _counting(backend, monkeypatch)
    whole = np.asarray(_run(backend, op, x, w, b, g).grad_input)
    for i, n in ((3, 1), (2, 2), (4, 2), (1, 3)):
        got = np.asarray(_run(backend, op, x[i:i + n], w, b, g[i:i + n]).grad_input)
        expected = whole[i:i + n]
        assert np.array_equal(np.isnan(got), np.isnan(expected)), (
            f"dx of rows {i}..{i + n} alone is NaN at {np.argwhere(np.isnan(got)).tolist()[:4]}"
            f", in the batch at {np.argwhere(np.isnan(expected)).tolist()[:4]} ({dtype} {op})")
        keep = ~np.isnan(expected)
        assert np.array_equal(got[keep].view(np.uint8), expected[keep].view(np.uint8)), (
            f"dx of rows {i}..{i + n} alone differs from the batch where it is not NaN "
            f"({dtype} {op})")
    assert calls == {"bwd": 1, "bwd_cols": 4}, calls

