"""The BatchNorm kernels: per-channel statistics over the batch and every axis after the
channel (float64 accumulation), the normalization, and the backward (the training
formula with batch statistics, dx = gamma g r with running ones).

A channel's sums run over n x length elements, millions for a large batch, so none of
them is one long sequential sum. The channel is cut into pieces of at most PIECE
elements (a stretch of one row or, in the backward, several whole short rows); a piece
is summed in lanes in a fixed order (the statistics by _numba_moments.moment_sums, at
most 16 additions in a lane; the backward's sums, terms in float64, by the LayerNorm
backward's _numba_backward.add_row, at most 45: PIECE / 16 and one leftover element per
row, at rows of 33 and 34), and the pieces' sums are added pairwise (`pairwise`, log2
of their number deep). A channel of at most SHORT_CHANNEL values adds its terms
pairwise directly. That is the growth of a blocked sum, which the tolerance table
allows (conformance/tolerances.py). The kernels before added rows' sums in row order,
and the backward every element in turn: at [131072, 2, 32] float64, dL/dbeta erred by
462 ULPs against a bound of 247 and running_mean by 105 against 47 (0 and 1 now,
measured). The order is fixed, so a run gives the same bits whether it compiled the
kernels or loaded them from Numba's cache (see _numba_moments); the kernels that sum are
compiled strict (no fast-math flag)."""

import math

import numpy as np
from numba import prange

from ._numba_backward import _fold, _terms, add_row, to_f64
from ._numba_jit import jit, jit_strict, strict, strict_inline
from ._numba_lanes import LANES
from ._numba_moments import moment_sums

#: Channels whose rows x[i, c, :] are shorter than this are laid out as one row first
#: (numba_kernels.NumbaBatchNorm): pieces of a few elements each are slow to sum.
SHORT_ROWS = 32
#: Elements per piece of a row (see the module doc).
PIECE = 512
#: Channels of at most this many values (n x length) sum their terms pairwise, with no
#: lanes: zeroing and folding the lanes cost more than the few terms ([N, C] with a
#: small batch, such as [2, 100000]). As many as the lanes, whose scratch holds the
#: backward's terms then.
SHORT_CHANNEL = LANES
#: Chunks of channels the kernels that sum run in parallel (each allocates its scratch
#: once: allocated per channel, the forward+backward of [2, 100000] took 1.2x as long).
CHUNKS = 64


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


@strict_inline
def _channel_moment(x, c, k, which, sums):
    """sum (x - k) (which 0) or sum (x - k)^2 (which 1) over x[:, c, :]: each piece's
    moment_sums, then the pieces pairwise; a short channel's terms pairwise (`sums`:
    scratch for max(n x pieces per row, SHORT_CHANNEL))."""
    n, length = x.shape[0], x.shape[2]
    if n * length <= SHORT_CHANNEL:
        for i in range(n):
            for l_ in range(length):
                d = np.float64(x[i, c, l_]) - k
                sums[i * length + l_] = d if which == 0 else d * d
        return pairwise(sums, n * length)
    per = _pieces(length)
    for i in range(n):
        for p in range(per):
            sums[i * per + p] = moment_sums(x[i, c, p * PIECE:min(length, (p + 1) * PIECE)],
                                            k, None)[which]
    return pairwise(sums, n * per)


