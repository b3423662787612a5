"""The fused residual add + norm kernels (F8): one read of each row of x and residual,
their sum formed in the compute precision (float32 for float16/bfloat16 rows, decoded
and encoded in the kernel; the array's own dtype otherwise) and written back as the new
residual, the statistics (float64 shifted sums, as _numba_rows) taken of that unrounded
sum and the row normalized from it: contract "float32" of Conventions.fused_residual_sum."""

import math

import numpy as np
from numba import prange

from ._numba_codec import decode_row, encode_row
from ._numba_jit import inline, jit
from ._numba_rows import moments, shifted_sums, sum_squares


@inline
def _stats(s, d, eps, centre):
    if centre:
        k, s1, s2 = shifted_sums(s, d)
        return moments(k, s1, s2, d, eps)
    return 0.0, 1.0 / math.sqrt(sum_squares(s, d) / d + eps)


@jit
def add_norm_fwd(x, res, w, b, eps, y, s, mean_out, rstd_out, n_chunks, centre):
    """float32/float64 rows: s = x + res in the array's dtype (written to `s`, the new
    residual), then LayerNorm (centre) or RMSNorm of s into y."""
    rows, d = x.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        for r in range(c * per, min(rows, (c + 1) * per)):
            xr, rr, sr, yr = x[r], res[r], s[r], y[r]
            for j in range(d):
                sr[j] = xr[j] + rr[j]
            mu, rstd = _stats(sr, d, eps, centre)
            mean_out[r], rstd_out[r] = mu, rstd
            m_t, s_t = x.dtype.type(mu), x.dtype.type(rstd)
            for j in range(d):
                yr[j] = (sr[j] - m_t) * s_t * w[j] + b[j]


@jit
def half_add_norm_fwd(x16, r16, w, b, eps, y16, s16, n_chunks, fmt, centre):
    """float16/bfloat16 bits: both rows decoded to float32, added there; the float32 sum
    is encoded once into the new residual and normalized as it is (not re-read)."""
    rows, d = x16.shape
    per = (rows + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        xf, rf = np.empty(d, np.float32), np.empty(d, np.float32)
        for r in range(c * per, min(rows, (c + 1) * per)):
            decode_row(x16[r], xf, fmt)
            decode_row(r16[r], rf, fmt)
            for j in range(d):
                xf[j] = xf[j] + rf[j]  # xf holds the sum from here on
            encode_row(xf, s16[r], fmt)
            mu, rstd = _stats(xf, d, eps, centre)
            m32, s32 = np.float32(mu), np.float32(rstd)
            for j in range(d):
                rf[j] = (xf[j] - m32) * s32 * w[j] + b[j]
            encode_row(rf, y16[r], fmt)
