"""Values: each op's forward output against the oracle (F1, F2, F3, F5, F6), on
Hypothesis-drawn shapes (1-3 normalized axes, sizes that are not powers of two, d = 1)
and values, plus fixed cases: a row longer than 65536, two normalized axes, d = 1,
LayerNorm with gamma alone and with beta alone, BatchNorm with 100 channels, QK scales
other than 1/sqrt(d_k) (the scale is a parameter, not something the backend may compute
itself) and QK-norm at head_dim 256."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .. import strategies as ns
from ..cases import ArraySpec, Literal
from ..ops import BatchNormDriver, layer_norm_case, qk_scores_case, rms_norm_case
from . import check

LONG_ROW = 70_003  # > 65536 and odd: exercises tails and 16-bit index overflow
#: Scales other than 1/sqrt(d_k): none at all (a temperature folded elsewhere) and a
#: learned temperature below it.
QK_SCALES = (1.0, 0.1)
#: Gemma's head_dim: wider than one 128-lane warp, so a kernel sums each row's squares
#: across two warps; one that skips the cross-warp step normalizes each 128-lane half by
#: its own RMS. The drawn cases stop at 160, short of that path. The first half's values
#: are QK_HALF_RATIO times the second's (energy spread unevenly over the lanes, as
#: projections' outlier channels spread it): with even halves their RMS differ by
#: sampling noise alone (~6%), a few ULPs of bfloat16, within its bound at 4 seeds in 20.
QK_WIDE_HEAD_DIM, QK_HALF_RATIO = 256, 4.0
#: LayerNorm with one of its two parameters: gamma alone is LayerNorm(bias=False), which
#: many language models use; beta alone is the other half. The drawn cases pass both or
#: neither, and a kernel that takes its affine path only when both are given (or applies
#: beta only inside `if weight is not None`) passed them all.
ONE_PARAMETER = (("gamma only, bias=None (LayerNorm(bias=False))", True, False),
                 ("beta only, weight=None", False, True))
ONE_PARAMETER_SHAPE = (6, 300)


def one_parameter_cases(ctx, *, grad: bool) -> None:
    """F2 with gamma alone and with beta alone, forward (and VJP with `grad`)."""
    rows, d = ONE_PARAMETER_SHAPE
    for name, with_weight, with_bias in ONE_PARAMETER:
        with ctx.case(name):
            layer_norm_case(
                ctx, x=ArraySpec((rows, d), ctx.seed, 1.0, 2.0), normalized_shape=(d,),
                weight=ArraySpec((d,), ctx.seed + 1, 1.0, 0.5) if with_weight else None,
                bias=ArraySpec((d,), ctx.seed + 2, 0.0, 0.5) if with_bias else None,
                grad=ArraySpec((rows, d), ctx.seed + 3) if grad else None)


@check("F2.values", title="LayerNorm forward equals the oracle", ops=("layer_norm",),
       also=("B8",))
def layer_norm_values(ctx):
    ctx.explore("drawn shapes and values", ns.layer_norm_cases(),
                lambda case: layer_norm_case(ctx, **case))
    with ctx.case(f"long row d={LONG_ROW}"):
        layer_norm_case(ctx, x=ArraySpec((2, LONG_ROW), ctx.seed, 3.0, 2.0),
                        normalized_shape=(LONG_ROW,),
                        weight=ArraySpec((LONG_ROW,), ctx.seed + 1, 1.0, 0.5),
                        bias=ArraySpec((LONG_ROW,), ctx.seed + 2, 0.0, 0.5))
    with ctx.case("normalized_shape (3, 5): two axes, not the last one alone"):
        layer_norm_case(ctx, x=ArraySpec((4, 3, 5), ctx.seed, 1.0, 2.0), normalized_shape=(3, 5),
                        weight=ArraySpec((3, 5), ctx.seed + 1, 1.0, 0.5),
                        bias=ArraySpec((3, 5), ctx.seed + 2, 0.0, 0.5))
    with ctx.case("d = 1 (output is beta)"):
        layer_norm_case(ctx, x=ArraySpec((4, 1), ctx.seed, 0.0, 3.0), normalized_shape=(1,),
                        weight=ArraySpec((1,), ctx.seed + 1, 1.0, 0.5),
                        bias=ArraySpec((1,), ctx.seed + 2, 0.0, 0.5))
    one_parameter_cases(ctx, grad=False)


@check("F3.values", title="RMSNorm forward equals the oracle", ops=("rms_norm",))
def rms_norm_values(ctx):
    ctx.explore("drawn shapes and values", ns.layer_norm_cases(with_bias=False),
                lambda case: rms_norm_case(ctx, **{k: v for k, v in case.items() if k != "bias"}))
    with ctx.case(f"long row d={LONG_ROW}"):
        rms_norm_case(ctx, x=ArraySpec((2, LONG_ROW), ctx.seed, 3.0, 2.0),
                      normalized_shape=(LONG_ROW,),
                      weight=ArraySpec((LONG_ROW,), ctx.seed + 1, 1.0, 0.5))
    with ctx.case("normalized_shape (3, 5): two axes, not the last one alone"):
        rms_norm_case(ctx, x=ArraySpec((4, 3, 5), ctx.seed, 1.0, 2.0), normalized_shape=(3, 5),
                      weight=ArraySpec((3, 5), ctx.seed + 1, 1.0, 0.5))
    with ctx.case("d = 1 (output is sign(x) * gamma)"):
        rms_norm_case(ctx, x=ArraySpec((4, 1), ctx.seed, 0.0, 3.0), normalized_shape=(1,),
                      weight=ArraySpec((1,), ctx.seed + 1, 1.0, 0.5))


#: BatchNorm with more channels than a block of 32 and not a multiple of one (nor of 8 or
#: 64): a kernel that takes channels in blocks and forgets the last, partial block; the
#: drawn cases have at most 16 channels
MANY_CHANNELS_SHAPE = (3, 100, 7)


def many_channels_case(ctx, *, grad: bool) -> None:
    """F1 (and its VJP with `grad`) on MANY_CHANNELS_SHAPE, train mode."""
    shape = MANY_CHANNELS_SHAPE
    c = shape[1]
    with ctx.case(f"{c} channels: blocks of 8, 32 or 64 channels leave a partial last one"):
        driver = BatchNormDriver(ctx, c, weight=ArraySpec((c,), ctx.seed + 1, 1.0, 0.5),
                                 bias=ArraySpec((c,), ctx.seed + 2, 0.0, 0.5),
                                 compare_stats=False)
        driver.step("x", ArraySpec(shape, ctx.seed, 1.0, 2.0), mode="train",
                    grad=ArraySpec(shape, ctx.seed + 3, 0.0, 1.0) if grad else None)


def _bn_train(ctx, case):
    x = case["x"]
    driver = BatchNormDriver(ctx, x.shape[1], eps=case["eps"], momentum=case["momentum"],
                             weight=case["weight"], bias=case["bias"], compare_stats=False)
    driver.step("x", x, mode="train")


@check("F1.values", title="BatchNorm training forward equals the oracle (batch statistics, "
       "biased variance)", ops=("batch_norm",))
def batch_norm_train_values(ctx):
    ctx.explore("drawn shapes and values", ns.batch_norm_inputs(), lambda case: _bn_train(ctx, case))
    many_channels_case(ctx, grad=False)


@check("F5.values", title="BatchNorm eval forward uses the running statistics",
       ops=("batch_norm",))
def batch_norm_eval_values(ctx):
    def body(args):
        case, other_seed = args
        x = case["x"]
        driver = BatchNormDriver(ctx, x.shape[1], eps=case["eps"], momentum=case["momentum"],
                                 weight=case["weight"], bias=case["bias"], compare_stats=False)
        driver.step("x", x, mode="train", check_output=False)  # F1's business; sets state
        driver.set_mode(False)
        driver.step("x_eval", ArraySpec(x.shape, other_seed, 1.0, 2.0), mode="eval")

    ctx.explore("train once, eval on another batch",
                st.tuples(ns.batch_norm_inputs(), ns.seeds), body)


@check("F6.values", title="QK-norm scores equal the oracle", ops=("qk_norm_scores",))
def qk_values(ctx):
    @st.composite
    def cases(draw):
        q, k = draw(ns.qk_pairs(max_head_dim=160,
                                max_magnitude=1e3 if ctx.dtype == np.float16 else 1e6),
                    label="q, k")
        d = q.shape[-1]
        gains = draw(st.booleans(), label="learned gains")
        qw = ArraySpec((d,), draw(ns.seeds, label="q gain seed"), 1.0, 0.5) if gains else None
        kw = ArraySpec((d,), draw(ns.seeds, label="k gain seed"), 1.0, 0.5) if gains else None
        return q, k, qw, kw, draw(ns.epsilons, label="eps"), draw(ns.qk_scales, label="scale")

    ctx.explore("drawn q, k, gains and scale", cases(),
                lambda c: qk_scores_case(ctx, q=c[0], k=c[1], q_weight=c[2], k_weight=c[3],
                                         eps=c[4], scale=c[5]))
    # the scale is the caller's: a backend that computes 1/sqrt(d_k) itself must fail here
    for scale in QK_SCALES:
        with ctx.case(f"scale {scale!r} given, not 1/sqrt(d_k) = 0.125 (d_k = 64)"):
            qk_scores_case(ctx, q=ArraySpec((2, 3, 64), ctx.seed, 0.0, 1.0),
                                          k=ArraySpec((2, 4, 64), ctx.seed + 1, 0.0, 1.0),
                                          scale=scale)
    d = QK_WIDE_HEAD_DIM
    with ctx.case(f"head_dim {d}, its first {d // 2} lanes {QK_HALF_RATIO:g} times the last "
                  f"{d // 2}'s magnitude, gains"):
        # rounded to 2 decimals: the recipe the record prints stays short
        lanes = np.where(np.arange(d) < d // 2, QK_HALF_RATIO, 1.0)
        q, k = ArraySpec((1, 2, d), ctx.seed), ArraySpec((1, 3, d), ctx.seed + 1)
        qk_scores_case(ctx, q=Literal.of(np.round(q.values64() * lanes, 2)),
                       k=Literal.of(np.round(k.values64() * lanes, 2)),
                       q_weight=ArraySpec((d,), ctx.seed + 2, 1.0, 0.5),
                       k_weight=ArraySpec((d,), ctx.seed + 3, 1.0, 0.5))