@jit_strict
def bn_stats(x, mean_out, sumsq_out):
    """Per channel c, the mean and the sum of squared deviations from it of x[:, c, :]
    (C-contiguous [n, ch, length], float32 or float64), two passes over the pieces."""
    n, ch, length = x.shape
    chunks = min(ch, CHUNKS)
    for t in prange(chunks):
        sums = np.empty(max(n * _pieces(length), SHORT_CHANNEL))
        for c in range(t * ch // chunks, (t + 1) * ch // chunks):
            mu = _channel_moment(x, c, 0.0, 0, sums) / (n * length)
            mean_out[c] = mu
            sumsq_out[c] = _channel_moment(x, c, mu, 1, sums)


#: Rows and channels per tile of `channels_first`.
TILE = 32


@jit
def channels_first(a, out):
    """out[c, i, :] = a[i, c, :] for [n, ch, length] a, tile by tile of TILE rows and
    channels, so that reads and writes both run along cache lines (NumPy's copy of the
    transposed view took 30 ms for [4096, 1024] float32, 4.7x this)."""
    n, ch, length = a.shape
    row_tiles = (n + TILE - 1) // TILE
    for t in prange(row_tiles * ((ch + TILE - 1) // TILE)):
        i0, c0 = (t % row_tiles) * TILE, (t // row_tiles) * TILE
        for c in range(c0, min(ch, c0 + TILE)):
            if length == 1:  # ([N, C]: a loop of one element per copy took 2.7x as long)
                for i in range(i0, min(n, i0 + TILE)):
                    out[c, i, 0] = a[i, c, 0]
                continue
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
    if length == 1:  # [N, C]: the loop over channels is the inner one (2-D views)
        x2, y2 = x.reshape(n, ch), y.reshape(n, ch)
        for i in prange(n):
            for c in range(ch):
                y2[i, c] = _normalized(x2[i, c], mean[c], r[c], w[c], b[c])
        return
    for i in prange(n):
        for c in range(ch):
            mc, rc, wc, bc = mean[c], r[c], w[c], b[c]
            for l_ in range(length):
                y[i, c, l_] = _normalized(x[i, c, l_], mc, rc, wc, bc)


@strict_inline
def _normalized(xv, mean, rstd, w, b):
    """One element of the output (inlined, so compiled with the caller's flags)."""
    return (np.float64(xv) - mean) * rstd * w + b


@strict_inline
def _grad(xv, gv, mean, rstd, w, mh, mhx, batch):
    """One element of dL/dx: r (h - mean(h) - x_hat mean(h x_hat)) with batch
    statistics, r h with running ones (h = g gamma)."""
    if not batch:
        return rstd * np.float64(gv) * w
    xh = (np.float64(xv) - mean) * rstd
    return rstd * (np.float64(gv) * w - mh - xh * mhx)


@strict
def _rstd(var, eps):
    """1 / sqrt(var + eps) per channel."""
    r = np.empty(var.shape[0])
    for c in range(var.shape[0]):
        r[c] = 1.0 / math.sqrt(var[c] + eps)
    return r


@strict_inline
def _grouping(n, length):
    """The backward's pieces of a channel of n rows of `length`: (rows per group, groups,
    pieces per row), each piece PIECE elements of one row or as many whole rows as fit."""
    rows = max(1, PIECE // max(length, 1))
    return rows, (n + rows - 1) // rows, _pieces(length)


@strict_inline
def _piece_sums(x, g, wr, c, i0, i1, j0, j1, mean, rstd, lanes):
    """(sum h, sum h x_hat), h = g wr, over x[i0:i1, c, j0:j1] in float64: every row's
    terms added into one set of lanes (add_row), then the lanes folded pairwise."""
    for k in range(LANES):
        lanes[0, k] = 0.0
        lanes[1, k] = 0.0
    for i in range(i0, i1):
        add_row(x[i, c, j0:j1], wr[:j1 - j0], g[i, c, j0:j1], mean, rstd, lanes, to_f64, 1, 1)
    return _fold(lanes[0]), _fold(lanes[1])


@strict_inline
def _short_sums(x, g, wr, c, mean, rstd, terms):
    """(sum h, sum h x_hat), h = g wr, over a channel of at most SHORT_CHANNEL values:
    the terms (add_row's, _terms) pairwise, with no lanes (`terms`: scratch, 2 rows)."""
    n, length = x.shape[0], x.shape[2]
    for i in range(n):
        for l_ in range(length):
            terms[0, i * length + l_], terms[1, i * length + l_] = _terms(
                x[i, c], wr, g[i, c], mean, rstd, l_, to_f64)
    return pairwise(terms[0], n * length), pairwise(terms[1], n * length)


@jit_strict
def bn_grad_sums(x, g, w, mean, var, eps, ones, sums):
    """Per channel c, over x[:, c, :] and g[:, c, :] (C-contiguous [n, ch, length],
    float32 or float64): sums[0, c] = dL/dbeta = sum g, sums[1, c] = dL/dgamma =
    sum g x_hat, and sums[2, c], sums[3, c] = sum h, sum h x_hat (h = g gamma, which dx
    needs), x_hat from mean and var, the terms in float64 (`ones`: PIECE float64 ones).
    A piece is PIECE elements of a row, or as many whole rows as fit in PIECE elements,
    which then share one set of lanes (folding the lanes after every row made the sums
    twice as slow at [256, 512, 49] float32). h is summed term by term, as the spec
    does, not taken as gamma sum g (which overflows where sum g gamma need not, and the
    other way round), except for gamma = 1, where h is g bit for bit (the second sums
    cost 0-15% of a float32 forward+backward at three shapes). Channels of at most
    SHORT_CHANNEL values sum their terms pairwise (_short_sums). Channels go in CHUNKS
    chunks, each with its own scratch."""
    n, ch, length = x.shape
    rows, groups, per = _grouping(n, length)
    k = groups * per
    r = _rstd(var, eps)
    chunks = min(ch, CHUNKS)
    for t in prange(chunks):
        parts, lanes, gamma = np.empty((4, k)), np.empty((2, LANES)), np.empty(PIECE)
        for c in range(t * ch // chunks, (t + 1) * ch // chunks):
            unit = w[c] == 1.0
            if not unit:
                for j in range(min(PIECE, length)):
                    gamma[j] = w[c]
            if n * length <= SHORT_CHANNEL:
                sums[0, c], sums[1, c] = _short_sums(x, g, ones, c, mean[c], r[c], lanes)
                if not unit:
                    sums[2, c], sums[3, c] = _short_sums(x, g, gamma, c, mean[c], r[c], lanes)
            else:
                for q in range(groups):
                    i0, i1 = q * rows, min(n, (q + 1) * rows)
                    for p in range(per):
                        j0, j1 = p * PIECE, min(length, (p + 1) * PIECE)
                        at = q * per + p
                        parts[0, at], parts[1, at] = _piece_sums(
                            x, g, ones, c, i0, i1, j0, j1, mean[c], r[c], lanes)
                        if not unit:
                            parts[2, at], parts[3, at] = _piece_sums(
                                x, g, gamma, c, i0, i1, j0, j1, mean[c], r[c], lanes)
                for f in range(2 if unit else 4):
                    sums[f, c] = pairwise(parts[f], k)
            if unit:
                sums[2, c], sums[3, c] = sums[0, c], sums[1, c]


@jit_strict
def bn_dx(x, w, g, mean, var, eps, sums, dx, batch):
    """dL/dx from the sums bn_grad_sums made. With `batch` the statistics are the
    batch's, functions of x: dx = r (h - mean(h) - x_hat mean(h x_hat)), h = g gamma,
    mean(h) = sums[2] / m, mean(h x_hat) = sums[3] / m. Without (eval on running
    statistics) they are constants and dx = r h. In memory order, as bn_apply (1.4-2.9x
    faster than channel by channel at four float32 shapes)."""
    n, ch, length = x.shape
    m = max(n * length, 1)  # (no element has a dx when it is 0)
    r = _rstd(var, eps)
    mh, mhx = np.empty(ch), np.empty(ch)
    for c in range(ch):
        mh[c], mhx[c] = sums[2, c] / m, sums[3, c] / m
    if length == 1:  # [N, C]: the loop over channels is the inner one (2-D views)
        x2, g2, dx2 = x.reshape(n, ch), g.reshape(n, ch), dx.reshape(n, ch)
        for i in prange(n):
            for c in range(ch):
                dx2[i, c] = _grad(x2[i, c], g2[i, c], mean[c], r[c], w[c], mh[c], mhx[c],
                                  batch)
        return
    for i in prange(n):
        for c in range(ch):
            mc, rc, wc, mhc, mhxc = mean[c], r[c], w[c], mh[c], mhx[c]
            for l_ in range(length):
                dx[i, c, l_] = _grad(x[i, c, l_], g[i, c, l_], mc, rc, wc, mhc, mhxc, batch)
