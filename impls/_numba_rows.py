"""The row kernels of LayerNorm and RMSNorm: statistics from one read of each row
(shifted-data sums in float64, which a large mean cannot cancel), then the row
normalized from cache; the half-precision forward that decodes and encodes the 16-bit
values itself (its statistics in float32 blocks where that is exact enough, see
_half_stats); and the backward in two layouts (rows in chunks with partial dgamma/dbeta
sums, or column tiles for few rows), computed in float64 for float64 rows and in
float32 for the others. A row's bits never depend on its batch or on where its arrays
lie: every reduction that decides them either runs in a loop of its own (no stores, so
no run-time alias test picks between two codings of it) or is compiled strict."""

import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from . import _numba_codec as codec
from ._numba_jit import inline, jit, strict, strict_inline


@inline
def shifted_sums(xr, d):
    """Sums of (x - k) and (x - k)^2 in float64 with k = x[0]: one read of the row, and
    k lies within a few spreads of the mean, so s2/d - (s1/d)^2 does not cancel (the
    shifted-data variance), however large the mean."""
    k = np.float64(xr[0])
    s1 = 0.0
    s2 = 0.0
    for j in range(d):
        v = np.float64(xr[j]) - k
        s1 += v
        s2 += v * v
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
    s = 0.0
    for j in range(d):
        v = np.float64(xr[j])
        s += v * v
    return s


@jit
def ln_fwd(x, w, b, eps, y, mean_out, rstd_out, n_chunks):
    """Rows in contiguous chunks, one per thread, one row at a time: its statistics from
    one read (a loop of sums alone), then the row normalized from cache. The sums are
    not fused into the previous row's writes, as they were: LLVM guards a loop that both
    stores and reduces with a run-time test of how far apart the arrays lie, and runs a
    scalar copy of it when they are close (small arrays often are), whose reassociated
    sums round differently. A row's bits then depended on where NumPy had put the output
    (found by a review: float64 rows of ~4-40 elements, alone and in a batch, and
    between two calls on the same array)."""
    rows, d = x.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        for r in range(c * per, min(rows, (c + 1) * per)):
            xr, yr = x[r], y[r]
            k, s1, s2 = shifted_sums(xr, d)
            mu, rstd = moments(k, s1, s2, d, eps)
            mean_out[r], rstd_out[r] = mu, rstd
            m_t, s_t = x.dtype.type(mu), x.dtype.type(rstd)
            if not rstd >= EXTREME_RSTD:  # see EXTREME_RSTD: float64 for this row
                for j in range(d):
                    yr[j] = (np.float64(xr[j]) - mu) * rstd * w[j] + b[j]
                continue
            for j in range(d):
                yr[j] = (xr[j] - m_t) * s_t * w[j] + b[j]


@jit
def rms_fwd(x, w, eps, y, rstd_out, n_chunks):
    """As ln_fwd: the sum of squares of a row in a loop of its own, then the row."""
    rows, d = x.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        for r in range(c * per, min(rows, (c + 1) * per)):
            xr, yr = x[r], y[r]
            rstd = 1.0 / math.sqrt(sum_squares(xr, d) / d + eps)
            rstd_out[r] = rstd
            s_t = x.dtype.type(rstd)
            if not rstd >= EXTREME_RSTD:  # see EXTREME_RSTD: float64 for this row
                for j in range(d):
                    yr[j] = np.float64(xr[j]) * rstd * w[j]
                continue
            for j in range(d):
                yr[j] = xr[j] * s_t * w[j]


#: Fewer rows than this go through the column-tiled backward (norm_bwd_cols): the
#: partial dgamma/dbeta rows of norm_bwd ([chunks, d] float64, zeroed, updated at every
#: row and summed) would move more bytes than the few rows themselves ([2, 2^20]: about
#: 150 MB for 12 MB of data, measured at a tenth of the forward's speed).
COLUMN_ROWS = 64
#: Columns per tile of the column-tiled backward: its dgamma/dbeta sums stay in L1.
TILE = 512


#: Partial sums of grad_sums, each over every LANES-th element of a row.
LANES = 16


