"""The one tolerance table. Every bound normspec applies is derived here.

Metric. A backend's output in dtype T is compared with the oracle's float64 answer
rounded to T. The error of an element is |got - round_T(ref)| divided by ulp_T(s), the
spacing of T at the *scale* s of the element's group (the largest |ref| of its
normalized row, BatchNorm channel or score row; for reductions such as dL/dgamma the sum
of the magnitudes that were added). Normalization is normwise, not componentwise,
stable: an element near zero inherits the absolute error of its row's statistics, so its
own ULP count is no measure of the kernel's quality; ULPs at the row's scale are.

Bound. round_T of the backend's result and round_T of the oracle's each contribute half
an ULP: `base_ulps` = 1. On top comes the error of computing the statistics in the
backend's compute precision u_c (float32 for float16/bfloat16 inputs, T otherwise), in
units of T's roundoff u_T:

    bound = base_ulps + growth * kappa * (log2(n) + 1) * u_c / u_T

(log2(n) + 1) is the error growth of a tree/blocked summation of n terms (Higham, "The
accuracy of floating point summation", 1993): every real kernel reduces that way. kappa
is the conditioning of the op on that input: for centring ops (LayerNorm, BatchNorm)
1 + mean|x| / sqrt(var + eps), since the mean's rounding error is shifted onto every
output and divided by the spread; for RMSNorm 1, as sum x^2 has no cancellation. BatchNorm
in eval mode computes no statistics: it shifts by the given running mean, and that shift
(x - running_mean, or a kernel's folded beta - running_mean gamma r) rounds at
|running_mean|, so its kappa is 1 + |running_mean| / sqrt(running_var + eps)
(`shift_kappa`), with n = 1 (no reduction).
Nothing here is loosened to make a backend pass; where a backend misses a bound, the
report says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


@dataclass(frozen=True)
class Tolerance:
    quantity: str
    base_ulps: float
    growth: float
    reason: str


TABLE: dict[str, Tolerance] = {t.quantity: t for t in (
    Tolerance("output", 1.0, 2.0,
              "Forward outputs of LayerNorm, RMSNorm, BatchNorm and QK scores. 1 ULP for "
              "the two roundings to T; 2 * kappa * (log2 n + 1) compute ULPs covers one "
              "rounding per summation level in the mean and in the variance."),
    Tolerance("gradient", 1.0, 4.0,
              "dL/dx. The VJP takes two more reductions (mean(h), mean(h x_hat)) on top of "
              "the forward's two: twice the forward's growth. Scale: the row's r max|h|."),
    Tolerance("eval_gradient", 1.0, 5.0,
              "dL/dx of BatchNorm in eval mode with running statistics, gamma g / "
              "sqrt(running_var + eps): an elementwise product, no reduction (n = 1, kappa "
              "1). Five roundings in compute precision (running_var + eps, sqrt, the "
              "reciprocal, g gamma, the product) each add at most one u_c relative to the "
              "element; scale: the channel's largest |dL/dx|."),
    Tolerance("param_gradient", 1.0, 4.0,
              "dL/dgamma and dL/dbeta are sums over the batch of g x_hat and g: one more "
              "reduction over the rows, scale = the sum of the magnitudes added."),
    Tolerance("scores", 2.0, 2.0,
              "QK-norm scores: 1 ULP for the two final roundings plus 1 because q_hat and "
              "k_hat are each legitimately stored in T (half an ULP, relative, each) before "
              "the dot product; growth over the d-term dot product. Scale: sum of |terms|."),
    Tolerance("running_stat", 1.0, 2.0,
              "Running mean/variance after an update: one reduction over m values and the "
              "momentum blend (two roundings), scale = the magnitudes blended."),
    Tolerance("invariance", 2.0, 4.0,
              "Backend against itself on two inputs (B1/B2): both sides carry the output "
              "bound, so base and growth double."),
)}

_UNIT_ROUNDOFF = {
    np.dtype(np.float16): 2.0**-11,
    np.dtype(ml_dtypes.bfloat16): 2.0**-8,
    np.dtype(np.float32): 2.0**-24,
    np.dtype(np.float64): 2.0**-53,
}


def unit_roundoff(dtype) -> float:
    return _UNIT_ROUNDOFF[np.dtype(dtype)]


def compute_dtype(dtype) -> np.dtype:
    """The precision a conforming kernel computes half-precision inputs in (float32)."""
    return np.dtype(np.float32) if np.dtype(dtype) in HALF else np.dtype(dtype)


def bound(quantity: str, dtype, n: int, kappa=1.0):
    """Allowed error in ULPs of `dtype` at the group's scale (see the module docstring)."""
    t = TABLE[quantity]
    ratio = unit_roundoff(compute_dtype(dtype)) / unit_roundoff(dtype)
    return t.base_ulps + t.growth * np.asarray(kappa) * (np.log2(max(n, 1)) + 1.0) * ratio


def centring_kappa(x64: np.ndarray, axes, eps: float) -> np.ndarray:
    """1 + mean|x| / sqrt(var + eps) over `axes`, keepdims: how much the mean's rounding
    is amplified by centring and dividing by the spread."""
    mean_abs = np.abs(x64).mean(axis=axes, keepdims=True)
    spread = np.sqrt(x64.var(axis=axes, keepdims=True) + eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = 1.0 + mean_abs / spread
    return np.where(np.isfinite(k), k, np.inf)


def shift_kappa(shift: np.ndarray, var: np.ndarray, eps: float) -> np.ndarray:
    """1 + |shift| / sqrt(var + eps): the conditioning of normalizing with given (not
    computed) statistics, BatchNorm in eval mode: the rounding of the shift by `shift`
    (x - running_mean, or a folded bias) is divided by the running spread."""
    with np.errstate(divide="ignore", invalid="ignore"):
        k = 1.0 + np.abs(shift) / np.sqrt(var + eps)
    return np.where(np.isfinite(k), k, np.inf)


def table_rows() -> list[dict]:
    return [{"quantity": t.quantity, "base_ulps": t.base_ulps, "growth": t.growth,
             "reason": t.reason} for t in TABLE.values()]
