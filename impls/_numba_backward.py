"""The backward of LayerNorm and RMSNorm on rows:

    dx = r (h - mean(h) - x_hat mean(h x_hat)),  h = g gamma,

without the mean(h) term and with x_hat = x r for RMSNorm; dgamma = sum g x_hat and
dbeta = sum g over the rows. Computed in float64 for float64 rows and in float32 for
float32, float16 and bfloat16 rows (16-bit rows decoded and dx encoded in the kernel),
the row sums in float64 lanes (fed by short float32 partial sums, see _numba_lanes).

Two layouts: rows in contiguous chunks, one per thread, each chunk keeping partial
dgamma/dbeta sums (`bwd`); and, for fewer than COLUMN_ROWS rows, the row sums of every
row first, then dx and dgamma/dbeta tile by tile of columns (`bwd_cols`; two rows in one
pass over each tile, which stores each sum once, see sums_dtype). A row's dx has the
same bits in both, whatever the batch: every layout computes it through _element, and
both kernels and all they call are compiled strict (no fast-math flag, so LLVM may not
reassociate a sum or contract a product into an FMA, either of which it had done in one
layout's loop and not in the other's, and no two codings of a loop can differ). A NaN's
sign and payload are the exception: which of two NaN operands x86 passes on depends on
the operand order LLVM picks, which IEEE 754 leaves open (tests/test_numba_batch_bits.py
checks that NaN stays NaN in the same places). None of it needs fast-math to vectorize:
the row sums are LANES partial sums added in a fixed order (_numba_lanes), the rest is
elementwise. The per-format functions below are the same code compiled once per element
format (a function passed to a compiled, not inlined, function would make it uncacheable)."""

import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from ._numba_jit import jit_strict, strict, strict_inline
from ._numba_lanes import BLOCK_STEPS, LANES, lane_sums
from ._numba_rows import decode_bf16, decode_f16, encode_bf16, encode_f16

#: Fewer rows than this take bwd_cols: the partial dgamma/dbeta rows of bwd ([chunks, d]
#: float64, zeroed, updated at every row and summed) would move more bytes than the few
#: rows themselves ([2, 2^20]: about 150 MB for 12 MB of data, measured at a tenth of
#: the forward's speed).
COLUMN_ROWS = 64
#: Columns per tile of bwd_cols: its dgamma/dbeta sums stay in L1.
TILE = 512
#: bwd_cols takes a batch of this many rows in one pass over each tile (_pair), and
#: writes their dgamma/dbeta sums once, in float32 for float32 and 16-bit rows
#: (sums_dtype); other row counts row by row, into float64 sums.
PAIR_ROWS = 2
#: Rows whose dgamma/dbeta terms 16-bit rows sum in float32 before they are added to the
#: float64 partial sums: 32 roundings of 2^-24 are 2^-19, far below a 16-bit ulp.
FLUSH_ROWS = 32
#: The same for float32 rows, whose own ulp that would not be below: a float32 sum of k
#: <= 8 terms errs by at most (k - 1) u_32 times their magnitudes, and with the terms'
#: own roundings (g x_hat: 3) dgamma/dbeta by at most 10 float32 ULPs at the scale of the
#: sum of magnitudes, where the tolerance table ('param_gradient') allows 1 + 4 (log2 n +
#: 1) with n = rows x d >= 64 (bwd takes COLUMN_ROWS rows or more): >= 29. Adding every
#: term to the float64 sums instead, as float64 rows do, made the [256, 1000] float32
#: backward 8% slower (64 against 59 us, one process).
FLUSH_ROWS_F32 = 8


@strict_inline
def to_f64(v):
    """The 'decoding' (and encoding) of float64 rows."""
    return np.float64(v)


@strict_inline
def as_f32(v):
    """The 'decoding' (and encoding) of float32 rows."""
    return np.float32(v)


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
def _terms(xr, wr, gr, m, s, j, cv):
    h = cv(gr[j]) * wr[j]
    return np.float64(h), np.float64(h * ((cv(xr[j]) - m) * s))


