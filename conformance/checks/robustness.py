"""Numerical robustness: inputs that break careless kernels. float16 rows around +-1000
(sum x^2 overflows if accumulated in float16), a large mean with a tiny spread, all-zero
and constant rows (eps keeps them finite), constant rows and BatchNorm channels near the
largest finite value (a sum of x or x^2 overflows there), non-contiguous inputs, and
NaN/inf.

What the spec implies for NaN and inf: the formulas are evaluated in IEEE arithmetic,
so a NaN anywhere in a row makes that row's mean (and so every output of the row) NaN;
an inf makes LayerNorm's row NaN (inf - inf) and RMSNorm's row 0 except NaN at the inf
(x / inf, inf / inf); other rows are untouched. The oracle computes exactly that."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np

from ..cases import ArraySpec, Literal
from ..ops import BatchNormDriver, layer_norm_case, rms_norm_case
from . import check

OPS = {"layer_norm": layer_norm_case, "rms_norm": rms_norm_case}


def _both(ctx, label, **kw):
    for op, case_fn in OPS.items():
        if op not in ctx.backend.capabilities.ops:
            continue
        with ctx.case(f"{op}: {label}", op=op):
            ctx.require(op)
            args = dict(kw)
            if op == "rms_norm":
                args.pop("bias", None)
            case_fn(ctx, **args)


@check("F2/F3.half_overflow", title="Rows around +-1000: sum x^2 overflows float16 if "
       "accumulated there", ops=("layer_norm", "rms_norm"))
def half_overflow(ctx):
    for sign in (1.0, -1.0):
        _both(ctx, f"x ~ N({sign * 1000:g}, 30), d = 512", eps=1e-5,
              x=ArraySpec((3, 512), ctx.seed, sign * 1000.0, 30.0), normalized_shape=(512,))


@check("F2.large_mean_tiny_spread", title="A large mean with a tiny spread (cancellation in "
       "the variance)", ops=("layer_norm",))
def large_mean(ctx):
    with ctx.case("x ~ N(300, 0.05), d = 256"):
        layer_norm_case(ctx, x=ArraySpec((3, 256), ctx.seed, 300.0, 0.05),
                                       normalized_shape=(256,), eps=1e-5)


@check("F2/F3.degenerate_rows", title="All-zero and constant rows: eps keeps the output finite "
       "(LayerNorm gives beta)", ops=("layer_norm", "rms_norm"))
def degenerate(ctx):
    w, b = ArraySpec((8,), ctx.seed, 1.0, 0.5), ArraySpec((8,), ctx.seed + 1, 0.0, 0.5)
    _both(ctx, "all-zero rows", x=Literal.of(np.zeros((2, 8))), normalized_shape=(8,),
          weight=w, bias=b, eps=1e-5)
    _both(ctx, "constant rows", x=Literal.of(np.full((2, 8), 5.0)), normalized_shape=(8,),
          weight=w, bias=b, eps=1e-5)


#: The constant row of pytorch #173793 (Inductor's LayerNorm gave NaN, eager did not).
ROW_OF_173793 = 8.5e37


@check("F1/F2.constant_near_max", title="Constant rows (LayerNorm) and channels (BatchNorm) "
       "near the largest finite value: their mean and variance (c, 0) are finite, so the "
       "output is beta; a sum of x or of x^2 overflows to inf and gives NaN",
       ops=("layer_norm", "batch_norm"), dtypes=("float32", "bfloat16"))
def constant_near_max(ctx):
    """Bug class 9 (pytorch #173793, #178084): d copies of c add up beyond the largest
    float32 for |c| > max / d, and c^2 for |c| > 1.8e19, while every statistic the
    formula names is still finite (mean c, variance 0): a kernel that divides the sum by
    d, or takes the variance from x^2, gets inf, then inf - inf or 0 * inf. A scaled,
    shifted or running (Welford) mean with a centred variance, or float64 sums, stay
    exact. BatchNorm's channels are the same sums over the batch (16 samples here),
    and its running statistics stay finite too (momentum c, unbiased variance 0). The
    derived bound is huge here (one ulp of the mean, 1e31 at 8.5e37, times 1/sqrt(eps)
    is what the mean's rounding may cost a correct kernel), so what fails is what the
    bug gives: NaN or inf. Gradients are checked too where the backend returns them.
    Only float32 and bfloat16 reach such values: float16's largest, 65504, times any
    row length stays far inside float32; float64 values near 1.8e308 would overflow the
    oracle's own float64 sums. RMSNorm is left out: its statistic, mean(x^2) = c^2, is
    beyond float32 itself for |c| > 1.8e19, so no float32-compute kernel can hold it."""
    top = spec.largest_finite(ctx.dtype)
    caps = ctx.backend.capabilities
    for c in (ROW_OF_173793, -top):
        if "layer_norm" in caps.ops:
            for d in (8, 768):
                with ctx.case(f"layer_norm: rows of {c:g}, d = {d}", op="layer_norm"):
                    ctx.require("layer_norm")
                    grad = ArraySpec((2, d), ctx.seed + 2, 0.0, 1.0) \
                        if "layer_norm" in caps.gradients else None
                    layer_norm_case(ctx, x=Literal.of(np.full((2, d), c)),
                                    normalized_shape=(d,),
                                    weight=ArraySpec((d,), ctx.seed, 1.0, 0.5),
                                    bias=ArraySpec((d,), ctx.seed + 1, 0.0, 0.5), eps=1e-5,
                                    grad=grad)
        if "batch_norm" in caps.ops:
            with ctx.case(f"batch_norm: channels of {c:g}, 16 samples, train", op="batch_norm"):
                ctx.require("batch_norm")
                grad = ArraySpec((16, 3), ctx.seed + 2, 0.0, 1.0) \
                    if "batch_norm" in caps.gradients else None
                driver = BatchNormDriver(ctx, 3, weight=ArraySpec((3,), ctx.seed, 1.0, 0.5),
                                         bias=ArraySpec((3,), ctx.seed + 1, 0.0, 0.5))
                driver.step("x", Literal.of(np.full((16, 3), c)), mode="train", grad=grad)


@check("F2/F3.non_contiguous", title="A non-contiguous input (transposed in memory) gives the "
       "same result", ops=("layer_norm", "rms_norm"))
def non_contiguous(ctx):
    _both(ctx, "x stored transposed", x=ArraySpec((6, 40), ctx.seed, 1.0, 2.0, "transposed"),
          normalized_shape=(40,), eps=1e-5)


@check("F2/F3.subnormals", title="float16 subnormal inputs and outputs are not flushed to "
       "zero", ops=("layer_norm", "rms_norm"), dtypes=("float16",))
def subnormals(ctx):
    """float16 only: its subnormals (below 6.1e-5) square to numbers float32 still holds,
    so a correct float32-compute kernel gets them right; in bfloat16 and float32 they would
    underflow in any float32 computation."""
    tiny = ArraySpec((3, 64), ctx.seed, 0.0, 1e-6)
    _both(ctx, "x ~ N(0, 1e-6): subnormal inputs, eps 1e-14", x=tiny, normalized_shape=(64,),
          eps=1e-14)
    _both(ctx, "x ~ N(0, 1e-6), eps 1: subnormal outputs", x=tiny, normalized_shape=(64,),
          eps=1.0)


@check("F2/F3.nan_inf", title="NaN and inf propagate within their row as IEEE arithmetic says "
       "and leave other rows alone", ops=("layer_norm", "rms_norm"))
def nan_inf(ctx):
    rows = np.random.default_rng(ctx.seed).normal(size=(4, 6)).round(3)
    rows[1, 2], rows[2, 4], rows[3, 0] = np.nan, np.inf, -np.inf
    _both(ctx, "rows with NaN, inf and -inf beside a finite row", x=Literal.of(rows),
          normalized_shape=(6,), eps=1e-5)
