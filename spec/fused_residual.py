"""F8's Pre-LN residual add fused with the norm that follows it, as inference engines run
it: s = x + residual; the new residual is s, written back in the activation dtype T;
y = norm(s). Two arithmetic contracts are in use, differing in which s the norm sees:

"rounded": the norm of round_T(s). What eager framework code computes
    (`r = x + residual; y = norm(r)`: the sum is a tensor of dtype T before the norm
    reads it), and what vLLM's fused CUDA kernel computed until vllm #52104 was fixed.
"float32": the norm of the unrounded sum: vLLM's native IR (x and residual upcast to
    float32 and added there; statistics and normalized values from that float32 sum;
    only the residual written back is rounded to T), and its CUDA kernel since the fix.

The oracle takes the unrounded sum exactly (in float64: the sum of two float16 values is
always exact there, their significands spanning at most 40 bits, and so is that of two
float32 or bfloat16 values whose exponents are at most 29 apart; float64 inputs add with
one float64 rounding). A kernel that adds in float32 rounds s once in its compute
precision, an error of u_c relative that the norm's compute bound already covers. For the
"rounded" contract the exact sum is then rounded to T once (round_to). In float32 and
float64 the two contracts differ by that one rounding in the compute precision only; in
float16 and bfloat16 they differ by a rounding in T, which a LayerNorm amplifies by
mean|s| / spread(s) (so rows with a large mean and a small spread tell them apart by many
ULPs), while an RMSNorm passes it on unamplified (at most about one ULP of T).

Gradients. Both contracts share one VJP formula: the sum passes its gradient to both
addends, dL/dx = dL/dresidual = J_norm(s*)^T g_y + g_r, dL/dgamma and dL/dbeta the norm's,
for upstream gradients g_y of the output and g_r of the written-back residual; the
rounding to T is treated as the identity, as autograd treats a dtype cast. They differ
only in where it is evaluated: s* = round_T(s) for "rounded", s* = s for "float32".
"""

from __future__ import annotations

import numpy as np

from ._validate import FLOAT_DTYPES, as_float64, check_same_shape
from .layer_norm import layer_norm, layer_norm_vjp
from .rms_norm import rms_norm, rms_norm_vjp
from .rounding import round_to

#: The arithmetic contracts (impls.protocol.Conventions.fused_residual_sum).
FUSED_RESIDUAL_SUMS = ("rounded", "float32")
NORMS = ("rms_norm", "layer_norm")


def _check(norm, contract, bias):
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if contract not in FUSED_RESIDUAL_SUMS:
        raise ValueError(f"contract must be one of {FUSED_RESIDUAL_SUMS}, got {contract!r}")
    if norm == "rms_norm" and bias is not None:
        raise ValueError("rms_norm has no bias; pass bias=None")


def _dtype(x, dtype) -> np.dtype:
    dt = np.asarray(x).dtype if dtype is None else np.dtype(dtype)
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dt}")
    return dt


def fused_residual_sum(x, residual, *, contract="rounded", dtype=None):
    """(s*, residual'): the sum the norm is taken of under `contract` and the residual
    written back, round_T(x + residual), both as float64. T is `dtype`, by default x's
    own dtype (pass it when x has already been converted to float64)."""
    dt = _dtype(x, dtype)
    x64 = as_float64("x", x)
    r64 = as_float64("residual", residual)
    check_same_shape("residual", r64, x64.shape)
    if contract not in FUSED_RESIDUAL_SUMS:
        raise ValueError(f"contract must be one of {FUSED_RESIDUAL_SUMS}, got {contract!r}")
    s = x64 + r64
    written = round_to(s, dt).astype(np.float64)
    return (written if contract == "rounded" else s), written


def fused_add_norm(x, residual, norm, normalized_shape, weight=None, bias=None, eps=1e-5, *,
                   contract="rounded", dtype=None):
    """F8 fused residual add + `norm` ("rms_norm" or "layer_norm"): returns
    (y, residual') with y = norm(s*) and residual' = round_T(x + residual), s* as
    `contract` says (see the module docstring); float64."""
    _check(norm, contract, bias)
    s_star, written = fused_residual_sum(x, residual, contract=contract, dtype=dtype)
    if norm == "rms_norm":
        y = rms_norm(s_star, normalized_shape, weight, eps)
    else:
        y = layer_norm(s_star, normalized_shape, weight, bias, eps)
    return y, written


def fused_add_norm_vjp(x, residual, grad_output, grad_residual, norm, normalized_shape,
                       weight=None, bias=None, eps=1e-5, *, contract="rounded", dtype=None):
    """Closed-form gradients of `fused_add_norm` for upstream gradients g_y (of y) and g_r
    (of residual'): with s* as `contract` says, dL/dx = dL/dresidual =
    J_norm(s*)^T g_y + g_r (the norm's VJP, rms_norm_vjp or layer_norm_vjp, at s*), and
    the norm's dL/dgamma, dL/dbeta at s*. Returns (grad_x, grad_residual, grad_weight,
    grad_bias), a parameter's gradient None where the parameter is."""
    _check(norm, contract, bias)
    s_star, _ = fused_residual_sum(x, residual, contract=contract, dtype=dtype)
    g_r = as_float64("grad_residual", grad_residual)
    check_same_shape("grad_residual", g_r, s_star.shape)
    if norm == "rms_norm":
        g_s, g_w = rms_norm_vjp(s_star, normalized_shape, grad_output, weight, eps)
        g_b = None
    else:
        g_s, g_w, g_b = layer_norm_vjp(s_star, normalized_shape, grad_output, weight, bias, eps)
    g_sum = g_s + g_r
    return g_sum, g_sum.copy(), g_w, g_b
