"""The BatchNorm kernels: per-channel statistics over the batch and every axis after the
channel (float64 accumulation), the normalization, and the backward (the training
formula with batch statistics, dx = gamma g r with running ones).

A channel's sums run over n x length elements, millions for a large batch, so none of
them is one long sequential sum. The channel is cut into pieces of at most PIECE
elements (a stretch of one row or, in the backward, several whole short rows); a piece
is summed in lanes in a fixed order (the statistics by _numba_moments.moment_sums, at
most 17 additions in a lane; the backward's sum g and sum g x_hat by the LayerNorm
backward's _numba_backward.add_row, at most 48: PIECE / 16 plus one leftover element
per row), and the pieces' sums are added pairwise (`pairwise`, log2 of their number
deep). That is the growth of a blocked sum, which the tolerance table allows
(conformance/tolerances.py). The kernels before added rows' sums in row order, and the
backward every element in turn: at [131072, 2, 32] float64, dL/dbeta erred by 462 ULPs
against a bound of 247 and running_mean by 105 against 47 (0 and 1 now, measured). The
order is fixed, so a run gives the same bits whether it compiled the kernels or loaded
them from Numba's cache (see _numba_moments); the kernels that sum are compiled strict
(no fast-math flag)."""

import math

import numpy as np
from numba import prange

from ._numba_backward import _fold, _of, add_row, as_f32, to_f64
from ._numba_jit import jit, jit_strict, strict, strict_inline
from ._numba_lanes import BLOCK_STEPS, LANES
from ._numba_moments import moment_sums

#: Channels whose rows x[i, c, :] are shorter than this are laid out as one row first
#: (numba_kernels.NumbaBatchNorm): pieces of a few elements each are slow to sum.
SHORT_ROWS = 32
#: Elements per piece of a row (see the module doc).
PIECE = 512


@strict_inline
def pairwise(a, n):
    """a[0] + ... + a[n - 1] (0.0 for none), neighbours added, then neighbours of those
    sums, and so on: each term goes through at most ceil(log2 n) additions. Overwrites a."""
    while n > 1:
        half = n // 2
        for k in range(half):
            a[k] = a[2 * k] + a[2 * k + 1]
        if n % 2:
            a[half] = a[n - 1]
        n = half + n % 2
    return a[0] if n == 1 else 0.0


@strict_inline
def _pieces(length):
    return (length + PIECE - 1) // PIECE


@jit_strict
def bn_stats(x, mean_out, sumsq_out):
    """Per channel c, the mean and the sum of squared deviations from it of x[:, c, :]
    (C-contiguous [n, ch, length], float32 or float64), two passes over the pieces."""
    n, ch, length = x.shape
    per = _pieces(length)
    for c in prange(ch):
        sums = np.empty(n * per)
        for i in range(n):
            for p in range(per):
                sums[i * per + p] = moment_sums(x[i, c, p * PIECE:min(length, (p + 1) * PIECE)],
                                                0.0, None)[0]
        mu = pairwise(sums, n * per) / (n * length)
        for i in range(n):
            for p in range(per):
                sums[i * per + p] = moment_sums(x[i, c, p * PIECE:min(length, (p + 1) * PIECE)],
                                                mu, None)[1]
        mean_out[c] = mu
        sumsq_out[c] = pairwise(sums, n * per)


#: Rows and channels per tile of `channels_first`.
TILE = 32