@strict_inline
def _grad_sums(xr, wr, gr, mu, s, d, cv):
    """Sums over a row of h = g gamma and h x_hat (elementwise in the precision `cv`
    converts to, summed in float64): the terms of dx that need the whole row. Both
    backward layouts call it, and it is compiled without reassociation, in LANES
    partial sums, so its sums are added in this one order wherever it is called: a row's
    dx has the same bits whatever its batch. (Reassociation let LLVM vectorize the same
    loop differently in the two kernels: dx of a float64 row alone and in a batch of 69
    differed in 142 of 589 elements.)"""
    sh = np.zeros(LANES)
    shx = np.zeros(LANES)
    whole = d - d % LANES
    for j0 in range(0, whole, LANES):
        for k in range(LANES):
            h, t = _terms(xr, wr, gr, mu, s, j0 + k, cv)
            sh[k] += h
            shx[k] += t
    for j in range(whole, d):
        h, t = _terms(xr, wr, gr, mu, s, j, cv)
        sh[0] += h
        shx[0] += t
    return _fold(sh), _fold(shx)


@strict_inline
def _fold(a):
    """The lanes added pairwise, in a fixed order."""
    n = a.shape[0] // 2
    while n >= 1:
        for k in range(n):
            a[k] += a[k + n]
        n //= 2
    return a[0]


@strict_inline
def _terms(xr, wr, gr, mu, s, j, cv):
    h = cv(gr[j]) * wr[j]
    return np.float64(h), np.float64(h * ((cv(xr[j]) - mu) * s))


@strict_inline
def to_f64(v):
    return np.float64(v)


# _grad_sums compiled on its own for each element format (a function passed to a
# compiled, not inlined, function would make it uncacheable).
@strict
def grad_sums(xr, wr, gr, mu, s, d):
    return _grad_sums(xr, wr, gr, mu, s, d, to_f64)


@strict
def grad_sums_f16(xr, wr, gr, mu, s, d):
    return _grad_sums(xr, wr, gr, mu, s, d, decode_f16)


@strict
def grad_sums_bf16(xr, wr, gr, mu, s, d):
    return _grad_sums(xr, wr, gr, mu, s, d, decode_bf16)


@strict
def grad_sums_f32(xr, wr, gr, mu, s, d):
    return _grad_sums(xr, wr, gr, mu, s, d, as_f32)


@strict
def dx_span(xr, gr, wr, mu, s, mh, mhx, dxr, dwr, dbr):
    """dx over a span of a row (the whole row, or a tile of it), with the span's dgamma
    and dbeta terms added to dwr, dbr. Strict (no contraction into FMAs, which LLVM did
    in one kernel's loop and not in the other's): each element gets the same bits in
    either backward layout."""
    for j in range(xr.shape[0]):
        gv = np.float64(gr[j])
        xh = (np.float64(xr[j]) - mu) * s
        dxr[j] = s * (gv * np.float64(wr[j]) - mh - xh * mhx)
        dwr[j] += gv * xh
        dbr[j] += gv


@jit
def norm_bwd(x, w, g, mean, rstd, dx, dw_part, db_part, n_chunks, centre):
    """dx = r (h - mean(h) - x_hat mean(h x_hat)), h = g gamma (without the mean(h) term
    and with x_hat = x r for RMSNorm). Each chunk of rows keeps float64 partial sums of
    g x_hat and g; the caller adds the chunks (dL/dgamma, dL/dbeta)."""
    rows, d = x.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        dwc, dbc = dw_part[c], db_part[c]
        for r in range(c * per, min(rows, (c + 1) * per)):
            mu, s = mean[r], rstd[r]
            xr, gr, dxr = x[r], g[r], dx[r]
            sh, shx = grad_sums(xr, w, gr, mu, s, d)
            mh = sh / d if centre else 0.0
            mhx = shx / d
            dx_span(xr, gr, w, mu, s, mh, mhx, dxr, dwc, dbc)