@strict_inline
def add_row(xr, wr, gr, m, s, lanes, cv, block_steps, accumulate):
    """The row's terms h and h x_hat into `lanes`: lane_sums over its whole steps of
    LANES elements (written over the lanes, or added to them with accumulate=1), then the
    rest of the row added into the first lanes."""
    d = xr.shape[0]
    whole = d - d % LANES
    lane_sums(xr, wr, gr, m, s, lanes, whole, block_steps, cv, accumulate)
    for j in range(whole, d):
        h, t = _terms(xr, wr, gr, m, s, j, cv)
        lanes[0, j - whole] += h
        lanes[1, j - whole] += t


@strict_inline
def _lane_row_sums(xr, wr, gr, m, s, lanes, cv, block_steps):
    add_row(xr, wr, gr, m, s, lanes, cv, block_steps, 0)
    return _fold(lanes[0]), _fold(lanes[1])


@strict_inline
def row_sums(xr, wr, gr, m, s, lanes, cv):
    """Sums over a row of h and h x_hat (elementwise in the precision `cv` converts to),
    in LANES float64 partial sums (`lanes`, the caller's scratch, two rows of LANES)
    added in a fixed order: _numba_lanes.lane_sums over the whole steps of LANES
    elements, then the rest of the row into the first lanes, then the lanes pairwise.
    Nothing is reassociated, so that is the only order there is, wherever this is
    compiled. A row whose sums come out inf or NaN is summed again with every term
    straight into float64: its short float32 partial sums may have overflowed where the
    float64 sums do not (and where a term itself is inf or NaN, the answer stays so)."""
    sh, shx = _lane_row_sums(xr, wr, gr, m, s, lanes, cv, BLOCK_STEPS)
    if not (math.isfinite(sh) and math.isfinite(shx)):
        sh, shx = _lane_row_sums(xr, wr, gr, m, s, lanes, cv, 1)
    return sh, shx


@strict_inline
def _means(xr, wr, gr, mean, rstd, centre, lanes, cv, ct):
    """mean and 1/std of a row in the compute dtype `ct`, and mean(h), mean(h x_hat)."""
    d = xr.shape[0]
    m, s = ct(mean), ct(rstd)
    sh, shx = row_sums(xr, wr, gr, m, s, lanes, cv)
    return m, s, ct(sh / d) if centre else ct(0.0), ct(shx / d)


@strict_inline
def _element(xr, gr, wr, j, m, s, mh, mhx, cv):
    """Element j of a row: its dx (not yet encoded), its dbeta term g and its dgamma term
    g x_hat. Every layout computes dx through here, so a row's dx has the same bits in
    each."""
    gv = cv(gr[j])
    xh = (cv(xr[j]) - m) * s
    return s * (gv * wr[j] - mh - xh * mhx), gv, gv * xh


@strict_inline
def _span(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr, cv, enc):
    """dx over a span of a row (the whole row, or a tile of it), and the span's dgamma
    and dbeta terms added to dwr, dbr."""
    for j in range(xr.shape[0]):
        v, gv, t = _element(xr, gr, wr, j, m, s, mh, mhx, cv)
        dxr[j] = enc(v)
        dwr[j] += t
        dbr[j] += gv


@strict_inline
def _pair(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db, cv, enc):
    """dx of two rows over a tile (sc: each row's mean, 1/std, mean(h), mean(h x_hat)),
    and dw, db = the sums of their dgamma/dbeta terms, added in float64 in row order as
    _span adds them, rounded to dw's dtype: one pass, each sum stored once."""
    for j in range(w.shape[0]):
        v0, b0, t0 = _element(x0, g0, w, j, sc[0], sc[1], sc[2], sc[3], cv)
        v1, b1, t1 = _element(x1, g1, w, j, sc[4], sc[5], sc[6], sc[7], cv)
        dx0[j] = enc(v0)
        dx1[j] = enc(v1)
        dw[j] = (0.0 + np.float64(t0)) + np.float64(t1)
        db[j] = (0.0 + np.float64(b0)) + np.float64(b1)


