"""The BatchNorm kernels: per-channel statistics over the batch and every axis after the
channel (float64 accumulation), the normalization, and the backward (the training
formula with batch statistics, dx = gamma g r with running ones).

The statistics and the backward sum in one fixed order, so their bits do not depend on
how a compilation of them happened to order a sum (see _numba_moments: with fast-math
reassociation, a process that compiled these kernels and one that loaded them from
Numba's cache gave float64 BatchNorm results apart, outputs and gradients, at 4 of 5
shapes): the
statistics are _numba_moments' lane sums of each row x[i, c, :], added in row order
(short rows are laid out as one row per channel first, SHORT_ROWS); the backward's sums
run element by element in order, compiled strict (no fast-math flag: not
vectorized)."""

import math

import numpy as np
from numba import prange

from ._numba_jit import jit, jit_strict
from ._numba_moments import moment_sums

#: Channels whose rows x[i, c, :] are shorter than this are laid out as one row first
#: (numba_kernels.NumbaBatchNorm): the sums of rows of a few elements, added row by row,
#: were both slow and a long sequential sum ([65535, 2]: running_var 42 float64 ULPs off).
SHORT_ROWS = 32


@jit_strict
def bn_stats(x, mean_out, sumsq_out):
    """Per channel c, the mean and the sum of squared deviations from it of x[:, c, :]
    (C-contiguous [n, ch, length]), two passes: each row's lane sums (_numba_moments),
    added in row order."""
    n, ch, length = x.shape
    for c in prange(ch):
        acc = 0.0
        for i in range(n):
            acc += moment_sums(x[i, c], 0.0, None)[0]
        mu = acc / (n * length)
        sq = 0.0
        for i in range(n):
            sq += moment_sums(x[i, c], mu, None)[1]
        mean_out[c] = mu
        sumsq_out[c] = sq

@jit
def bn_apply(x, mean, var, w, b, eps, y):
    n, ch, length = x.shape
    for c in prange(ch):
        s = 1.0 / math.sqrt(var[c] + eps)
        for i in range(n):
            for l_ in range(length):
                y[i, c, l_] = (np.float64(x[i, c, l_]) - mean[c]) * s * w[c] + b[c]

@jit_strict
def bn_bwd(x, w, g, mean, var, eps, dx, dw, db, batch):
    """dL/dx, dL/dgamma, dL/dbeta per channel. With `batch` the statistics are the
    batch's, functions of x: dx = r (h - mean(h) - x_hat mean(h x_hat)). Without (eval
    on running statistics) they are constants and dx = r h, h = g gamma; dL/dgamma and
    dL/dbeta are sum g x_hat and sum g either way, x_hat from the statistics given."""
    n, ch, length = x.shape
    m = n * length
    for c in prange(ch):
        s = 1.0 / math.sqrt(var[c] + eps)
        sh = 0.0
        shx = 0.0
        sg = 0.0
        sgx = 0.0
        for i in range(n):
            for l_ in range(length):
                xh = (np.float64(x[i, c, l_]) - mean[c]) * s
                gv = np.float64(g[i, c, l_])
                sh += gv * w[c]
                shx += gv * w[c] * xh
                sg += gv
                sgx += gv * xh
        dw[c] = sgx
        db[c] = sg
        if not batch:
            for i in range(n):
                for l_ in range(length):
                    dx[i, c, l_] = s * np.float64(g[i, c, l_]) * w[c]
            continue
        for i in range(n):
            for l_ in range(length):
                xh = (np.float64(x[i, c, l_]) - mean[c]) * s
                dx[i, c, l_] = s * (np.float64(g[i, c, l_]) * w[c] - sh / m - xh * shx / m)
