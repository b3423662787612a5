"""Correct kernels that compute differently from the numpy reference: the suite must
pass every one of them (a check that fails one fails a backend falsely)."""

from __future__ import annotations

import numpy as np
from normspec.impls.numpy_ref import NumpyBackend
from oracle_backend import OracleBackend, OracleBatchNorm


class _RsqrtOneUlp(NumpyBackend):
    """1/sqrt(var + eps) one ULP off in the compute dtype, as an approximate reciprocal
    square root may be (CUDA documents rsqrtf within 2 ULPs): `towards` says which way."""

    towards = np.inf

    def inv_std(self, var, eps):
        r = super().inv_std(var, eps)
        with np.errstate(all="ignore"):
            off = np.nextafter(r, np.asarray(self.towards, dtype=r.dtype))
            return np.where(np.isfinite(r) & (r > 0), off, r)


class RsqrtOneUlpHigh(_RsqrtOneUlp):
    towards = np.inf


class RsqrtOneUlpLow(_RsqrtOneUlp):
    towards = 0.0


class _CountsInFloatsLayer(OracleBatchNorm):
    @property
    def num_batches_tracked(self):
        return None if self.rm is None else np.float32(self.t)


class CountsInFloats(OracleBackend):
    """num_batches_tracked as a float32 (the protocol does not type it)."""

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _CountsInFloatsLayer(num_features, eps, momentum, affine, track_running_stats,
                                    np.dtype(dtype), weight, bias)