@strict_inline
def _flush(dw32, db32, dwc, dbc):
    """dwc += dw32 and dbc += db32 in float64, and those float32 sums zeroed, except the
    ones that are inf or NaN, which stay (nothing added); the number of those. (Written
    with selects, no branch, so that it vectorizes: a scan for them that stopped at the
    first made the [256, 1000] float32 backward 30% slower.)"""
    bad = 0
    for j in range(dw32.shape[0]):
        a, b = dw32[j], db32[j]
        a_ok, b_ok = math.isfinite(a), math.isfinite(b)
        dwc[j] += np.float64(a) if a_ok else 0.0
        dbc[j] += np.float64(b) if b_ok else 0.0
        dw32[j] = np.float32(0.0) if a_ok else a
        db32[j] = np.float32(0.0) if b_ok else b
        bad += (not a_ok) + (not b_ok)
    return bad


@strict_inline
def _redo_columns(x, g, scales, r0, r1, dw32, db32, dwc, dbc, cv):
    """The dgamma/dbeta terms of rows r0..r1 in the columns whose float32 sums are inf or
    NaN, each added straight into float64 (`scales`: each row's mean and 1/std in the
    compute dtype), and those float32 sums zeroed."""
    for j in range(dw32.shape[0]):
        w_bad, b_bad = not math.isfinite(dw32[j]), not math.isfinite(db32[j])
        if not (w_bad or b_bad):
            continue
        for q in range(r0, r1):
            gv = cv(g[q, j])
            if w_bad:
                dwc[j] += gv * ((cv(x[q, j]) - scales[q - r0, 0]) * scales[q - r0, 1])
            if b_bad:
                dbc[j] += gv
        dw32[j] = 0.0
        db32[j] = 0.0


@strict_inline
def _chunk(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre, cv, enc, ct,
           flush_rows):
    """Rows r0..r1: each row's sums from one pass, then dx and the dgamma/dbeta terms
    from a second over the row in cache; the terms added to the chunk's float64 sums
    dwc, dbc directly (flush_rows 0), or first in float32 over `flush_rows` rows (dw32,
    db32). A column whose float32 sum over a block comes out inf or NaN has that block's
    terms added again, each straight into float64: they may have overflowed float32
    where the float64 sum does not (terms near float32's largest, as float32 and bfloat16
    rows have; found by a review: dL/dbeta inf for three terms of +-2e38)."""
    lanes = np.empty((2, LANES))
    if flush_rows == 0:
        for r in range(r0, r1):
            m, s, mh, mhx = _means(x[r], w, g[r], mean[r], rstd[r], centre, lanes, cv, ct)
            _span(x[r], g[r], w, m, s, mh, mhx, dx[r], dwc, dbc, cv, enc)
        return
    scales = np.empty((flush_rows, 2), ct)
    dw32[:] = 0.0
    db32[:] = 0.0
    first = r0
    for r in range(r0, r1):
        m, s, mh, mhx = _means(x[r], w, g[r], mean[r], rstd[r], centre, lanes, cv, ct)
        scales[r - first, 0], scales[r - first, 1] = m, s
        _span(x[r], g[r], w, m, s, mh, mhx, dx[r], dw32, db32, cv, enc)
        if r - first == flush_rows - 1 or r == r1 - 1:
            if _flush(dw32, db32, dwc, dbc):
                _redo_columns(x, g, scales, first, r + 1, dw32, db32, dwc, dbc, cv)
            first = r + 1


# ---------------------------------------------------------------- one per format
@strict
def chunk_f64(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre):
    _chunk(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre, to_f64, to_f64,
           np.float64, 0)


@strict
def chunk_f32(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre):
    _chunk(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre, as_f32, as_f32,
           np.float32, FLUSH_ROWS_F32)


