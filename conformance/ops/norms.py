"""F2 LayerNorm and F3 RMSNorm: forward, and the VJP when an upstream gradient is given,
of the backend against the oracle."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np
from normspec.spec._reductions import fast_mean, fast_var

from ..diagnosis import Alternatives
from ..tolerances import (
    bound,
    centred_output_scale,
    centring_kappa,
    grad_input_scale,
    rms_output_scale,
)
from ._common import compare_param_grads, f64, outputs_like


def _trailing_axes(x, shape):
    return tuple(range(x.ndim - len(shape), x.ndim))


def layer_norm_case(ctx, *, x, normalized_shape, weight=None, bias=None, eps=1e-5,
                    grad=None):
    """F2 forward (and VJP when `grad` is given) of the backend against the oracle;
    returns the backend's Result, for a check that asks more of it."""
    xa, w, b, g = ctx.use(x=x, weight=weight, bias=bias, grad=grad)
    shape = tuple(normalized_shape)
    code = f"result = backend.layer_norm(x, {shape!r}, weight, bias, {eps!r}" + \
           (", grad_output=grad)" if g is not None else ")")
    res = ctx.call(code, ctx.backend.layer_norm, xa, shape, w, b, eps, g,
                   outputs_like=outputs_like(xa, grads=g is not None, param_shape=shape,
                                             weight=w is not None, bias=b is not None),
                   refusable=eps == 0 and not ctx.accepts_eps_zero("layer_norm"))
    e = ctx.effective(eps, "eps")
    x64, w64, b64 = f64(xa), f64(w), f64(b)
    axes = _trailing_axes(x64, shape)
    x_hat = spec.layer_norm(x64, shape, eps=e)
    kappa = centring_kappa(x64, axes, e)
    d = int(np.prod(shape))
    gamma = np.abs(w64) if w64 is not None else 1.0
    beta = np.abs(b64) if b64 is not None else 0.0
    ctx.oracle(f"expected = spec.layer_norm(x, {shape!r}, weight, bias, {e!r})",
               f"show(result.output, expected, name='output', axes={axes!r})")
    ctx.conforms(expected=spec.layer_norm(x64, shape, w64, b64, e), actual=res.output,
                 scale=centred_output_scale(x_hat, gamma, beta, axes),
                 bound=bound("output", ctx.dtype, d, kappa), quantity="layer_norm.output",
                 call=code,
                 variants=Alternatives("layer_norm", lambda fn: fn(x64, shape, w64, b64, e),
                                       length=d, statistics=(x64, axes, w64, b64, e)))
    if g is None:
        return res
    g64 = f64(g)
    gx, gw, gb = spec.layer_norm_vjp(x64, shape, g64, w64, b64, e)

    def vjp(pick):
        return Alternatives("layer_norm_vjp", lambda fn: fn(x64, shape, g64, w64, b64, e), pick,
                            d)

    r = 1.0 / np.sqrt(fast_var(x64, axes, keepdims=True) + e)
    h = np.abs(g64 * (w64 if w64 is not None else 1.0))
    ctx.oracle(f"expected_grads = spec.layer_norm_vjp(x, {shape!r}, grad, weight, bias, {e!r})",
               f"show(result.grad_input, expected_grads[0], name='grad_input', axes={axes!r})")
    ctx.conforms(expected=gx, actual=res.grad_input,
                 scale=grad_input_scale(r, h, x_hat, axes, centre=True),
                 bound=bound("gradient", ctx.dtype, d, kappa), quantity="layer_norm.grad_input",
                 call=code, variants=vjp(0))
    compare_param_grads(ctx, code, "layer_norm", g64, x_hat, tuple(range(axes[0])), gw, gb, res,
                        kappa, d, variants=vjp)
    return res


def rms_norm_case(ctx, *, x, normalized_shape, weight=None, eps=1e-6, grad=None) -> None:
    """F3 forward (and VJP when `grad` is given) of the backend against the oracle."""
    xa, w, g = ctx.use(x=x, weight=weight, grad=grad)
    shape = tuple(normalized_shape)
    code = f"result = backend.rms_norm(x, {shape!r}, weight, {eps!r}" + \
           (", grad_output=grad)" if g is not None else ")")
    res = ctx.call(code, ctx.backend.rms_norm, xa, shape, w, eps, g,
                   outputs_like=outputs_like(xa, grads=g is not None, param_shape=shape,
                                             weight=w is not None),
                   refusable=eps == 0 and not ctx.accepts_eps_zero("rms_norm"))
    e = ctx.effective(eps, "eps")
    x64, w64 = f64(xa), f64(w)
    axes = _trailing_axes(x64, shape)
    d = int(np.prod(shape))
    x_r = spec.rms_norm(x64, shape, eps=e)
    gamma = np.abs(w64) if w64 is not None else 1.0
    ctx.oracle(f"expected = spec.rms_norm(x, {shape!r}, weight, {e!r})",
               f"show(result.output, expected, name='output', axes={axes!r})")
    ctx.conforms(expected=spec.rms_norm(x64, shape, w64, e), actual=res.output,
                 scale=rms_output_scale(x_r, gamma, axes), bound=bound("output", ctx.dtype, d),
                 quantity="rms_norm.output", call=code,
                 variants=Alternatives("rms_norm", lambda fn: fn(x64, shape, w64, e), length=d))
    if g is None:
        return
    g64 = f64(g)
    gx, gw = spec.rms_norm_vjp(x64, shape, g64, w64, e)

    def vjp(pick):
        return Alternatives("rms_norm_vjp", lambda fn: fn(x64, shape, g64, w64, e), pick, d)

    r = 1.0 / np.sqrt(fast_mean(x64 * x64, axes, keepdims=True) + e)
    h = np.abs(g64 * (w64 if w64 is not None else 1.0))
    ctx.oracle(f"expected_grads = spec.rms_norm_vjp(x, {shape!r}, grad, weight, {e!r})",
               f"show(result.grad_input, expected_grads[0], name='grad_input', axes={axes!r})")
    ctx.conforms(expected=gx, actual=res.grad_input,
                 scale=grad_input_scale(r, h, x_r, axes, centre=False),
                 bound=bound("gradient", ctx.dtype, d), quantity="rms_norm.grad_input", call=code,
                 variants=vjp(0))
    compare_param_grads(ctx, code, "rms_norm", g64, x_r, tuple(range(axes[0])), gw, None, res, 1.0,
                        d, variants=vjp)
