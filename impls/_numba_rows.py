"""The row kernels of LayerNorm and RMSNorm: statistics from one read of each row
(shifted-data sums in float64, which a large mean cannot cancel), then the row
normalized from cache; and the half-precision forward that decodes and encodes the
16-bit values itself (its statistics in float32 blocks where that is exact enough, see
_half_stats; its normalize loop is _numba_norm_row). A row's bits never depend on its
batch, on where its arrays lie or on the process: every sum that decides them is
_numba_moments' fixed order, in a call of its own (no stores, so no run-time alias test
picks between two codings of it). Large outputs are streamed to memory
(_numba_stream). The backward is _numba_backward.py."""

import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from . import _numba_codec as codec
from ._numba_jit import inline, jit
from ._numba_moments import HEAD, block_sums, head_sum, moment_sums
from ._numba_norm_row import norm_row
from ._numba_stream import store_fence


@inline
def shifted_sums(xr, d):
    """Sums of (x - k) and (x - k)^2 in float64 with k = x[0]: one read of the row, and
    k lies within a few spreads of the mean, so s2/d - (s1/d)^2 does not cancel (the
    shifted-data variance), however large the mean. In the fixed order of
    _numba_moments (every d of the C-contiguous rows the kernels pass)."""
    k = np.float64(xr[0])
    s1, s2 = moment_sums(xr[:d], k, None)
    return k, s1, s2

@inline
def moments(k, s1, s2, d, eps):
    m1 = s1 / d
    var = s2 / d - m1 * m1
    if var < 0.0:  # rounding only; written so that NaN stays NaN
        var = 0.0
    return k + m1, 1.0 / math.sqrt(var + eps)

@inline
def sum_squares(xr, d):
    """The sum of x^2 in float64, in the fixed order of _numba_moments."""
    return moment_sums(xr[:d], 0.0, None)[1]


@inline
def _ln_row(xr, w, b, mu, rstd, yr, stream, ahead):
    """yr = the normalized row: by _numba_norm_row in the rows' dtype, or in float64 for
    a row whose spread is beyond float32 (see EXTREME_RSTD; also a NaN 1/std)."""
    if rstd >= EXTREME_RSTD:
        t = xr.dtype.type
        norm_row(xr, w, b, t(mu), t(rstd), yr, True, stream, ahead, None)
    else:
        for j in range(xr.shape[0]):
            yr[j] = (np.float64(xr[j]) - mu) * rstd * w[j] + b[j]


@inline
def _rms_row(xr, w, rstd, yr, stream, ahead):
    """As _ln_row, for RMSNorm."""
    if rstd >= EXTREME_RSTD:
        t = xr.dtype.type
        norm_row(xr, w, w, t(0.0), t(rstd), yr, False, stream, ahead, None)
    else:
        for j in range(xr.shape[0]):
            yr[j] = np.float64(xr[j]) * rstd * w[j]


#: float32/float64 rows of PREFETCH_ROW_BYTES[0] to [1] bytes prefetch a row ahead
#: (_rows_on) while they are normalized, when streamed. Measured in one process against
#: no prefetch (two threads, streamed outputs), old/new time, the next row prefetched:
#: rows of 2-16 KB ([131072, 256] float64 up to [8192, 4096] float32) 1.06-1.78x
#: faster. Slower: 1 KB rows ([131072, 256] float32) 0.84-0.90x, which the hardware
#: prefetcher streams by itself, and 64-128 KB rows 0.62-0.94x, whose next row's lines
#: evict the current row's from L1 (48 KB here) before it is normalized; 32 KB rows
#: 0.76-1.26x (noisy). (The 16-bit forward prefetches at every width: its normalize
#: loop is compute-bound, and 32-64 KB rows were 1.1-1.3x faster with it.)
PREFETCH_ROW_BYTES = (2 << 10, 16 << 10)
#: How far ahead a streaming forward prefetches: the row at least this many bytes on,
#: at least the next (rows of 8 KB: the second next; 4 KB: the fourth). Against the next
#: row, one process: 16-bit [8192, 4096] 1.04-1.26x, [16384, 2048] 1.08-1.43x,
#: [32768, 1024] 1.14-1.19x; float32 [32768, 1024] and [65536, 512] 1.12-1.21x, float64
#: 1.01-1.07x; rows of 8 KB and more 0.96-1.03x, 16-bit [65536, 512], [4096, 8192] and
#: [2048, 16384] 0.97-1.14x. 32 KB did as well.
PREFETCH_AHEAD_BYTES = 16 << 10


