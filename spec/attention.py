"""The attention-logit pieces of the document: QK-norm scores (F6, E6, E7), soft-capping
(F7), rotary position embedding (E8) and softmax (E5)."""

from __future__ import annotations

import numbers

import numpy as np

from ._validate import as_float64, check_eps, check_param_shape, ieee, optional_float64
from .rms_norm import RMS_NORM_DEFAULT_EPS, rms_norm


@ieee
def softmax(x, axis=-1):
    """softmax(x)_i = exp(x_i - max x) / sum_j exp(x_j - max x); the shift changes nothing
    mathematically and keeps exp from overflowing (E5)."""
    x = as_float64("x", x)
    z = np.exp(x - x.max(axis=axis, keepdims=True))
    return z / z.sum(axis=axis, keepdims=True)


@ieee
def qk_norm_scores(q, k, q_weight=None, k_weight=None, eps=RMS_NORM_DEFAULT_EPS, scale=None):
    """F6: s = RMSNorm(q) . RMSNorm(k) * scale, per head, scale = 1/sqrt(d_k) by default.

    q is [..., heads, tq, d_k] and k is [..., heads, tk, d_k]; each is RMS-normalized over
    head_dim with its own gain (q_weight, k_weight of shape [d_k]). Returns the
    [..., heads, tq, tk] scores. With unit gains and eps = 0, |q_hat| = |k_hat| = sqrt(d_k),
    so |s| <= sqrt(d_k) at the default scale (E7), whatever the scale of q and k (E6).
    """
    q, k = as_float64("q", q), as_float64("k", k)
    if q.ndim < 3 or k.ndim < 3:
        raise ValueError(
            f"q and k must be [..., heads, tokens, head_dim], got shapes {q.shape} and {k.shape}"
        )
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {q.shape} and k {k.shape} must agree on every axis but the token axis"
        )
    d_k = q.shape[-1]
    q_weight, k_weight = optional_float64("q_weight", q_weight), optional_float64("k_weight", k_weight)
    check_param_shape("q_weight", q_weight, (d_k,))
    check_param_shape("k_weight", k_weight, (d_k,))
    eps = check_eps(eps)
    if scale is None:
        scale = 1.0 / np.sqrt(d_k)
    elif not isinstance(scale, numbers.Real) or not np.isfinite(scale):
        raise ValueError(f"scale must be a finite real number or None, got {scale!r}")
    # q_hat = RMSNorm(q), k_hat = RMSNorm(k), each over head_dim with its own gain
    q_hat = rms_norm(q, (d_k,), q_weight, eps)
    k_hat = rms_norm(k, (d_k,), k_weight, eps)
    # s = q_hat . k_hat * scale
    return np.matmul(q_hat, np.swapaxes(k_hat, -1, -2)) * float(scale)


@ieee
def softcap(scores, cap):
    """F7: s -> cap * tanh(s / cap), which keeps every score inside (-cap, cap)."""
    s = as_float64("scores", scores)
    if not isinstance(cap, numbers.Real) or not np.isfinite(cap) or cap <= 0:
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    return cap * np.tanh(s / cap)


@ieee
def rope(x, positions, base=10000.0):
    """Rotary position embedding, the "rotate half" layout (GPT-NeoX, Llama, Gemma).

    x is [..., T, d] with d even; feature i pairs with i + d/2 and the pair at position p
    is rotated by the angle p * base^(-2i/d). A rotation keeps every vector's length (E8),
    so the QK-norm bound of E7 holds whether the norm comes before or after RoPE.
    """
    x = as_float64("x", x)
    pos = np.asarray(positions, dtype=np.float64)
    if x.ndim < 2 or x.shape[-1] % 2:
        raise ValueError(f"rope needs x of shape [..., T, d] with d even, got {x.shape}")
    if pos.shape != (x.shape[-2],):
        raise ValueError(f"positions must have shape ({x.shape[-2]},), got {pos.shape}")
    if not isinstance(base, numbers.Real) or base <= 0:
        raise ValueError(f"base must be > 0, got {base!r}")
    half = x.shape[-1] // 2
    # theta_{p,i} = p * base^(-2i/d)
    theta = pos[:, None] * float(base) ** (-2.0 * np.arange(half) / x.shape[-1])
    cos, sin = np.cos(theta), np.sin(theta)
    x1, x2 = x[..., :half], x[..., half:]
    # (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


