"""The forward's normalize loop (_numba_norm_row): an element's bits do not depend on
where the row lies, whether it is streamed or prefetched, or which of the loop's paths
(whole lines, steps of 8, one by one; bfloat16 pairs) computes it, and nothing around
the row is written; bfloat16's rounding instruction, which flushes subnormals, is
mended for them; y is exactly the formula, rounded as NumPy rounds each operation, then
to the 16-bit format; each compiled as here and the portable way (no F16C, no
AVX512-BF16). float32/float64 rows as well as 16-bit ones."""

from __future__ import annotations

import llvmlite.binding as llvm
import ml_dtypes
import numpy as np
import pytest

numba = pytest.importorskip("numba")

from portable_codec import decoders, portable  # noqa: E402

FORMATS = [(0, np.float16), (1, ml_dtypes.bfloat16)]
IDS = ["float16", "bfloat16"]
#: A mean and 1/std with full float32 significands: a product by them rounds (by 0.75,
#: a 16-bit value's product would be exact, and no order of the operations would show).
M, S = np.float32(0.2517), np.float32(0.7310586)
#: Elements of a cache line, by element size: the offsets a row can start at in one.
LINE_ELEMENTS = {2: 32, 4: 16, 8: 8}


@pytest.fixture(scope="module", params=["host", "portable"])
def normalize(request):
    """norm_row in a loop over rows, compiled as the host compiles it and with the
    integer codecs (chosen when the IR is generated, so the function compiles each way:
    every call runs under the choice, so whichever compiles it reads the flags then;
    see portable_codec for why nothing else does)."""
    from normspec.impls import _numba_norm_row as hn
    from normspec.impls._numba_jit import FASTMATH

    dec16, dec_bf16 = decoders()

    @numba.njit(fastmath=FASTMATH)  # as the kernel that calls it is compiled
    def run(x, w, b, m, s, y, centre, stream, ahead, fmt):
        for r in range(x.shape[0]):
            if fmt == 0:
                hn.norm_row(x[r], w, b, m, s, y[r], centre, stream, ahead, dec16)
            else:
                hn.norm_row(x[r], w, b, m, s, y[r], centre, stream, ahead, dec_bf16)

    @numba.njit(fastmath=FASTMATH)
    def run_float(x, w, b, m, s, y, centre, stream, ahead):
        for r in range(x.shape[0]):
            hn.norm_row(x[r], w, b, m, s, y[r], centre, stream, ahead, None)

    def call(x, w, b, m, s, y, centre, stream=False, ahead=0, fmt=0):
        """fmt 0 / 1: x, y float16 / bfloat16 bits; x float32/float64: fmt is not read."""
        with portable(request.param == "portable"):
            if x.dtype == np.uint16:
                run(x, w, b, np.float32(m), np.float32(s), y, centre, stream, ahead, fmt)
            else:
                t = x.dtype.type
                run_float(x, w, b, t(m), t(s), y, centre, stream, ahead)
    return call


def _same(got, want, dt):
    """Equal bits, or NaN in both (a NaN's payload is not compared, see _numba_codec)."""
    fg, fw = got.view(dt).astype(np.float32), want.view(dt).astype(np.float32)
    return (got == want) | (np.isnan(fg) & np.isnan(fw))


