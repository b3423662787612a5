"""The numba forward's streaming stores (_numba_stream, _numba_norm_row): a streamed
float32/float64 row has the bits of an unstreamed one (16-bit rows, and rows at every
alignment: tests/test_numba_norm_row.py), and the backend streams exactly the outputs
it says it does."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from normspec.impls import _numba_rows, numba_kernels  # noqa: E402
from normspec.impls._numba_stream import X86  # noqa: E402
from numba import njit  # noqa: E402


def _rows(dtype, d, rows=5):
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((rows, d)) * 3 + 1).astype(dtype)
    x[1, 0] = np.nan
    if rows > 2 and d > 1:
        x[2] = np.where(np.arange(d) % 2, 3e37, -3e37).astype(dtype)  # see EXTREME_RSTD
    w = (1 + rng.standard_normal(d) / 4).astype(dtype)
    b = rng.standard_normal(d).astype(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_streamed_row_has_the_bits_of_an_unstreamed_one(dtype):
    """Streamed rows also prefetch a row ahead where their width is in
    _numba_rows.PREFETCH_ROW_BYTES: d = 1000 here, in two chunks of 6 rows, where the
    first rows of each have a row PREFETCH_AHEAD_BYTES on (4097 float32 is too wide)."""
    low, high = _numba_rows.PREFETCH_ROW_BYTES
    assert low <= 1000 * np.dtype(dtype).itemsize <= high
    assert _numba_rows._ahead(np.empty((12, 1000), dtype), 0, 6, True) > 0
    for d in [*range(1, 40), 64, 100, 1000, 4097]:
        x, w, b = _rows(dtype, d, rows=12)
        outs = {}
        for stream in (False, True):
            y, mean, rstd = np.empty_like(x), np.zeros(len(x)), np.empty(len(x))
            _numba_rows.ln_fwd(x, w, b, 1e-5, y, mean, rstd, 2, stream)
            y_rms, rstd_rms = np.empty_like(x), np.empty(len(x))
            _numba_rows.rms_fwd(x, w, 1e-5, y_rms, rstd_rms, 2, stream)
            outs[stream] = (y, mean, rstd, y_rms, rstd_rms)
        for got, expected in zip(outs[True], outs[False], strict=True):
            assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), d


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_backend_streams_large_outputs_of_any_width(monkeypatch, dtype):
    """Outputs of at least the last-level cache's size are streamed, however wide their
    rows (the normalize loop streams from its registers, with no scratch row to keep in
    cache), smaller ones not; streamed, their bits are the unstreamed ones."""
    llc = numba_kernels.last_level_cache_bytes()
    item = np.dtype(dtype).itemsize
    assert numba_kernels.stream_rows(np.empty((llc // (item * 1024), 1024), dtype))
    assert not numba_kernels.stream_rows(np.empty((llc // (item * 1024) - 1, 1024), dtype))
    wide = (1 << 16) + 3
    assert numba_kernels.stream_rows(np.empty((llc // (item * wide) + 1, wide), dtype))

    backend = numba_kernels.make_backend()
    calls = []
    for name in ("ln_fwd", "rms_fwd", "half_fwd"):
        kernel = backend.k[name]

        def spy(*args, _k=kernel):
            calls.append(args[-1])
            return _k(*args)
        monkeypatch.setitem(backend.k, name, spy)
    x, w, b = (a.astype(dtype) for a in _rows(np.float32, wide, rows=2))
    plain = backend.layer_norm(x, (wide,), w, b, 1e-5).output, backend.rms_norm(x, (wide,), w, 1e-5).output
    monkeypatch.setattr(numba_kernels, "last_level_cache_bytes", lambda: 0)
    streamed = backend.layer_norm(x, (wide,), w, b, 1e-5).output, backend.rms_norm(x, (wide,), w, 1e-5).output
    assert calls == [False, False, True, True]
    for got, expected in zip(streamed, plain, strict=True):
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(expected).view(np.uint8))


def _sysfs(folder, caches):
    for index, (level, size) in enumerate(caches):
        (folder / f"index{index}").mkdir(parents=True)
        (folder / f"index{index}" / "level").write_text(f"{level}\n")
        (folder / f"index{index}" / "size").write_text(f"{size}\n")
    return str(folder)


def test_last_level_cache_size_from_sysfs(tmp_path):
    size = numba_kernels.last_level_cache_bytes
    assert size(_sysfs(tmp_path / "a", [(1, "32K"), (2, "1024K"), (3, "32768K"), (1, "32K")])) \
        == 32 << 20
    assert size(_sysfs(tmp_path / "b", [(1, "32K"), (2, "2M"), (3, "garbage")])) == 2 << 20
    assert size(str(tmp_path / "none")) == 32 << 20


@pytest.mark.skipif(not X86, reason="the instructions checked are x86's")
def test_the_forward_kernels_store_non_temporally_and_fence():
    def fresh(kernel):  # compiled with the kernel's options: Numba cannot show cached code
        options = {o: v for o, v in kernel.targetoptions.items() if o != "nopython"}
        return njit(**options)(kernel.py_func)
    ln_fwd, rms_fwd = fresh(_numba_rows.ln_fwd), fresh(_numba_rows.rms_fwd)
    half_fwd = fresh(_numba_rows.half_fwd)
    x = np.ones((4, 64), np.float32)
    w = np.ones(64, np.float32)
    ln_fwd(x, w, w, 1e-5, x.copy(), np.zeros(4), np.zeros(4), 2, True)
    rms_fwd(x, w, 1e-5, x.copy(), np.zeros(4), 2, True)
    x16 = np.ones((4, 64), np.uint16)
    half_fwd(x16, x16[0], x16[0], 1e-5, x16.copy(), np.zeros(4), np.zeros(4), 2, 0, True, True)
    for kernel in (ln_fwd, rms_fwd, half_fwd):
        asm = "\n".join(kernel.inspect_asm().values())
        assert "movnt" in asm, "LLVM dropped the non-temporal hint: every store is ordinary"
        assert "sfence" in asm, "no store fence after the streamed rows"
