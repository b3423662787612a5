"""The numba backward's per-chunk scratch rows (numba_kernels.scratch_rows): each row
starts on a cache line and the arrays sit apart modulo a page, and the kernel counts its
chunks from them (a prepared callable made under one thread count and called under
another once wrote past its buffers)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from normspec.impls import numba_kernels  # noqa: E402
from normspec.impls.numba_kernels import PAGE, ROW_ALIGN, scratch_rows  # noqa: E402

DTYPES = (np.float64, np.float64, np.float32, np.float32)


@pytest.mark.parametrize("dtypes", [DTYPES, DTYPES[1:], DTYPES[:1]])
@pytest.mark.parametrize("n, d", [(1, 1), (2, 1000), (3, 17), (2, 4096), (5, 70_003)])
def test_scratch_rows_are_aligned_staggered_and_disjoint(n, d, dtypes):
    arrays = scratch_rows(n, d, dtypes)
    assert [a.dtype for a in arrays] == [np.dtype(t) for t in dtypes]
    step = PAGE // len(dtypes) // ROW_ALIGN * ROW_ALIGN
    spans = []
    for i, a in enumerate(arrays):
        assert a.shape[0] == n and a.shape[1] >= d, (a.shape, n, d)
        assert a.shape[1] * a.itemsize % ROW_ALIGN == 0
        assert a.shape[1] - d < ROW_ALIGN // a.itemsize, f"rows padded by more than a line: {a.shape}"
        assert a.flags.c_contiguous
        for row in a:
            assert row.ctypes.data % ROW_ALIGN == 0, f"array {i}: a row starts off a cache line"
        assert a.ctypes.data % PAGE == i * step, (
            f"array {i} starts at {a.ctypes.data % PAGE} modulo {PAGE}, expected {i * step}")
        spans.append((a.ctypes.data, a.ctypes.data + a.nbytes))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)), (
        "scratch arrays overlap")


def test_a_prepared_backward_uses_only_the_chunks_it_made(monkeypatch):
    """The callable is made while one chunk is planned and called while three are. The
    kernel counts its chunks from its buffers, so it has no count of its own to get
    wrong (it does not check bounds: a count passed beside the buffers, made for the
    call's thread count, once wrote past them), and gets the buffers made at first."""
    import inspect

    from normspec.impls._numba_backward import bwd

    assert "n_chunks" not in inspect.signature(bwd.py_func).parameters, (
        "the chunked backward takes a chunk count beside its per-chunk buffers")
    backend = numba_kernels.make_backend()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 40)).astype(np.float32)
    g = rng.standard_normal((96, 40)).astype(np.float32)
    w, b = np.ones(40, np.float32), np.zeros(40, np.float32)
    calls = []
    kernel = backend.k["bwd"]

    def checked(x, w, g, mean, rstd, dx, dw_part, db_part, dw32, db32, *rest):
        calls.append([a.shape[0] for a in (dw_part, db_part, dw32, db32)])
        out = kernel(x, w, g, mean, rstd, dx, dw_part, db_part, dw32, db32, *rest)
        calls[-1].append(dx.copy())
        return out

    monkeypatch.setitem(backend.k, "bwd", checked)
    monkeypatch.setattr(numba_kernels, "_chunks", lambda rows: 1)
    run = backend.prepare_benchmark("layer_norm", x, (40,), w, b, 1e-5, g)
    monkeypatch.setattr(numba_kernels, "_chunks", lambda rows: 3)
    run()
    assert [c[:4] for c in calls] == [[1, 1, 1, 1]], (
        f"got per-chunk buffers of {[c[:4] for c in calls]} rows, but the prepared callable "
        "made one chunk's")
    expected = backend.layer_norm(x, (40,), w, b, 1e-5, g).grad_input
    assert np.array_equal(calls[0][4].view(np.uint8), expected.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_backward_is_unchanged_by_the_scratch_layout(dtype):
    """Padded rows change no result: the protocol's dgamma/dbeta have length d and equal
    a plain NumPy sum of the same terms to within the float32 scratch sums' rounding."""
    backend = numba_kernels.make_backend()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((130, 37)).astype(dtype)
    g = rng.standard_normal((130, 37)).astype(dtype)
    res = backend.layer_norm(x, (37,), np.ones(37, dtype), np.zeros(37, dtype), 1e-5, g)
    x64 = x.astype(np.float64)
    x_hat = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    assert res.grad_weight.shape == (37,) and res.grad_bias.shape == (37,)
    tol = 64 * np.finfo(dtype).eps * np.abs(g * x_hat).sum(0)
    assert np.all(np.abs(res.grad_weight - (g * x_hat).sum(0)) <= tol)
    assert np.all(np.abs(res.grad_bias - g.sum(0, dtype=np.float64))
                  <= 64 * np.finfo(dtype).eps * np.abs(g).sum(0))