@strict
def chunk_f16(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre):
    _chunk(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre, decode_f16,
           encode_f16, np.float32, FLUSH_ROWS)


@strict
def chunk_bf16(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre):
    _chunk(x, w, g, mean, rstd, dx, dwc, dbc, dw32, db32, r0, r1, centre, decode_bf16,
           encode_bf16, np.float32, FLUSH_ROWS)


@strict
def means_f64(xr, wr, gr, mean, rstd, centre, lanes):
    return _means(xr, wr, gr, mean, rstd, centre, lanes, to_f64, np.float64)


@strict
def means_f32(xr, wr, gr, mean, rstd, centre, lanes):
    return _means(xr, wr, gr, mean, rstd, centre, lanes, as_f32, np.float32)


@strict
def means_f16(xr, wr, gr, mean, rstd, centre, lanes):
    return _means(xr, wr, gr, mean, rstd, centre, lanes, decode_f16, np.float32)


@strict
def means_bf16(xr, wr, gr, mean, rstd, centre, lanes):
    return _means(xr, wr, gr, mean, rstd, centre, lanes, decode_bf16, np.float32)


@strict
def span_f64(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr):
    _span(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr, to_f64, to_f64)


@strict
def span_f32(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr):
    _span(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr, as_f32, as_f32)


@strict
def span_f16(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr):
    _span(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr, decode_f16, encode_f16)


@strict
def span_bf16(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr):
    _span(xr, gr, wr, m, s, mh, mhx, dxr, dwr, dbr, decode_bf16, encode_bf16)


@strict
def pair_f64(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db):
    _pair(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db, to_f64, to_f64)


@strict
def pair_f32(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db):
    _pair(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db, as_f32, as_f32)


@strict
def pair_f16(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db):
    _pair(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db, decode_f16, encode_f16)


@strict
def pair_bf16(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db):
    _pair(x0, g0, x1, g1, w, sc, dx0, dx1, dw, db, decode_bf16, encode_bf16)


def _of(by_format):
    """A dispatcher over `by_format` (float64, float32, float16, bfloat16 functions),
    chosen by the rows' dtype when compiling (a float16 function cannot even be typed
    on float32 rows) and, for 16-bit rows, by fmt (0 float16, 1 bfloat16)."""
    f64, f32, f16, bf16 = by_format

    def pick(fmt, x, *args):
        """See _of."""

    @overload(pick)
    def _pick(fmt, x, *args):
        if x.dtype == types.float64:
            return lambda fmt, x, *args: f64(x, *args)
        if x.dtype == types.float32:
            return lambda fmt, x, *args: f32(x, *args)

        def half(fmt, x, *args):
            if fmt == 0:
                return f16(x, *args)
            return bf16(x, *args)
        return half
    return pick


chunk_of = _of((chunk_f64, chunk_f32, chunk_f16, chunk_bf16))
means_of = _of((means_f64, means_f32, means_f16, means_bf16))
span_of = _of((span_f64, span_f32, span_f16, span_bf16))
pair_of = _of((pair_f64, pair_f32, pair_f16, pair_bf16))


@strict
def _zero(a, b):
    for j in range(a.shape[0]):
        a[j] = 0.0
        b[j] = 0.0


@strict
def _add_into(a, b, a2, b2):
    """a += a2, b += b2 as loops: Numba turns array expressions in a parallel kernel into
    parallel regions of their own, and with them (and the zeroing) written so the
    [256, 1000] float32 backward kept only 1 of the 11 us these two saved."""
    for j in range(a.shape[0]):
        a[j] += a2[j]
        b[j] += b2[j]


