"""F8's fused residual add + norm of the backend against the oracle under the backend's
declared contract (conventions.fused_residual_sum): both outputs (the normalized sum and
the residual written back) and, when upstream gradients are given, dL/dx, dL/dresidual,
dL/dgamma and dL/dbeta."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np

from ..assertions import CheckFailure
from ..tolerances import (
    bound,
    centred_output_scale,
    centring_kappa,
    grad_input_scale,
    param_grad_scales,
    rms_output_scale,
)
from ._common import Judged, f64

OTHER = {"rounded": "float32", "float32": "rounded"}


def contract_of(ctx) -> str:
    """The contract the backend declares (the protocol's default: "rounded")."""
    return ctx.convention("fused_residual_sum", "rounded") or "rounded"


def _conforms_or_hint(ctx, other_expected, contract, **kw) -> None:
    """ctx.conforms; when the declared contract's answer is missed but the other
    contract's is met, the record's note says so (the declaration is what is wrong)."""
    try:
        ctx.conforms(**kw)
    except CheckFailure:
        probe = dict(kw, expected=other_expected)
        try:
            ctx.conforms(**probe)
        except CheckFailure:
            pass
        else:
            ctx.notes.append(f"{kw['quantity']} conforms to fused_residual_sum = "
                             f"{OTHER[contract]!r} instead of the declared {contract!r}")
        raise


def _norm_terms(norm, s, shape, axes, w64, b64, e):
    """(x_hat or x / rms, r, kappa, output scale) of the norm at the sum s."""
    gamma = np.abs(w64) if w64 is not None else 1.0
    if norm == "rms_norm":
        x_r = spec.rms_norm(s, shape, eps=e)
        r = 1.0 / np.sqrt((s * s).mean(axis=axes, keepdims=True) + e)
        return x_r, r, 1.0, rms_output_scale(x_r, gamma, axes)
    x_hat = spec.layer_norm(s, shape, eps=e)
    r = 1.0 / np.sqrt(s.var(axis=axes, keepdims=True) + e)
    beta = np.abs(b64) if b64 is not None else 0.0
    return (x_hat, r, centring_kappa(s, axes, e),
            centred_output_scale(x_hat, gamma, beta, axes))


def fused_add_norm_case(ctx, *, norm, x, residual, normalized_shape, weight=None, bias=None,
                        eps=1e-5, grad_output=None, grad_residual=None) -> tuple[Judged, Judged]:
    """One fused_add_norm call against spec.fused_add_norm(_vjp) under the declared
    contract; gradients when both upstream gradient recipes are given. Returns the
    normalized output and the residual written back, as they were judged."""
    xa, ra, w, b, gy, gr = ctx.use(x=x, residual=residual, weight=weight, bias=bias,
                                   grad_output=grad_output, grad_residual=grad_residual)
    shape = tuple(normalized_shape)
    grads = gy is not None
    code = (f"result = backend.fused_add_norm(x, residual, {norm!r}, {shape!r}, weight, bias, "
            f"{eps!r}" + (", grad_outputs=(grad_output, grad_residual))" if grads else ")"))
    like = {"output": (xa.shape, xa.dtype), "residual": (xa.shape, xa.dtype)}
    if grads:
        like.update(grad_input=(xa.shape, xa.dtype), grad_residual=(xa.shape, xa.dtype))
        if w is not None:
            like["grad_weight"] = (shape, xa.dtype)
        if b is not None:
            like["grad_bias"] = (shape, xa.dtype)

    given = {k: a for k, a in (("weight", w), ("bias", b), ("grad_output", gy),
                                ("grad_residual", gr)) if a is not None}

    def run(x_in, r_in, *arrays):
        # the twins call() made, never the originals the oracle reads
        a = dict(zip(given, arrays, strict=True))
        return ctx.backend.fused_add_norm(
            x_in, r_in, norm, shape, a.get("weight"), a.get("bias"), eps,
            grad_outputs=(a["grad_output"], a["grad_residual"]) if grads else None)

    # every array goes through call() so that one written in place is caught, by its name
    res = ctx.call(code, run, xa, ra, *given.values(), outputs_like=like,
                   arg_names=("x", "residual", *given))
    contract, e, dt = contract_of(ctx), ctx.effective(eps, "eps"), ctx.dtype
    x64, r64, w64, b64 = f64(xa), f64(ra), f64(w), f64(b)
    axes = tuple(range(x64.ndim - len(shape), x64.ndim))
    d = int(np.prod(shape))
    s, written = spec.fused_residual_sum(x64, r64, contract=contract, dtype=dt)
    ctx.oracle(f"expected, expected_residual = spec.fused_add_norm(x, residual, {norm!r}, "
               f"{shape!r}, weight, bias, {e!r}, contract={contract!r})",
               "show(result.output, expected, name='output')",
               "show(result.residual, expected_residual, name='residual')")
    sum_scale = np.abs(x64) + np.abs(r64)
    ctx.conforms(expected=written, actual=res.residual, scale=sum_scale,
                 bound=bound("residual_sum", dt, 1), quantity="fused_add_norm.residual",
                 call=code)
    x_hat, r, kappa, out_scale = _norm_terms(norm, s, shape, axes, w64, b64, e)
    kw = {"contract": contract, "dtype": dt}
    other = {"contract": OTHER[contract], "dtype": dt}
    expected = spec.fused_add_norm(x64, r64, norm, shape, w64, b64, e, **kw)[0]
    _conforms_or_hint(ctx, spec.fused_add_norm(x64, r64, norm, shape, w64, b64, e, **other)[0],
                      contract, expected=expected, actual=res.output, scale=out_scale,
                      bound=bound("output", dt, d, kappa), quantity="fused_add_norm.output",
                      call=code)
    judged = Judged(res.output, expected, out_scale, d, kappa), \
        Judged(res.residual, written, sum_scale, 1, 1.0)
    if not grads:
        return judged
    gy64, gr64 = f64(gy), f64(gr)
    gx, g_res, gw, gb = spec.fused_add_norm_vjp(x64, r64, gy64, gr64, norm, shape, w64, b64,
                                                e, **kw)
    ctx.oracle(f"expected_grads = spec.fused_add_norm_vjp(x, residual, grad_output, "
               f"grad_residual, {norm!r}, {shape!r}, weight, bias, {e!r}, contract={contract!r})",
               "show(result.grad_input, expected_grads[0], name='grad_input')",
               "show(result.grad_residual, expected_grads[1], name='grad_residual')")
    h = np.abs(gy64 * (w64 if w64 is not None else 1.0))
    g_scale = grad_input_scale(r, h, x_hat, axes, centre=norm == "layer_norm") + \
        np.max(np.abs(gr64), axis=axes, keepdims=True)
    other_gx = spec.fused_add_norm_vjp(x64, r64, gy64, gr64, norm, shape, w64, b64, e,
                                       **other)[0]
    for field, want in (("grad_input", gx), ("grad_residual", g_res)):
        _conforms_or_hint(ctx, other_gx, contract, expected=want, actual=getattr(res, field),
                          scale=g_scale, bound=bound("fused_gradient", dt, d, kappa),
                          quantity=f"fused_add_norm.{field}", call=code)
    lead = tuple(range(axes[0]))
    w_scale, b_scale = param_grad_scales(gy64, x_hat, lead)
    if gw is not None:
        ctx.oracle("show(result.grad_weight, expected_grads[2], name='grad_weight')")
        ctx.conforms(expected=gw, actual=res.grad_weight, scale=w_scale,
                     bound=bound("param_gradient", dt, gy64.size, np.max(kappa)),
                     quantity="fused_add_norm.grad_weight", call=code)
    if gb is not None:
        ctx.oracle("show(result.grad_bias, expected_grads[3], name='grad_bias')")
        ctx.conforms(expected=gb, actual=res.grad_bias, scale=b_scale,
                     bound=bound("bias_gradient", dt, gy64.size // max(1, gb.size)),
                     quantity="fused_add_norm.grad_bias",
                     call=code)
    return judged
