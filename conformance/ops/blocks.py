"""F8 Transformer encoder layers (Post-LN, Pre-LN, a Pre-LN stack with a final LN) of the
backend against the oracle's wirings: forward, and dL/dx when an upstream gradient is
given."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np

from ..cases import ArraySpec
from ..tolerances import block_kappa, block_stages, bound
from ._common import f64


def _scale(ref):
    """The token's largest |reference| (TABLE["block"]), floored at the smallest normal so
    an all-zero token is measured absolutely."""
    return np.maximum(np.max(np.abs(ref), axis=-1, keepdims=True), np.finfo(np.float64).tiny)


def _weight_recipes(seed, d_model, d_ff):
    """One seeded recipe per parameter, named as an identifier (torch's names with
    '.' -> '__'), linear weights with spread 1/sqrt(fan_in) so each sublayer has gain ~1,
    LayerNorm gains around 1."""
    e, f = d_model, d_ff
    shapes = {"self_attn.in_proj_weight": (3 * e, e), "self_attn.in_proj_bias": (3 * e,),
              "self_attn.out_proj.weight": (e, e), "self_attn.out_proj.bias": (e,),
              "linear1.weight": (f, e), "linear1.bias": (f,), "linear2.weight": (e, f),
              "linear2.bias": (e,), "norm1.weight": (e,), "norm1.bias": (e,),
              "norm2.weight": (e,), "norm2.bias": (e,)}
    recipes = {}
    for i, (name, shape) in enumerate(shapes.items()):
        if name.startswith("norm"):
            mean, spread = (1.0, 0.2) if name.endswith("weight") else (0.0, 0.2)
        elif name.endswith("weight"):
            mean, spread = 0.0, 1.0 / np.sqrt(shape[1])
        else:
            mean, spread = 0.0, 0.1
        recipes[name.replace(".", "__")] = ArraySpec(shape, seed + i, mean, float(spread))
    return recipes


def encoder_layer_case(ctx, *, seed, norm_first, activation="relu", num_heads=4, eps=1e-5,
                       num_layers=1, final_norm=False, shape=(2, 5, 16), d_ff=32,
                       gradient=True) -> None:
    """One encoder layer (or a stack of `num_layers` copies, with a final LayerNorm when
    `final_norm`) of the backend against spec.transformer_encoder(_layer)(_vjp)."""
    d = shape[-1]
    names = _weight_recipes(seed + 2, d, d_ff)
    extra = {"final_weight": ArraySpec((d,), seed + 40, 1.0, 0.2),
             "final_bias": ArraySpec((d,), seed + 41, 0.0, 0.2)} if final_norm else {}
    built = ctx.use(x=ArraySpec(shape, seed), grad=ArraySpec(shape, seed + 1) if gradient else None,
                    **names, **extra)
    xa, g = built[0], built[1]
    params = {k.replace("__", "."): v for k, v in zip(names, built[2:2 + len(names)], strict=True)}
    fn = None
    if final_norm:
        fn = {"weight": built[-2], "bias": built[-1]}
    ctx.oracle("params = {" + ", ".join(f"{k.replace('__', '.')!r}: {k}" for k in names) + "}")
    if final_norm:
        ctx.oracle("final_norm = {'weight': final_weight, 'bias': final_bias}")
    kw = f"norm_first={norm_first!r}, activation={activation!r}, eps={eps!r}"
    code = (f"result = backend.encoder_layer(x, params, {num_heads}, {kw}"
            + (f", num_layers={num_layers}" if num_layers != 1 else "")
            + (", final_norm=final_norm" if final_norm else "")
            + (", grad_output=grad)" if gradient else ")"))
    like = {"output": (xa.shape, xa.dtype)}
    if gradient:
        like["grad_input"] = (xa.shape, xa.dtype)
    def run(x_in, *arrays):
        # the backend gets the twins call() made, in dicts of its own: the oracle reads
        # `params` after the call, and a backend that rewrote the dict it was handed made
        # the oracle compute its own wrong answer (found by a red team)
        handed = iter(arrays)
        p = {k: next(handed) for k in params}
        f = None if fn is None else {k: next(handed) for k in fn}
        return ctx.backend.encoder_layer(x_in, p, num_heads, norm_first=norm_first,
                                         activation=activation, eps=eps, num_layers=num_layers,
                                         final_norm=f, grad_output=next(handed, None))

    # the arrays go through call() so that one written in place is caught, by its name
    names = ("x", *(f"params[{k!r}]" for k in params),
             *(f"final_norm[{k!r}]" for k in (fn or {})), *(() if g is None else ("grad",)))
    res = ctx.call(code, run, xa, *params.values(), *(fn or {}).values(),
                   *([] if g is None else [g]), outputs_like=like, arg_names=names)
    e = ctx.effective(eps, "eps")
    x64 = f64(xa)
    p64 = {k: f64(v) for k, v in params.items()}
    fn64 = None if fn is None else {k: f64(v) for k, v in fn.items()}
    opts = {"norm_first": norm_first, "activation": activation, "eps": e}
    pyopts = f"norm_first={norm_first!r}, activation={activation!r}, eps={e!r}"
    stacked = num_layers > 1 or final_norm
    if stacked:
        expected = spec.transformer_encoder(x64, [p64] * num_layers, num_heads, fn64, **opts)
        ctx.oracle(f"expected = spec.transformer_encoder(x, [params] * {num_layers}, {num_heads}, "
                   f"{'final_norm' if final_norm else 'None'}, {pyopts})")
    else:
        expected = spec.transformer_encoder_layer(x64, p64, num_heads, **opts)
        ctx.oracle(f"expected = spec.transformer_encoder_layer(x, params, {num_heads}, {pyopts})")
    ctx.oracle("show(result.output, expected, name='output')")
    n, kappa = max(d, d_ff), block_kappa(d)
    ctx.conforms(expected=expected, actual=res.output, scale=_scale(expected),
                 bound=bound("block", ctx.dtype, n, kappa * block_stages(num_layers, final_norm,
                                                                         gradient=False)),
                 quantity="encoder_layer.output", call=code)
    if not gradient:
        return
    g64 = f64(g)
    if stacked:
        gx = spec.transformer_encoder_vjp(x64, g64, [p64] * num_layers, num_heads, fn64, **opts)[0]
        ctx.oracle(f"expected_gx = spec.transformer_encoder_vjp(x, grad, [params] * {num_layers}, "
                   f"{num_heads}, {'final_norm' if final_norm else 'None'}, {pyopts})[0]")
    else:
        gx = spec.transformer_encoder_layer_vjp(x64, g64, p64, num_heads, **opts)[0]
        ctx.oracle(f"expected_gx = spec.transformer_encoder_layer_vjp(x, grad, params, "
                   f"{num_heads}, {pyopts})[0]")
    ctx.oracle("show(result.grad_input, expected_gx, name='grad_input')")
    ctx.conforms(expected=gx, actual=res.grad_input, scale=_scale(gx),
                 bound=bound("block", ctx.dtype, n, kappa * block_stages(num_layers, final_norm,
                                                                         gradient=True)),
                 quantity="encoder_layer.grad_input", call=code)
