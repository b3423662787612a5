"""F8's Pre-LN residual add fused with the norm, as inference engines run it
(`residual = x + residual; y = norm(residual)`, both returned), against the oracle under
the backend's declared contract (conventions.fused_residual_sum: the norm of the sum
rounded to the activation dtype, or of the unrounded float32 sum): the normalized output,
the residual written back and, in one case of each check, dL/dx, dL/dresidual, dL/dgamma
and dL/dbeta.

The residual is a large activation plus a small update (its bits reach below the
residual's last place in float16 and bfloat16), as in a deep Pre-LN stack. For LayerNorm
its rows have a large mean and a small spread (mean 200, spread ~1.4), so rounding the
sum to float16 or bfloat16 moves the centred values by many ULPs of the output: there the
two contracts differ far beyond the bound, and a backend following the other contract, or
mixing them, fails. RMSNorm passes that rounding on unamplified (about one ULP of the
dtype, within its bound), so its check verifies the op and both outputs but cannot tell
the contracts apart. In float32 and float64 the contracts coincide within every bound."""

from __future__ import annotations

from ..cases import ArraySpec
from ..ops.fused import fused_add_norm_case
from . import check

#: LayerNorm rows: the residual's mean and spread, the update's spread (see the docstring).
LN_MEAN, LN_SPREAD, UPDATE_SPREAD = 200.0, 1.0, 1.0
#: RMSNorm rows: a residual of spread 8 and an update of spread 0.3.
RMS_SPREAD, RMS_UPDATE = 8.0, 0.3
#: a row wider than one block of 1024 lanes, by an odd tail of 15: fused kernels walk it
#: in two passes (see _shape_cases)
WIDE_D = 1039


def _case(ctx, name, *, norm, shape, normalized_shape, seed, weight, bias, eps, gradient,
          mean, spread, update, layouts=("contiguous", "contiguous")):
    with ctx.case(name, op="fused_add_norm"):
        ctx.require("fused_add_norm", gradient=gradient)
        p = tuple(normalized_shape)
        fused_add_norm_case(
            ctx, norm=norm, normalized_shape=p, eps=eps,
            x=ArraySpec(shape, seed, 0.0, update, layouts[0]),
            residual=ArraySpec(shape, seed + 1, mean, spread, layouts[1]),
            weight=ArraySpec(p, seed + 2, 1.0, 0.3) if weight else None,
            bias=ArraySpec(p, seed + 3, 0.0, 0.3) if bias else None,
            grad_output=ArraySpec(shape, seed + 4) if gradient else None,
            grad_residual=ArraySpec(shape, seed + 5) if gradient else None)


def _shape_cases(rows, seed, **extra):
    """Where fused kernels break as the plain ones do (shapes.py): a width that is not a
    power of two over 300 rows (padded lanes; the 256-row thresholds where a kernel
    switches path), rows wider than one block of 1024 (a two-pass kernel: pass 1 adds,
    writes the residual back and sums the statistics, pass 2 reloads the row to
    normalize it, and must reload the sum it wrote, not x), a 3-D input normalized over
    its last axis alone (a kernel that takes shape[0] for the row count), and x and the
    residual as views (a transposed x, a residual of stride 2: a kernel that ignores
    strides). All gradients in each."""
    common = dict(rows, weight=True, eps=1e-5, gradient=True, **extra)
    return [
        ("300 rows of d = 24: both outputs and all gradients",
         dict(common, shape=(300, 24), normalized_shape=(24,), seed=seed)),
        (f"3 rows of d = {WIDE_D}, wider than one block: both outputs and all gradients",
         dict(common, shape=(3, WIDE_D), normalized_shape=(WIDE_D,), seed=seed + 3)),
        ("x (2, 3, 24) normalized over its last axis: both outputs and all gradients",
         dict(common, shape=(2, 3, 24), normalized_shape=(24,), seed=seed + 1)),
        ("x transposed and the residual strided in memory, (2, 5, 24): both outputs and "
         "all gradients",
         dict(common, shape=(2, 5, 24), normalized_shape=(24,), seed=seed + 2,
              layouts=("transposed", "strided"))),
    ]


def layer_norm_cases(seed):
    """(name, keyword arguments of _case) of F8.fused_add_layer_norm; tests/ use them to
    show that the two contracts' oracles differ on them far beyond the bound."""
    rows = {"norm": "layer_norm", "mean": LN_MEAN, "spread": LN_SPREAD, "update": UPDATE_SPREAD}
    return [
        ("rows of mean 200 and spread ~1.4, gamma and beta, eps 1e-5: both outputs",
         dict(rows, shape=(4, 16), normalized_shape=(16,), seed=seed, weight=True, bias=True,
              eps=1e-5, gradient=False)),
        ("the same, normalized_shape (4, 8), eps 1e-3: both outputs and all gradients",
         dict(rows, shape=(3, 4, 8), normalized_shape=(4, 8), seed=seed + 10, weight=True,
              bias=True, eps=1e-3, gradient=True)),
        ("no gamma, no beta: both outputs",
         dict(rows, shape=(4, 16), normalized_shape=(16,), seed=seed + 20, weight=False,
              bias=False, eps=1e-5, gradient=False)),
        *_shape_cases(rows, seed + 30, bias=True),
    ]


def rms_norm_cases(seed):
    """(name, keyword arguments of _case) of F8.fused_add_rms_norm."""
    rows = {"norm": "rms_norm", "mean": 0.0, "spread": RMS_SPREAD, "update": RMS_UPDATE,
            "bias": False}
    return [
        ("residual of spread 8 plus an update of 0.3, gamma, eps 1e-6: both outputs",
         dict(rows, shape=(4, 64), normalized_shape=(64,), seed=seed, weight=True, eps=1e-6,
              gradient=False)),
        ("the same, normalized_shape (4, 16), eps 1e-5: both outputs and all gradients",
         dict(rows, shape=(3, 4, 16), normalized_shape=(4, 16), seed=seed + 10, weight=True,
              eps=1e-5, gradient=True)),
        ("no gamma: both outputs",
         dict(rows, shape=(4, 64), normalized_shape=(64,), seed=seed + 20, weight=False,
              eps=1e-6, gradient=False)),
        *_shape_cases(rows, seed + 30),
    ]


@check("F8.fused_add_rms_norm", title="Fused residual add + RMSNorm: the residual written "
       "back and RMSNorm of the sum, under the declared contract, with gradients",
       ops=("fused_add_norm",))
def fused_add_rms_norm(ctx):
    for name, kw in rms_norm_cases(ctx.seed + 950):
        _case(ctx, name, **kw)


@check("F8.fused_add_layer_norm", title="Fused residual add + LayerNorm: the residual "
       "written back and LayerNorm of the sum, under the declared contract (rounded or "
       "float32 sum), with gradients", ops=("fused_add_norm",))
def fused_add_layer_norm(ctx):
    for name, kw in layer_norm_cases(ctx.seed + 980):
        _case(ctx, name, **kw)