@jit_strict
def bwd(x, w, g, mean, rstd, dx, dw_part, db_part, dw32, db32, fmt, centre):
    """The backward in chunks of rows, one per row of dw_part (one per thread, as the
    caller allocates them: the chunks are counted from the buffers, so there is never
    one without its row; a count passed beside them, made for another thread count, once
    wrote past them): float64 partial dgamma/dbeta per chunk, added in chunk order into
    dw_part[0] and db_part[0] once all are done (the caller rounds them once); dw32/db32
    are float32 scratch rows, as many. Those per-chunk rows may be longer than d (padded
    so that each starts on a cache line): the kernel uses the first d. w is float64 for
    float64 rows, float32 otherwise; fmt: 0 float16, 1 bfloat16 (16-bit rows only). The
    zeroing and the final sums are here rather than NumPy calls around the kernel: at
    [256, 1000] float32 the backward then took 58 us instead of 69 (one process, same
    bits)."""
    rows, d = x.shape
    n_chunks = dw_part.shape[0]
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        r0, r1 = c * per, min(rows, (c + 1) * per)
        _zero(dw_part[c, :d], db_part[c, :d])
        chunk_of(fmt, x, w, g, mean, rstd, dx, dw_part[c, :d], db_part[c, :d], dw32[c, :d],
                 db32[c, :d], r0, r1, centre)
    for c in range(1, n_chunks):
        _add_into(dw_part[0, :d], db_part[0, :d], dw_part[c, :d], db_part[c, :d])


def sums_dtype(rows: int, dtype) -> type:
    """The dtype bwd_cols writes dgamma/dbeta of `rows` rows of `dtype` in: float32 for
    PAIR_ROWS float32 or 16-bit rows, whose sums it writes once, rounded (the float64
    sums of two wide rows are more bytes than the rows: [2, 2^20] float32 took 1.2x as
    long); float64 otherwise, where the outputs hold the sums while rows are added.
    For 16-bit rows the caller rounds these float32 sums once more, to their dtype, as a
    kernel that computes in float32 does: the first rounding is one in the compute
    precision (at most u_32 of the sum, 2^-13 of a float16 ULP), which the growth term
    of the 'param_gradient' row covers (at least 4 u_32 of the sum of |terms|), and it
    can turn a float16 midpoint into a tie (found by a review: 1 + 2^-11 + 2^-48 gave
    1.0, not 1.001; about one element in 11,000 of random float16 rows moves by 1 ULP).
    Rounding to odd instead, which makes the two roundings one, cost 15% of the
    [2, 2^20] float16/bfloat16 forward+backward (measured), as much as float32 sums
    gained there."""
    return np.float32 if rows == PAIR_ROWS and np.dtype(dtype) != np.float64 else np.float64


@jit_strict
def bwd_cols(x, w, g, mean, rstd, dx, dw, db, means, fmt, centre):
    """The backward for few rows: means() of every row (into `means`, [rows, 4] of the
    compute dtype), then dx and the dgamma/dbeta sums tile by tile of TILE columns,
    written into dw, db (of sums_dtype): two rows in one pass (_pair), more row by row
    into the tile of dw, db, which stays in L1."""
    rows, d = x.shape
    for r in prange(rows):
        means[r, 0], means[r, 1], means[r, 2], means[r, 3] = means_of(
            fmt, x[r], w, g[r], mean[r], rstd[r], centre, np.empty((2, LANES)))
    for t in prange((d + TILE - 1) // TILE):
        j0, j1 = t * TILE, min(d, (t + 1) * TILE)
        dwt, dbt, wt = dw[j0:j1], db[j0:j1], w[j0:j1]
        if rows == PAIR_ROWS:
            sc = (means[0, 0], means[0, 1], means[0, 2], means[0, 3],
                  means[1, 0], means[1, 1], means[1, 2], means[1, 3])
            pair_of(fmt, x[0, j0:j1], g[0, j0:j1], x[1, j0:j1], g[1, j0:j1], wt, sc,
                    dx[0, j0:j1], dx[1, j0:j1], dwt, dbt)
            continue
        dwt[:] = 0.0
        dbt[:] = 0.0
        for r in range(rows):
            span_of(fmt, x[r, j0:j1], g[r, j0:j1], wt, means[r, 0], means[r, 1], means[r, 2],
                    means[r, 3], dx[r, j0:j1], dwt, dbt)
