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
from ..tolerances import constant_row_bound
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


#: pytorch #173793's constant row: d c and c^2 overflow float32.
ROW_OF_173793 = 8.5e37
#: Constant values near the top of float32's range: 1e30 (c^2 overflows, d c does not)
#: and #173793's; the dtype's largest value is added.
NEAR_MAX = (1e30, ROW_OF_173793)
#: Row lengths: short and BERT's; #173793's row also longer than a Triton block (16384).
NEAR_MAX_LENGTHS = (8, 768)
LONG_NEAR_MAX_ROW = 16385


def _beta_within_gamma(ctx, *, expected, actual, gamma, beta, n, axis, quantity, call):
    """The constant-row bound (tolerances TABLE["constant_row"]): beta to within |gamma|;
    `axis`: the axis of the normalized values (the row's, or BatchNorm's samples)."""
    scale = np.max(np.abs(gamma) + np.abs(beta), axis=axis, keepdims=True)
    ctx.conforms(expected=expected, actual=actual, scale=scale,
                 bound=constant_row_bound(ctx.dtype, n, gamma, scale), quantity=quantity,
                 call=call)


@check("F1/F2.constant_near_max", title="Constant rows (LayerNorm) and channels (BatchNorm) "
       "near the largest finite value: their mean and variance (c, 0) are finite, so the "
       "output is beta; a sum of x or of x^2 overflows to inf and gives NaN",
       ops=("layer_norm", "batch_norm"), dtypes=("float32", "bfloat16"))
def constant_near_max(ctx):
    """Bug class 9 (pytorch #173793, #178084): c^2 overflows float32 for |c| > 1.8e19 and
    d copies of c add up beyond it for |c| > max / d, while every statistic the formula
    names is still finite (mean c, variance 0): a kernel that takes the variance from
    x^2, or divides the sum by d, gets inf, then inf - inf or 0 * inf. A centred
    variance from a mean whose sum cannot overflow (scaled, shifted, running, or in
    float64) gives beta: whatever the mean's rounding delta, every centred value is
    delta, so |x_hat| is at most 1 (0 where var = delta^2 overflows), and the output is
    compared with the oracle's beta to within |gamma| (TABLE["constant_row"]; gamma ~ 1
    and beta ~ 4, so 0 or NaN fails; so does a kernel that folds the affine step into
    x a + (beta - mean a), whose two huge terms swallow beta).

    The layer_norm_case / BatchNormDriver comparisons run first, with the ordinary
    bound, whose kappa is huge here (one ulp of the mean is 1e31 at 8.5e37): on the
    gradients, which a rounded mean legitimately changes (dx is 0 where var overflows),
    they hold the backend to finite values only. BatchNorm's channels are the same sums
    over the batch (16 samples); its running statistics are not compared here: a mean
    one ulp off makes the running variance delta^2, inf in float32, legitimately (other
    checks compare them). Only float32 and bfloat16 reach such values: float16's
    largest, 65504, squared or times any row length stays far inside float32; float64
    values near 1.8e308 would overflow the oracle's own sums. RMSNorm is left out: its
    statistic, mean(x^2) = c^2, is not representable in float32, so the spec's answer
    is not demanded of a float32-compute kernel."""
    caps = ctx.backend.capabilities
    for c in NEAR_MAX + (-spec.largest_finite(ctx.dtype),):
        if "layer_norm" in caps.ops:
            for d in NEAR_MAX_LENGTHS + ((LONG_NEAR_MAX_ROW,) if c == ROW_OF_173793 else ()):
                with ctx.case(f"layer_norm: rows of {c:g}, d = {d}", op="layer_norm"):
                    ctx.require("layer_norm")
                    grad = ArraySpec((2, d), ctx.seed + 2, 0.0, 1.0) \
                        if "layer_norm" in caps.gradients else None
                    x = ArraySpec((2, d), ctx.seed, c, 0.0)  # spread 0: every value c
                    w = ArraySpec((d,), ctx.seed, 1.0, 0.25)
                    b = ArraySpec((d,), ctx.seed + 1, 4.0, 0.5)
                    res = layer_norm_case(ctx, x=x, normalized_shape=(d,), weight=w, bias=b,
                                          eps=1e-5, grad=grad)
                    gamma, beta = (a.build(ctx.dtype).astype(np.float64) for a in (w, b))
                    expected = spec.layer_norm(x.build(ctx.dtype).astype(np.float64), (d,),
                                               gamma, beta, 1e-5)
                    _beta_within_gamma(ctx, expected=expected, actual=res.output, gamma=gamma,
                                       beta=beta, n=d, axis=-1, quantity="layer_norm.output",
                                       call=f"backend.layer_norm(x, ({d},), weight, bias, 1e-05"
                                       + (", grad_output=grad)" if grad else ")"))
        if "batch_norm" in caps.ops:
            with ctx.case(f"batch_norm: channels of {c:g}, 16 samples, train", op="batch_norm"):
                ctx.require("batch_norm")
                grad = ArraySpec((16, 3), ctx.seed + 2, 0.0, 1.0) \
                    if "batch_norm" in caps.gradients else None
                driver = BatchNormDriver(ctx, 3, weight=ArraySpec((3,), ctx.seed, 1.0, 0.25),
                                         bias=ArraySpec((3,), ctx.seed + 1, 4.0, 0.5),
                                         compare_stats=False)
                x = ArraySpec((16, 3), ctx.seed, c, 0.0)  # spread 0: every value c
                out = driver.step("x", x, mode="train", grad=grad)
                expected = spec.batch_norm_train(x.build(ctx.dtype).astype(np.float64), None,
                                                 None, driver.w64, driver.b64, eps=driver.e)[0]
                _beta_within_gamma(ctx, expected=expected, actual=out, gamma=driver.w64[None],
                                   beta=driver.b64[None], n=16, axis=0,
                                   quantity="batch_norm.train.output",
                                   call="layer.forward(x" + (", grad_output=x_grad)" if grad
                                                             else ")"))


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