@inline
def _rows_on(x, r, r1):
    """How many elements after row r's start the row PREFETCH_AHEAD_BYTES on starts; 0
    when that row is past the chunk's last, r1 - 1."""
    k = max(1, PREFETCH_AHEAD_BYTES // max(1, x.shape[1] * x.itemsize))
    return k * (x.strides[0] // x.itemsize) if r + k < r1 else 0


@inline
def _ahead(x, r, r1, stream):
    """How many elements after row r's start the row starts that the normalize loop
    (_numba_norm_row) prefetches a line of at each step (_rows_on); 0 (no prefetch)
    when the output is not streamed (the rows are in cache) or when its rows' width is
    outside PREFETCH_ROW_BYTES."""
    low, high = PREFETCH_ROW_BYTES
    if stream and low <= x.shape[1] * x.itemsize <= high:
        return _rows_on(x, r, r1)
    return 0


@jit
def ln_fwd(x, w, b, eps, y, mean_out, rstd_out, n_chunks, stream):
    """Rows in contiguous chunks, one per thread, one row at a time: its statistics from
    one read (a loop of sums alone), then the row normalized from cache. The sums are
    not fused into the previous row's writes, as they were: LLVM guards a loop that both
    stores and reduces with a run-time test of how far apart the arrays lie, and runs a
    scalar copy of it when they are close (small arrays often are), whose reassociated
    sums round differently. A row's bits then depended on where NumPy had put the output
    (found by a review: float64 rows of ~4-40 elements, alone and in a batch, and
    between two calls on the same array).

    Each row is normalized by _numba_norm_row (written to memory with streaming stores
    with `stream`, the same bits, prefetching a row ahead where _ahead says); its loop
    in LLVM IR took 0.89-1.00x the time of the Python one LLVM vectorized itself, which
    it replaced, on float32 rows in cache ([256, 1000], [1024, 1024], [4096, 64],
    [64, 4096], one process)."""
    rows, d = x.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        r1 = min(rows, (c + 1) * per)
        for r in range(c * per, r1):
            xr = x[r]
            k, s1, s2 = shifted_sums(xr, d)
            mu, rstd = moments(k, s1, s2, d, eps)
            mean_out[r], rstd_out[r] = mu, rstd
            _ln_row(xr, w, b, mu, rstd, y[r], stream, _ahead(x, r, r1, stream))
        if stream:
            store_fence()


@jit
def rms_fwd(x, w, eps, y, rstd_out, n_chunks, stream):
    """As ln_fwd: the sum of squares of a row in a loop of its own, then the row."""
    rows, d = x.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        r1 = min(rows, (c + 1) * per)
        for r in range(c * per, r1):
            xr = x[r]
            rstd = 1.0 / math.sqrt(sum_squares(xr, d) / d + eps)
            rstd_out[r] = rstd
            _rms_row(xr, w, rstd, y[r], stream, _ahead(x, r, r1, stream))
        if stream:
            store_fence()


# The codec's intrinsics wrapped as jitted functions, which a kernel can pass to the row
# loops below (an intrinsic is not a first-class value): one compiled loop per format.
@inline
def decode_f16(h):
    return codec.decode_f16(h)

@inline
def decode_bf16(h):
    return codec.decode_bf16(h)

@inline
def encode_f16(v):
    return codec.encode_f16(v)

@inline
def encode_bf16(v):
    return codec.encode_bf16(v)


#: Elements per parallel piece of decode_all / encode_all.
CONVERT_PIECE = 1 << 16


@jit
def decode_all(h, fmt, out):
    """out[:] = the float32 values of 16-bit patterns `h` of format `fmt` (0 float16, 1
    bfloat16), exact (a NaN stays a NaN of its sign, its payload as the codec makes it,
    see _numba_codec): the parameters a 16-bit backward reads as float32 (NumPy converts
    float16 at about 1 ns an element, 1.3 ms of a [2, 2^20] forward+backward). In
    pieces of CONVERT_PIECE, in parallel."""
    for p in prange((h.shape[0] + CONVERT_PIECE - 1) // CONVERT_PIECE):
        lo, hi = p * CONVERT_PIECE, min(h.shape[0], (p + 1) * CONVERT_PIECE)
        codec.decode_row(h[lo:hi], out[lo:hi], fmt)


@jit
def encode_all(v, fmt, out):
    """out[:] = float32 `v` rounded to format `fmt` as 16-bit patterns, to nearest even,
    the bits of NumPy's and ml_dtypes' casts but a NaN's payload (it stays a NaN of its
    sign; tests/test_numba_codec.py): a 16-bit backward's float32 dgamma/dbeta (NumPy's
    float16 cast took 1.5 ms each at 2^20). In pieces, as decode_all."""
    for p in prange((v.shape[0] + CONVERT_PIECE - 1) // CONVERT_PIECE):
        lo, hi = p * CONVERT_PIECE, min(v.shape[0], (p + 1) * CONVERT_PIECE)
        codec.encode_row(v[lo:hi], out[lo:hi], fmt)


@inline
def _half_sums(xr, d, k, dec):
    """Sums of (x - k) and (x - k)^2 over a 16-bit row, in float64 (k = 0 for RMSNorm),
    in the fixed order of _numba_moments."""
    return moment_sums(xr[:d], k, dec)

@inline
def _half_moments(k, s1, s2, d, eps, centre):
    if centre:
        return moments(k, s1, s2, d, eps)
    return 0.0, 1.0 / math.sqrt(s2 / d + eps)


#: Rows with 1/std below this are normalized in float64: their x - mean can overflow
#: float32 (bfloat16 reaches 3.4e38) and their 1/std is subnormal there (found by a
#: review: a bfloat16 row of +-3.39e38 gave -inf where the spec gives -1.73). Only
#: spreads beyond 2^100 take that path, which no realistic row has.
EXTREME_RSTD = 2.0 ** -100
#: Elements summed in float32 before the block's sums are added in float64.
SUM_BLOCK = 512
#: Largest (mean - shift)^2 / variance the float32 block sums are trusted with.
MAX_SHIFT_RATIO = 3.0
#: Leading elements of a row whose mean is the shift of its LayerNorm sums.
SHIFT_SAMPLES = HEAD
#: Below this mean square (of x - shift) float32 squares may have underflowed.
TINY_MEAN_SQUARE = 2.0 ** -80


@inline
def _half_sums32(xr, d, k, dec):
    """_half_sums with the arithmetic in float32 over blocks of SUM_BLOCK elements, each
    block's sums added in float64 (_numba_moments.block_sums): float32 has no conversion
    to float64 per element, which made the sums cost as much as the rest of the forward.
    A float32 block sum rounds at most 7 times in its lane (8 additions, the first to
    +0.0 exact) and 6 in the tree of 64 lanes (_numba_moments), and each term carries up
    to 2 more from before it is added (t = x - k, twice in t * t, which a fused
    multiply-add adds with one rounding): 15 roundings, 2^-20.1 relative; the caller
    checks when that is not enough. Blocks of 512 rather than 128: with the loop LLVM
    vectorized itself before, the float32 sums of a row in L1 went from 11 to 16 G
    elements/s on one core (each block ends in a sum across its lanes)."""
    return block_sums(xr[:d], k, dec, SUM_BLOCK)


@inline
def _shift(xr, d, dec):
    return np.float32(head_sum(xr[:d], dec) / min(d, SHIFT_SAMPLES))


@inline
def _half_stats(xr, d, eps, centre, dec):
    """Mean and 1/std of a 16-bit row (mean 0 for RMSNorm), from shifted sums taken in
    float32 blocks, the shift k the mean of the row's first SHIFT_SAMPLES elements
    (taken in float64, so it cannot overflow, then rounded to float32). Their error,
    relative to the variance, is at most 3 block roundings (see _half_sums32) times
    (1 + c^2), c = |mean - k| / std: with c^2 <= MAX_SHIFT_RATIO, below 12 * 2^-20.1 =
    2^-16.5 (rstd off by 2^-17.5, a 90th of float16's unit roundoff). The mean of 16
    elements is within a quarter of a standard deviation of the row's for most rows
    (c^2 ~ 1/16); with k = x[0], as before, one Gaussian row in 12 would have missed
    c^2 <= 3. A row outside that (outliers among its first elements), or whose float32
    squares may have overflowed (bfloat16 beyond ~1e19), underflowed (mean square below
    TINY_MEAN_SQUARE) or met NaN/inf, is summed again in float64."""
    k = _shift(xr, d, dec) if centre else np.float32(0.0)
    s1, s2 = _half_sums32(xr, d, k, dec)
    m1 = s1 / d
    ms = s2 / d
    var = ms - m1 * m1
    trusted = TINY_MEAN_SQUARE <= ms < np.inf
    if centre:
        trusted = trusted and m1 * m1 <= MAX_SHIFT_RATIO * var
    if not trusted:
        s1, s2 = _half_sums(xr, d, np.float64(k), dec)
    return _half_moments(np.float64(k), s1, s2, d, eps, centre)


def param_at(a, j, dec):
    """a[j] as float32: decoded when `a` holds 16-bit patterns (uint16), as is otherwise."""


@overload(param_at, inline="always")
def _param_at(a, j, dec):
    if a.dtype == types.uint16:
        return lambda a, j, dec: dec(a[j])
    return lambda a, j, dec: np.float32(a[j])


@inline
def _half_ahead(x16, r, r1, stream):
    """How many elements after row r's start the row starts that the half forward
    prefetches while it normalizes row r: _rows_on when streaming, else the next row
    (rows in cache: [256, 1000] was 0.94-1.01x with the farther one); 0 past the
    chunk's last row."""
    if stream:
        return _rows_on(x16, r, r1)
    return x16.strides[0] // 2 if r + 1 < r1 else 0


@inline
def _half_fwd_rows(x16, w, b, eps, y16, mean_out, rstd_out, r0, r1, centre, stream, dec, enc):
    """Rows r0..r1 of the half forward, one row at a time: the statistics from one read
    of the row, then the row normalized from L1 (an 8 KB row of 4096 halves stays there)
    and written (_numba_norm_row; streamed with `stream`), while a row further on in the
    chunk (_half_ahead) is prefetched, a line a step, so that its statistics read it
    from cache: the normalize loop is the longer, compute-bound part, and without the
    prefetch nothing was read from memory while it ran ([8192, 4096]: LayerNorm 1.06x (float16) and
    1.20x (bfloat16) faster with it, RMSNorm the same either way, one process). gamma
    and beta are read as 16-bit patterns when they are exactly representable: two
    float32 vectors of 4096 fill L1 by themselves, and with them there every row's
    re-read came from L2 instead, which halved the speed of a streaming row loop.
    RMSNorm does not read beta at all. A row whose spread is beyond float32 (see
    EXTREME_RSTD) is normalized in float64."""
    d = x16.shape[1]
    for r in range(r0, r1):
        xr, yr = x16[r], y16[r]
        mu, rstd = _half_stats(xr, d, eps, centre, dec)
        mean_out[r], rstd_out[r] = mu, rstd
        if not rstd >= EXTREME_RSTD:
            for j in range(d):
                v = (np.float64(dec(xr[j])) - mu) * rstd * param_at(w, j, dec)
                yr[j] = enc(np.float32(v + param_at(b, j, dec) if centre else v))
        else:
            norm_row(xr, w, b, np.float32(mu), np.float32(rstd), yr, centre, stream,
                     _half_ahead(x16, r, r1, stream), dec)


@jit
def half_fwd(x16, w, b, eps, y16, mean_out, rstd_out, n_chunks, fmt, centre, stream):
    """LayerNorm (centre) or RMSNorm forward on float16 (fmt 0) / bfloat16 (fmt 1) bits,
    computed in float32 with statistics in float32 blocks summed in float64 (float64
    throughout where those could lose accuracy, see _half_stats); one read of each row
    from memory and one write. gamma/beta are float32, or 16-bit patterns of the same
    format as x."""
    rows, d = x16.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        r0, r1 = c * per, min(rows, (c + 1) * per)
        if fmt == 0:
            _half_fwd_rows(x16, w, b, eps, y16, mean_out, rstd_out, r0, r1, centre, stream,
                           decode_f16, encode_f16)
        else:
            _half_fwd_rows(x16, w, b, eps, y16, mean_out, rstd_out, r0, r1, centre, stream,
                           decode_bf16, encode_bf16)
        if stream:
            store_fence()