@pytest.mark.parametrize(("fmt", "dt"), FORMATS, ids=IDS)
def test_every_pattern_times_one_is_itself(normalize, fmt, dt):
    """RMSNorm with r = 1 and gamma = 1 returns x: every 16-bit pattern, the subnormal
    ones included (the bfloat16 instruction alone gives 0 for those), through every path
    (d = 65536: whole steps, streamed or not; the 16-bit and the float32 parameters)."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(1, -1)
    for w in (np.ones(x.shape[1], dt).view(np.uint16), np.ones(x.shape[1], np.float32)):
        for stream in (False, True):
            y = np.zeros_like(x)
            normalize(x, w, w, 0.0, 1.0, y, False, stream, fmt=fmt)
            same = _same(y, x, dt)
            assert same.all(), (f"got {y[~same][:4]} for the patterns {x[~same][:4]}, but "
                                f"x * 1 * 1 is x [stream={stream}, gamma {w.dtype}]")


@pytest.mark.parametrize(("fmt", "dt"), FORMATS, ids=IDS)
def test_float32_gamma_is_rounded_once_to_nearest_even(normalize, fmt, dt):
    """y = 1 * 1 * gamma for float32 gamma around every rounding boundary: y must be
    NumPy's / ml_dtypes' cast of gamma (subnormal, tie, overflow, inf and NaN)."""
    rng = np.random.default_rng(5)
    top = 0x47800000 if fmt == 0 else 0x7F800000
    bits = np.concatenate([rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0, 0x00800000, 997, dtype=np.uint32),
                           np.arange(top - 50_000, top + 50_000, 7, dtype=np.uint32),
                           np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                                     0x3F808000, 0x3F818000, 0x00008000, 0x00018000],
                                    np.uint32)])
    bits = np.concatenate([bits, bits | 0x80000000])
    gamma = bits.view(np.float32)
    one = np.ones((1, gamma.size), dt).view(np.uint16)
    y = np.zeros_like(one)
    with np.errstate(over="ignore", invalid="ignore"):
        want = gamma.astype(dt).view(np.uint16)
    normalize(one, gamma, gamma, 0.0, 1.0, y, False, fmt=fmt)
    same = _same(y[0], want, dt)
    assert same.all(), f"got {y[0][~same][:4]} for {gamma[~same][:4]}, but the cast gives {want[~same][:4]}"


def _rows(fmt, dt, n, d):
    """Rows with ordinary values, subnormal and overflowing results, NaN and inf."""
    rng = np.random.default_rng(d)
    x = rng.normal(0.3, 2.0, (n, d)).astype(np.float32)
    x[:, ::7] *= 1e-40 if fmt == 1 else 1e-6
    x[:, 5::11] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0])[rng.integers(0, 5, x[:, 5::11].shape)]
    return x.astype(dt).view(np.uint16)


@pytest.mark.parametrize(("fmt", "dt"), FORMATS, ids=IDS)
@pytest.mark.parametrize("centre", [True, False], ids=["layer_norm", "rms_norm"])
def test_bits_do_not_depend_on_where_the_row_lies(normalize, fmt, dt, centre):
    """The same rows written at every offset in a line, streamed and not, prefetching the
    next row and not: every element through the same formula, whichever path took it.
    mean and 1/std are chosen so that many results are subnormal in bfloat16."""
    for d in (1, 7, 8, 31, 33, 64, 100, 1000):
        x = _rows(fmt, dt, 3, d)
        rng = np.random.default_rng(d + 1)
        w = rng.normal(0, 1, d).astype(dt).view(np.uint16)
        b = (rng.normal(0, 1, d) * 1e-39).astype(dt).view(np.uint16)
        m, s = 0.25, 1e-38 if fmt == 1 else 0.5
        want = np.zeros_like(x)
        normalize(x, w, b, m, s, want, centre, fmt=fmt)
        for offset in range(33):
            buf = np.zeros(x.size + offset + 40, np.uint16)
            y = buf[offset:offset + x.size].reshape(x.shape)
            for stream in (False, True):
                y[:] = 0
                normalize(x, w, b, m, s, y, centre, stream, ahead=d, fmt=fmt)
                same = _same(y, want, dt)
                assert same.all(), (f"d = {d}, offset {offset}, stream={stream}: got "
                                    f"{y[~same][:4]}, but at offset 0 {want[~same][:4]}")
            assert not buf[:offset].any() and not buf[offset + x.size:].any(), \
                f"bytes around the rows written (d = {d}, offset {offset})"


@pytest.mark.parametrize(("fmt", "dt"), FORMATS, ids=IDS)
@pytest.mark.parametrize("centre", [True, False], ids=["layer_norm", "rms_norm"])
def test_y_is_the_formula_rounded_once(normalize, fmt, dt, centre):
    """Against NumPy, every float32 operation rounded as NumPy rounds it, then the 16-bit
    rounding: RMSNorm's (x r) gamma; LayerNorm's ((x - mean) r) gamma + beta, whose last
    two operations are one fused rounding where the CPU has FMA (taken here in float64,
    where t gamma is exact). Rows of 65573 elements: an operation in another order moves
    a float32 result by a unit in about half the elements, which shows in the 16-bit
    result only next to its rounding ties (a few in 2^13 for float16)."""
    d = (1 << 16) + 37
    x = _rows(fmt, dt, 4, d)
    rng = np.random.default_rng(9)
    fused = bool(llvm.get_host_cpu_features().get("fma"))
    for params in (np.float32, dt):
        w = rng.normal(0, 1, d).astype(params)
        b = rng.normal(0, 1, d).astype(params)
        wb = (w.view(np.uint16), b.view(np.uint16)) if params is dt else (w, b)
        y = np.zeros_like(x)
        normalize(x, *wb, M, S, y, centre, fmt=fmt)
        xf = x.view(dt).astype(np.float32)
        w32, b32 = w.astype(np.float32), b.astype(np.float32)
        with np.errstate(all="ignore"):
            if centre:
                t = (xf - M) * S
                want = (t.astype(np.float64) * w32 + b32).astype(np.float32) if fused else t * w32 + b32
            else:
                want = xf * S * w32
            want = want.astype(dt)
        exact = _same(y, want.view(np.uint16), dt)
        assert exact.all(), (f"got {y.view(dt)[~exact][:4]}, but the formula gives "
                             f"{want[~exact][:4]} [gamma {params.__name__}, fused: {fused}]")


def _misaligned(a, offset):
    """A copy of `a` at `offset` bytes past an aligned address, off its own alignment (a
    NumPy view of a byte buffer can be)."""
    raw = np.zeros(a.nbytes + 64 + offset, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    view = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    return view


@pytest.mark.parametrize(("kind", "offset"), [("float16", 1), ("bfloat16", 1), ("float32", 2),
                                              ("float64", 2), ("float64", 4)])
def test_rows_off_their_alignment_are_not_streamed(normalize, kind, offset):
    """Rows `offset` bytes off their elements' alignment: no line of y can be aligned, so
    nothing is streamed (a non-temporal store to an unaligned line would fault), and the
    bits are those of aligned rows."""
    d, half = 300, kind in ("float16", "bfloat16")
    dt = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}.get(kind, np.dtype(kind))
    x = np.random.default_rng(2).normal(0, 1, (2, d)).astype(dt)
    w = np.random.default_rng(3).normal(1, 0.1, d).astype(dt)
    if half:
        x, w = x.view(np.uint16), w.view(np.uint16)
    fmt = 0 if kind == "float16" else 1
    want = np.zeros_like(x)
    normalize(x, w, w, M, S, want, True, fmt=fmt)
    for stream in (False, True):
        y = _misaligned(np.zeros_like(x), offset)
        normalize(_misaligned(x, offset), _misaligned(w, offset), _misaligned(w, offset), M, S,
                  y, True, stream, fmt=fmt)
        same = np.array_equal(y.view(np.uint8), want.view(np.uint8))
        assert same, f"stream={stream}: got {y[0, :4]}, but aligned rows give {want[0, :4]}"


@pytest.mark.parametrize(("kind", "fmt"), [("float32", 0), ("float64", 0), ("float16", 0),
                                         ("bfloat16", 1)])
def test_norm_row_takes_read_only_rows(normalize, kind, fmt):
    """Read-only x, gamma and beta (Numba types them apart from writable ones): the same
    bits as writable ones."""
    dt = ml_dtypes.bfloat16 if kind == "bfloat16" else np.dtype(kind)
    rng = np.random.default_rng(6)
    x, w, b = (rng.normal(0, 1, shape).astype(dt) for shape in ((3, 70), 70, 70))
    if kind in ("float16", "bfloat16"):
        x, w, b = x.view(np.uint16), w.view(np.uint16), b.view(np.uint16)
    want = np.zeros_like(x)
    normalize(x, w, b, M, S, want, True, fmt=fmt)
    for a in (x, w, b):
        a.setflags(write=False)
    got = np.zeros_like(x)
    normalize(x, w, b, M, S, got, True, fmt=fmt)
    assert np.array_equal(got, want), f"got {got[0, :4]}, but writable rows give {want[0, :4]}"


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_read_only_inputs(dtype):
    """Read-only x, gamma and beta (a read-only memmap, np.frombuffer of bytes, another
    framework's array) are normalized as writable ones are, by the same compiled kernel:
    the backend copies them (numba_kernels._writable), so no second kernel is compiled."""
    from normspec.impls import numba_kernels

    backend = numba_kernels.make_backend()
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(4)
    x, w, b = (rng.normal(0, 1, shape).astype(dt) for shape in ((5, 100), 100, 100))
    want = backend.layer_norm(x, (100,), w, b, 1e-5).output, backend.rms_norm(x, (100,), w, 1e-5).output
    for a in (x, w, b):
        a.setflags(write=False)
    got = backend.layer_norm(x, (100,), w, b, 1e-5).output, backend.rms_norm(x, (100,), w, 1e-5).output
    for g, e in zip(got, want, strict=True):
        assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(e).view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("centre", [True, False], ids=["layer_norm", "rms_norm"])
def test_float_rows_bits_do_not_depend_on_where_the_row_lies(normalize, dtype, centre):
    """float32/float64 rows (NaN, inf, subnormal results among them) written at every
    offset in a line, streamed and not, prefetching and not: the bits of offset 0, nothing
    around the rows written; float32's are the formula's as NumPy rounds it (LayerNorm's
    last two operations fused where the CPU has FMA, taken exactly in float64)."""
    fused = bool(llvm.get_host_cpu_features().get("fma"))
    item = np.dtype(dtype).itemsize
    tiny = np.finfo(dtype).tiny
    for d in (1, 7, 8, 15, 17, 64, 100, 1000):
        rng = np.random.default_rng(d)
        x = rng.normal(0.3, 2.0, (3, d)).astype(dtype)
        x[:, 5::11] = np.array([np.nan, np.inf, -np.inf, 0.0])[rng.integers(0, 4, x[:, 5::11].shape)]
        w = rng.normal(0, 1, d).astype(dtype)
        w[::5] *= tiny
        b = (rng.normal(0, 1, d) * tiny).astype(dtype)
        want = np.zeros_like(x)
        normalize(x, w, b, M, S, want, centre)
        if dtype is np.float32:
            with np.errstate(all="ignore"):
                t = (x - M) * S if centre else x * S
                ref = (t.astype(np.float64) * w + b).astype(np.float32) if centre and fused else (
                    t * w + b if centre else t * w)
            same = (want.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(want) & np.isnan(ref))
            assert same.all(), f"d = {d}: got {want[~same][:4]}, but the formula gives {ref[~same][:4]}"
        for offset in range(LINE_ELEMENTS[item] + 1):
            buf = np.zeros(x.size + offset + 20, dtype)
            y = buf[offset:offset + x.size].reshape(x.shape)
            for stream in (False, True):
                y[:] = 0
                normalize(x, w, b, M, S, y, centre, stream, ahead=d)
                same = (y.view(np.uint8) == want.view(np.uint8)).reshape(x.shape + (item,)).all(-1)
                assert same.all(), (f"d = {d}, offset {offset}, stream={stream}: got "
                                    f"{y[~same][:4]}, but at offset 0 {want[~same][:4]}")
            assert not buf[:offset].any() and not buf[offset + x.size:].any(), \
                f"bytes around the rows written (d = {d}, offset {offset})"