@jit
def channels_first(a, out):
    """out[c, i, :] = a[i, c, :] for [n, ch, length] a, tile by tile of TILE rows and
    channels, so that reads and writes both run along cache lines (NumPy's copy of the
    transposed view took 30 ms for [4096, 1024] float32, 10x this)."""
    n, ch, length = a.shape
    row_tiles = (n + TILE - 1) // TILE
    for t in prange(row_tiles * ((ch + TILE - 1) // TILE)):
        i0, c0 = (t % row_tiles) * TILE, (t // row_tiles) * TILE
        for c in range(c0, min(ch, c0 + TILE)):
            for i in range(i0, min(n, i0 + TILE)):
                for l_ in range(length):
                    out[c, i, l_] = a[i, c, l_]


@jit
def bn_apply(x, mean, var, w, b, eps, y):
    """y = (x - mean) r gamma + beta, r = 1 / sqrt(var + eps), x[i, :, :] by x[i, :, :]:
    in memory order (channel by channel, each row a stride apart, was 1.25-6.2x as slow
    at three float32 shapes; [4096, 1024]: 17.4 against 2.8 ms)."""
    n, ch, length = x.shape
    r = _rstd(var, eps)
    for i in prange(n):
        for c in range(ch):
            mc, rc, wc, bc = mean[c], r[c], w[c], b[c]
            for l_ in range(length):
                y[i, c, l_] = (np.float64(x[i, c, l_]) - mc) * rc * wc + bc


@strict
def _rstd(var, eps):
    """1 / sqrt(var + eps) per channel."""
    r = np.empty(var.shape[0])
    for c in range(var.shape[0]):
        r[c] = 1.0 / math.sqrt(var[c] + eps)
    return r


@strict_inline
def _group_sums(x, g, ones, c, i0, i1, j0, j1, mean, rstd, lanes, cv, block_steps):
    """(sum g, sum g x_hat) over x[i0:i1, c, j0:j1]: every row's terms added into one
    set of lanes (add_row), then the lanes pairwise."""
    for k in range(LANES):
        lanes[0, k] = 0.0
        lanes[1, k] = 0.0
    for i in range(i0, i1):
        add_row(x[i, c, j0:j1], ones[:j1 - j0], g[i, c, j0:j1], mean, rstd, lanes, cv,
                block_steps, 1)
    return _fold(lanes[0]), _fold(lanes[1])


@strict_inline
def _piece(x, g, ones, c, i0, i1, j0, j1, mean, rstd, lanes, cv):
    """_group_sums, summed again with every term straight into float64 where the float32
    partial sums overflowed (as _numba_backward.row_sums does for a row)."""
    sg, sgx = _group_sums(x, g, ones, c, i0, i1, j0, j1, mean, rstd, lanes, cv, BLOCK_STEPS)
    if not (math.isfinite(sg) and math.isfinite(sgx)):
        sg, sgx = _group_sums(x, g, ones, c, i0, i1, j0, j1, mean, rstd, lanes, cv, 1)
    return sg, sgx


@strict
def _piece_f64(x, g, ones, c, i0, i1, j0, j1, mean, rstd, lanes):
    return _piece(x, g, ones, c, i0, i1, j0, j1, np.float64(mean), np.float64(rstd), lanes,
                  to_f64)


@strict
def _piece_f32(x, g, ones, c, i0, i1, j0, j1, mean, rstd, lanes):
    return _piece(x, g, ones, c, i0, i1, j0, j1, np.float32(mean), np.float32(rstd), lanes,
                  as_f32)


#: A piece's (sum g, sum g x_hat), by the rows' dtype (BatchNorm's rows are float32 or
#: float64: the adapter converts 16-bit ones, so there is no 16-bit function).
_piece_of = _of((_piece_f64, _piece_f32, None, None))


@jit_strict
def bn_grad_sums(x, g, mean, var, eps, ones, sg_out, sgx_out):
    """Per channel c, dL/dbeta = sum g and dL/dgamma = sum g x_hat over x[:, c, :] and
    g[:, c, :] (C-contiguous [n, ch, length], one dtype), x_hat from mean and var; the
    terms in the rows' precision, as the LayerNorm backward's (gamma = 1: `ones`, PIECE
    of the rows' dtype). A piece is PIECE elements of a row, or as many whole rows as
    fit in PIECE elements, which then share one set of lanes (folding the lanes after
    every row made the sums twice as slow at [256, 512, 49] float32)."""
    n, ch, length = x.shape
    per = _pieces(length)
    rows = max(1, PIECE // length)
    groups = (n + rows - 1) // rows
    for c in prange(ch):
        sg, sgx = np.empty(groups * per), np.empty(groups * per)
        lanes = np.empty((2, LANES))
        rstd = 1.0 / math.sqrt(var[c] + eps)
        for q in range(groups):
            i0, i1 = q * rows, min(n, (q + 1) * rows)
            for p in range(per):
                j0, j1 = p * PIECE, min(length, (p + 1) * PIECE)
                sg[q * per + p], sgx[q * per + p] = _piece_of(
                    0, x, g, ones, c, i0, i1, j0, j1, mean[c], rstd, lanes)
        sg_out[c] = pairwise(sg, groups * per)
        sgx_out[c] = pairwise(sgx, groups * per)


@jit_strict
def bn_dx(x, w, g, mean, var, eps, sg, sgx, dx, batch):
    """dL/dx from the sums bn_grad_sums made. With `batch` the statistics are the
    batch's, functions of x: dx = r (h - mean(h) - x_hat mean(h x_hat)), h = g gamma, so
    mean(h) = gamma sum g / m and mean(h x_hat) = gamma sum g x_hat / m. Without (eval
    on running statistics) they are constants and dx = r h. In memory order, as
    bn_apply (1.4-2.9x faster than channel by channel at four float32 shapes)."""
    n, ch, length = x.shape
    m = n * length
    r = _rstd(var, eps)
    for i in prange(n):
        for c in range(ch):
            rc, wc = r[c], w[c]
            if not batch:
                for l_ in range(length):
                    dx[i, c, l_] = rc * np.float64(g[i, c, l_]) * wc
                continue
            mc, mh, mhx = mean[c], wc * sg[c] / m, wc * sgx[c] / m
            for l_ in range(length):
                xh = (np.float64(x[i, c, l_]) - mc) * rc
                dx[i, c, l_] = rc * (np.float64(g[i, c, l_]) * wc - mh - xh * mhx)
