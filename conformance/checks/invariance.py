"""Invariance (B1, B2): LayerNorm is unchanged by a shift, RMSNorm is not; both are
unchanged by a positive scale once eps is rescaled with it (eps / a^2), and a negative
scale flips the sign. eps is accounted for exactly, never by a looser tolerance."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np

from ..cases import ArraySpec
from ..ops import layer_norm_case, rms_norm_case
from ..tolerances import bound, centring_kappa, unit_roundoff
from . import check

SHAPES = ((4, 64), (2, 1000))


def shift_for(dtype) -> float:
    """1e4 in float32 (the case that exposes var = E[x^2] - E[x]^2); in half precision
    the largest power of two that still leaves 4 bits for a unit spread."""
    p = int(round(-np.log2(unit_roundoff(dtype))))
    return float(min(1e4, 2.0 ** (p - 4)))


def _call(ctx, op, x, shape, eps, tag):
    fn = getattr(ctx.backend, op)
    args = (x, shape, None, None, eps) if op == "layer_norm" else (x, shape, None, eps)
    code = f"{tag}_out = backend.{op}({'x' if tag == 'shifted' else tag}, {shape!r}, " + \
           ("None, None, " if op == "layer_norm" else "None, ") + f"{eps!r}).output"
    return ctx.call(code, fn, *args, outputs_like={"output": (x.shape, x.dtype)}).output


@check("B1.layer_norm_shift", title="LayerNorm is unchanged by x + c (c = 1e4 against a unit "
       "spread in float32)", ops=("layer_norm",))
def layer_norm_shift(ctx):
    c = shift_for(ctx.dtype)
    for shape in SHAPES:
        with ctx.case(f"x + {c:g}, spread 1, d = {shape[-1]}"):
            recipe = ArraySpec(shape, ctx.seed, c, 1.0)
            # the backend on the shifted rows against the oracle on the same rows
            layer_norm_case(ctx, x=recipe, normalized_shape=shape[-1:], eps=1e-5)
            shifted = ctx.inputs["x"].build(ctx.dtype)
            # x - c is exact (Sterbenz): the backend must give the same rows back
            unshifted = (shifted.astype(np.float64) - c).astype(ctx.dtype)
            assert np.array_equal(unshifted.astype(np.float64) + c, shifted.astype(np.float64))
            ctx.oracle(f"unshifted = (x.astype(np.float64) - {c!r}).astype(x.dtype)")
            got_shifted = _call(ctx, "layer_norm", shifted, shape[-1:], 1e-5, "shifted")
            got_plain = _call(ctx, "layer_norm", unshifted, shape[-1:], 1e-5, "unshifted")
            ctx.oracle("show(shifted_out, unshifted_out.astype(np.float64), "
                       "name='output of x + c, against that of x')")
            x64 = shifted.astype(np.float64)
            kappa = centring_kappa(x64, (-1,), 1e-5)
            row_scale = np.abs(spec.layer_norm(x64, shape[-1:], eps=1e-5)).max(-1, keepdims=True)
            ctx.conforms(
                expected=got_plain.astype(np.float64), actual=got_shifted,
                scale=np.maximum(row_scale, 1.0), bound=bound("invariance", ctx.dtype, shape[-1], kappa),
                quantity="layer_norm.output", what="layer_norm(x + c) against layer_norm(x)",
                call="shifted vs unshifted")


@check("B1.rms_norm_shift", title="RMSNorm is not shift invariant: it changes exactly as the "
       "oracle says", ops=("rms_norm",))
def rms_norm_shift(ctx):
    for c in (0.5, 10.0):
        with ctx.case(f"x + {c:g} changes the output"):
            shape = (4, 64)
            base = ArraySpec(shape, ctx.seed, 0.0, 1.0)
            rms_norm_case(ctx, x=ArraySpec(shape, ctx.seed, c, 1.0),
                          normalized_shape=(64,), eps=1e-6)
            shifted_out = _call(ctx, "rms_norm", ctx.inputs["x"].build(ctx.dtype), (64,), 1e-6,
                                "shifted")
            plain = spec.rms_norm(base.build(ctx.dtype), (64,), eps=1e-6)
            ctx.differs(first=plain, second=shifted_out, scale=1.0,
                        at_least=float(bound("output", ctx.dtype, 64)),
                        what="rms_norm(x + c) and rms_norm(x)", call="shifted vs plain")


def _scale_cases(ctx, op):
    d = 100
    for a in (2.0**-8, 3.0, 2.0**10):
        for sign in (1.0, -1.0):
            with ctx.case(f"x * {sign * a:g}, eps rescaled to eps / a^2"):
                eps = 1e-3
                x, xa = ctx.use(x=ArraySpec((3, d), ctx.seed, 0.5, 1.0),
                                x_scaled=ArraySpec((3, d), ctx.seed, 0.5, 1.0, factor=sign * a))
                got = _call(ctx, op, xa, (d,), eps, "x_scaled")
                ref_fn = spec.layer_norm if op == "layer_norm" else spec.rms_norm
                xa64 = xa.astype(np.float64)
                # norm(a x; eps) == sign(a) * norm(|a| x / |a|; eps / a^2): compare against
                # the oracle at the rescaled eps on the unscaled rows
                e = ctx.effective(eps, "eps")
                expected = np.sign(sign) * ref_fn(xa64 / (sign * a), (d,), eps=e / a**2)
                ctx.oracle(f"expected = {sign!r} * spec.{op}(x_scaled.astype(np.float64) / "
                           f"{sign * a!r}, ({d},), eps={e / a**2!r})",
                           "show(x_scaled_out, expected, name='output')")
                kappa = centring_kappa(xa64, (-1,), e) if op == "layer_norm" else 1.0
                row_scale = np.maximum(np.abs(expected).max(-1, keepdims=True), 1.0)
                ctx.conforms(
                    expected=expected, actual=got, scale=row_scale,
                    bound=bound("output", ctx.dtype, d, kappa),
                    quantity=f"{op}.output", what=f"{op}(a x; eps)",
                    call=f"backend.{op}(x_scaled, ...)")
                if a in (2.0**-8, 2.0**10):
                    # a power of two scales exactly: the backend must agree with itself
                    got_plain = _call(ctx, op, x, (d,), eps / a**2, "x")
                    ctx.oracle(f"show(x_scaled_out, {sign!r} * x_out.astype(np.float64), "
                               "name='output, against the unscaled call')")
                    ctx.conforms(
                        expected=sign * got_plain.astype(np.float64), actual=got,
                        scale=row_scale, bound=bound("invariance", ctx.dtype, d, kappa),
                        quantity=f"{op}.output",
                        what=f"{op}(a x; eps) against sign(a) {op}(x; eps / a^2)",
                        call="scaled vs unscaled")


@check("B2.layer_norm_scale", title="LayerNorm(a x; eps) = sign(a) LayerNorm(x; eps / a^2)",
       ops=("layer_norm",))
def layer_norm_scale(ctx):
    _scale_cases(ctx, "layer_norm")


@check("B2.rms_norm_scale", title="RMSNorm(a x; eps) = sign(a) RMSNorm(x; eps / a^2)",
       ops=("rms_norm",))
def rms_norm_scale(ctx):
    _scale_cases(ctx, "rms_norm")