@jit
def norm_bwd_cols(x, w, g, mean, rstd, dx, dw, db, centre):
    """norm_bwd for few rows (fewer than COLUMN_ROWS): the row sums of every row first,
    then dx and dgamma/dbeta tile by tile of TILE columns, each tile's sums over all rows
    kept in L1 and written once into `dw`, `db` (float64, the final sums)."""
    rows, d = x.shape
    mh = np.empty(rows)
    mhx = np.empty(rows)
    for r in prange(rows):
        sh, shx = grad_sums(x[r], w, g[r], mean[r], rstd[r], d)
        mh[r] = sh / d if centre else 0.0
        mhx[r] = shx / d
    for t in prange((d + TILE - 1) // TILE):
        j0, j1 = t * TILE, min(d, (t + 1) * TILE)
        dwt, dbt, wt = dw[j0:j1], db[j0:j1], w[j0:j1]
        dwt[:] = 0.0
        dbt[:] = 0.0
        for r in range(rows):
            dx_span(x[r, j0:j1], g[r, j0:j1], wt, mean[r], rstd[r], mh[r], mhx[r],
                    dx[r, j0:j1], dwt, dbt)


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

@inline
def as_f32(v):
    """The 'decoding' of float32 rows (fmt 2) in the float32-compute backward."""
    return np.float32(v)


@inline
def _half_sums(xr, d, k, dec):
    """Sums of (x - k) and (x - k)^2 over a 16-bit row, in float64 (k = 0 for RMSNorm)."""
    s1 = 0.0
    s2 = 0.0
    for j in range(d):
        t = np.float64(dec(xr[j])) - k
        s1 += t
        s2 += t * t
    return s1, s2

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
SHIFT_SAMPLES = 16
#: Below this mean square (of x - shift) float32 squares may have underflowed.
TINY_MEAN_SQUARE = 2.0 ** -80


@inline
def _half_sums32(xr, d, k, dec):
    """_half_sums with the arithmetic in float32 over blocks of SUM_BLOCK elements, each
    block's sums added in float64: float32 has no conversion to float64 per element,
    which made the sums cost as much as the rest of the forward. A float32 block sum
    rounds at most SUM_BLOCK / lanes + log2(lanes) times as LLVM vectorizes it (16 lanes
    here: 36 additions), and each term carries up to 3 more from before it is added
    (t = x - k, t * t): 39 roundings, 2^-18.7 relative, vectorized; at most
    SUM_BLOCK + 3 = 515 (2^-15.0) were the loop ever compiled scalar; the caller checks
    when either is not enough. Blocks of 512 rather than 128: the float32 sums of a row
    in L1 went from 11 to 16 G elements/s on one core (the horizontal sum of each
    block's vector is the difference). (Rows are sliced per block so that every index
    starts at 0: Numba then knows it is not negative.)"""
    s1 = 0.0
    s2 = 0.0
    for j0 in range(0, d, SUM_BLOCK):
        xb = xr[j0:j0 + SUM_BLOCK]
        a = np.float32(0.0)
        q = np.float32(0.0)
        for j in range(xb.shape[0]):
            t = dec(xb[j]) - k
            a += t
            q += t * t
        s1 += np.float64(a)
        s2 += np.float64(q)
    return s1, s2


@inline
def _shift(xr, d, dec):
    n = min(d, SHIFT_SAMPLES)
    k = 0.0
    for j in range(n):
        k += np.float64(dec(xr[j]))
    return np.float32(k / n)


@inline
def _half_stats(xr, d, eps, centre, dec):
    """Mean and 1/std of a 16-bit row (mean 0 for RMSNorm), from shifted sums taken in
    float32 blocks, the shift k the mean of the row's first SHIFT_SAMPLES elements
    (taken in float64, so it cannot overflow, then rounded to float32). Their error,
    relative to the variance, is at most 3 block roundings (see _half_sums32) times
    (1 + c^2), c = |mean - k| / std: with c^2 <= MAX_SHIFT_RATIO, below 12 * 2^-18.7 =
    2^-15.1 vectorized as here (rstd off by 2^-16.1, a 34th of float16's unit roundoff)
    and below 12 * 2^-15.0 = 2^-11.4 even scalar (rstd 2^-12.4, under half of it, which
    the output bound of the conformance checks covers). The mean of 16 elements is within a quarter of a
    standard deviation of the row's for most rows (c^2 ~ 1/16); with k = x[0], as before,
    one Gaussian row in 12 would have missed c^2 <= 3. A row outside that (outliers
    among its first elements), or whose float32 squares may have overflowed (bfloat16
    beyond ~1e19), underflowed (mean square below TINY_MEAN_SQUARE) or met NaN/inf, is
    summed again in float64."""
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
def _half_fwd_rows(x16, w, b, eps, y16, mean_out, rstd_out, r0, r1, centre, dec, enc):
    """Rows r0..r1 of the half forward, one row at a time: the statistics from one read
    of the row, then the row normalized from L1 (an 8 KB row of 4096 halves stays there)
    and written. gamma and beta are read as 16-bit patterns when they are exactly
    representable (`param_at`): two float32 vectors of 4096 fill L1 by themselves, and
    with them there every row's re-read came from L2 instead, which halved the speed of
    a streaming row loop. RMSNorm does not read beta at all. A row whose spread is
    beyond float32 (see EXTREME_RSTD) is normalized in float64."""
    d = x16.shape[1]
    for r in range(r0, r1):
        xr, yr = x16[r], y16[r]
        mu, rstd = _half_stats(xr, d, eps, centre, dec)
        mean_out[r], rstd_out[r] = mu, rstd
        m32, s32 = np.float32(mu), np.float32(rstd)
        if not rstd >= EXTREME_RSTD:
            for j in range(d):
                v = (np.float64(dec(xr[j])) - mu) * rstd * param_at(w, j, dec)
                yr[j] = enc(np.float32(v + param_at(b, j, dec) if centre else v))
        elif centre:
            for j in range(d):
                yr[j] = enc((dec(xr[j]) - m32) * s32 * param_at(w, j, dec)
                            + param_at(b, j, dec))
        else:
            for j in range(d):
                yr[j] = enc(dec(xr[j]) * s32 * param_at(w, j, dec))


@jit
def half_fwd(x16, w, b, eps, y16, mean_out, rstd_out, n_chunks, fmt, centre):
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
            _half_fwd_rows(x16, w, b, eps, y16, mean_out, rstd_out, r0, r1, centre,
                           decode_f16, encode_f16)
        else:
            _half_fwd_rows(x16, w, b, eps, y16, mean_out, rstd_out, r0, r1, centre,
                           decode_bf16, encode_bf16)


#: Rows whose dgamma/dbeta terms are summed in float32 before they are added to the
#: float64 partial sums: 32 additions cost at most 32 float32 roundings, 2^-19 relative.
FLUSH_ROWS = 32


@strict_inline
def _half_dx_span(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr, dec, enc):
    """dx_span in float32, on 16-bit rows (dec/enc their codec) or float32 ones
    (as_f32); dwr/dbr are float32 or float64 sums."""
    for j in range(xr.shape[0]):
        gv = dec(gr[j])
        xh = (dec(xr[j]) - m32) * s32
        dxr[j] = enc(s32 * (gv * wr[j] - mh - xh * mhx))
        dwr[j] += gv * xh
        dbr[j] += gv


@strict
def half_dx_span_f16(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr):
    _half_dx_span(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr, decode_f16, encode_f16)


@strict
def half_dx_span_bf16(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr):
    _half_dx_span(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr, decode_bf16, encode_bf16)


@strict
def dx_span_f32(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr):
    _half_dx_span(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr, as_f32, as_f32)


def _dx_span32_of(fmt, xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr):
    """The compiled dx span of `fmt`: chosen by the rows' dtype at compile time for
    float32, as a float16 kernel cannot even be typed on float32 rows."""


@overload(_dx_span32_of, inline="always")
def _dx_span_of(fmt, xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr):
    if xr.dtype == types.float32:
        return lambda fmt, xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr: dx_span_f32(
            xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr)

    def half(fmt, xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr):
        if fmt == 0:
            half_dx_span_f16(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr)
        else:
            half_dx_span_bf16(xr, gr, wr, m32, s32, mh, mhx, dxr, dwr, dbr)
    return half


def _grad_sums_of(fmt, xr, w, gr, m32, s32, d):
    """grad_sums of `fmt`, chosen as _dx_span32_of chooses."""


@overload(_grad_sums_of, inline="always")
def _sums_of(fmt, xr, w, gr, m32, s32, d):
    if xr.dtype == types.float32:
        return lambda fmt, xr, w, gr, m32, s32, d: grad_sums_f32(xr, w, gr, m32, s32, d)

    def half(fmt, xr, w, gr, m32, s32, d):
        if fmt == 0:
            return grad_sums_f16(xr, w, gr, m32, s32, d)
        return grad_sums_bf16(xr, w, gr, m32, s32, d)
    return half


@inline
def _row_means32(xr, w, gr, mean, rstd, d, centre, fmt):
    m32, s32 = np.float32(mean), np.float32(rstd)
    sh, shx = _grad_sums_of(fmt, xr, w, gr, m32, s32, d)
    mh = np.float32(sh / d) if centre else np.float32(0.0)
    return m32, s32, mh, np.float32(shx / d)


@inline
def _bwd32_rows(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre, fmt):
    """Rows r0..r1 of the float32-compute backward: the first pass (grad_sums) reads x
    and g and sums; the second reads them again from cache, writes dx (encoded once for
    16-bit rows) and adds the dgamma/dbeta terms. For 16-bit rows those are summed in
    float32 over at most FLUSH_ROWS rows (`dw32`, `db32`: 32 roundings of 2^-24 are
    2^-19, far below a 16-bit ulp), then added to the chunk's float64 sums; float32
    rows, whose own ulp that would not be below, add theirs to the float64 sums at
    once."""
    d = x.shape[1]
    if fmt == 2:
        for r in range(r0, r1):
            m32, s32, mh, mhx = _row_means32(x[r], w, g[r], mean[r], rstd[r], d, centre, fmt)
            _dx_span32_of(fmt, x[r], g[r], w, m32, s32, mh, mhx, dx[r], dwc, dbc)
        return
    for j in range(d):
        dw32[j] = 0.0
        db32[j] = 0.0
    for r in range(r0, r1):
        m32, s32, mh, mhx = _row_means32(x[r], w, g[r], mean[r], rstd[r], d, centre, fmt)
        _dx_span32_of(fmt, x[r], g[r], w, m32, s32, mh, mhx, dx[r], dw32, db32)
        if (r - r0) % FLUSH_ROWS == FLUSH_ROWS - 1 or r == r1 - 1:
            for j in range(d):
                dwc[j] += np.float64(dw32[j])
                dbc[j] += np.float64(db32[j])
                dw32[j] = 0.0
                db32[j] = 0.0


@jit
def bwd32_cols(x, w, g, mean, rstd, dx, dw, db, fmt, centre):
    """norm_bwd_cols computed in float32, on float16 (fmt 0) / bfloat16 (fmt 1) bits or
    float32 rows (fmt 2): _row_means32 of every row, then dx and the dgamma/dbeta sums
    (float64) tile by tile."""
    rows, d = x.shape
    means = np.empty((rows, 4), np.float32)
    for r in prange(rows):
        means[r, 0], means[r, 1], means[r, 2], means[r, 3] = _row_means32(
            x[r], w, g[r], mean[r], rstd[r], d, centre, fmt)
    for t in prange((d + TILE - 1) // TILE):
        j0, j1 = t * TILE, min(d, (t + 1) * TILE)
        dwt, dbt, wt = dw[j0:j1], db[j0:j1], w[j0:j1]
        dwt[:] = 0.0
        dbt[:] = 0.0
        for r in range(rows):
            _dx_span32_of(fmt, x[r, j0:j1], g[r, j0:j1], wt, means[r, 0], means[r, 1],
                          means[r, 2], means[r, 3], dx[r, j0:j1], dwt, dbt)


@jit
def bwd32(x, w, g, mean, rstd, dx, dw_part, db_part, dw32, db32, n_chunks, fmt, centre):
    """norm_bwd computed in float32 (w too), on float16 (fmt 0) / bfloat16 (fmt 1) bits,
    x and g decoded and dx encoded in the kernel, or on float32 rows (fmt 2); the row
    sums in float64 (norm_bwd, all in float64, is for float64 rows). Partial dgamma/dbeta
    per chunk of rows in float64 (the caller adds the chunks and rounds once); dw32/db32
    are float32 scratch rows, one per chunk, that the caller allocates with the
    outputs."""
    rows, d = x.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        r0, r1 = c * per, min(rows, (c + 1) * per)
        _bwd32_rows(x, w, g, mean, rstd, dx, dw_part[c], db_part[c], dw32[c], db32[c], r0, r1,
                    centre, fmt)
