"""Rounding bias (F2, F3; and F1 BatchNorm, F6 QK-norm scores, F8 fused add + norm): the
outputs are the oracle's rounded to the nearest value of the dtype, so their errors have
either sign and average out. A backend that truncates (rounds toward zero) stays within
1 ULP of every element and passes every per-element bound while moving every activation
toward zero; its mean signed error is ~ -1/2 ULP. Every op that writes a normalized
activation is judged: a kernel's encoder is its own (a review found truncating QK-score,
BatchNorm and fused encoders that every other check passed).

LayerNorm's and RMSNorm's dL/dx too (F2, F3): a backward kernel stores its gradients
with an encoder of its own (a red team's float16/bfloat16 backward that truncated them
passed every check; truncating float32 -> bfloat16 stores were reported in ROCm/aiter
#5151 and tenstorrent/tt-metal PR #27171), and a bias in dL/dx moves every update the
same way. It is judged at the compute allowance of the 'gradient' row, whose growth term
bounds dL/dx's compute error as the output row's does the output's, over many rows
(GRAD_SHAPE): the elements of a row share its statistics' error (torch's CPU LayerNorm
keeps mean and 1/std in the half dtype for its backward, which moves a row's dL/dx by up
to half an ULP one way), so on few rows that error, not the rounding, decides the verdict
(torch float16 on 4 rows of 2048: -0.28 against a bound of 0.18, its rows at -0.40,
-0.23, +0.01, -0.50). dL/dgamma and dL/dbeta are not judged: they have one element a
column, and Hoeffding's bound needs thousands to tell a truncation's -1/2 from chance,
over many rows too for the same reason: a case that size takes the Triton interpreter
seconds a dtype. Nor are BatchNorm's and the fused op's gradients: their drivers
(ops/batch_norm.py, ops/fused.py) do not hand back the gradients as they were compared.

LayerNorm's and RMSNorm's outputs are also judged rounded once (_judge_once): the share
of elements off the oracle's rounding, which a second rounding (x_hat rounded to the
dtype, then multiplied by gamma: Hugging Face's LlamaRMSNorm) raises to about a quarter
while staying unbiased and within 1 ULP of every element.

Judged where the compute precision is much finer than the output's (float16 and bfloat16
computed in float32): there the compute error is negligible against an output ULP and a
systematic bias is a rounding bug. The bound is derived in tolerances.py from the number
of elements, with a stated false-alarm probability. In float32 and float64 the compute
precision is the output's, the error carries the algorithm's own bias (about an ULP), and
the record reports the mean without judging it.
"""

from __future__ import annotations

import normspec.spec as spec
import numpy as np
from normspec.impls.protocol import compute_dtype

from ..cases import ArraySpec
from ..context import Unsupported
from ..ops import BatchNormDriver
from ..ops._common import Judged, f64, outputs_like
from ..ops.fused import fused_add_norm_case
from ..ops.qk import qk_scores_case
from ..tolerances import (
    BIAS_FALSE_ALARM,
    BIAS_MIN_MAGNITUDE,
    bias_compute_allowance,
    bound,
    centred_output_scale,
    centring_kappa,
    grad_input_scale,
    rms_output_scale,
    rounded_once_bound,
    rounding_bias_bound,
)
from . import check

SHAPE = (48, 100)  # 4800 elements, about 4400 of them above BIAS_MIN_MAGNITUDE of scale
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}
#: BatchNorm: 10 samples of 480 channels (4800 elements). The elements of one channel
#: share its statistics' error; many channels keep the terms of the mean close to the
#: independent ones Hoeffding's bound assumes (with 48 channels of 100, a backend holding
#: its statistics in bfloat16 passed or failed by the seed)
BN_SHAPE = (10, 480)
#: QK-norm: 4 heads of 32 queries and 32 keys of 64: 4096 scores
QK_SHAPE = (4, 32, 64)
#: LayerNorm's and RMSNorm's dL/dx: 480 rows of 10 (4800 elements, about 3600 judged).
#: Many rows, as BN_SHAPE has many channels: torch's LayerNorm, whose backward uses the
#: mean and 1/std it held in bfloat16, reached 0.95 of the bound over 30 seeds on 48 rows
#: of 100, 0.44 on 480 rows of 10
GRAD_SHAPE = (480, 10)


def signed_steps(got, expected, dtype) -> np.ndarray:
    """sign(ref) (got - round_T(ref)) in representable steps of the dtype: positive away
    from zero, negative toward it."""
    ref = spec.round_to(np.asarray(expected, np.float64), dtype).astype(np.float64)
    g = np.asarray(got).astype(np.float64)
    return np.sign(ref) * np.sign(g - ref) * spec.ulp_distance(g, ref, dtype)


def _kept(got, expected, scale, dtype):
    """(the oracle rounded to the dtype, the elements judged): finite on both sides and
    of at least BIAS_MIN_MAGNITUDE of their scale, where the compute error is negligible
    against the element's ULP."""
    ref = spec.round_to(np.asarray(expected, np.float64), dtype).astype(np.float64)
    keep = np.isfinite(ref) & np.isfinite(np.asarray(got, np.float64)) & \
        (np.abs(ref) >= BIAS_MIN_MAGNITUDE * np.broadcast_to(scale, ref.shape))
    return ref, keep


def judged_steps(got, expected, scale, dtype) -> np.ndarray:
    """The signed steps the bias is judged on, each clipped to +-1 (the range Hoeffding's
    bound assumes). The check and its repro call this one function."""
    keep = _kept(got, expected, scale, dtype)[1]
    return np.clip(signed_steps(got, expected, dtype)[keep], -1.0, 1.0)


def _judge(ctx, judged: Judged, *, code, row="output", got_name="result.output",
           scale_code=None, what="outputs", once=False) -> str:
    """The mean signed error of judged.got against the oracle (`expected` in the repro),
    judged where the compute precision is finer than the output's; returns what the
    record says if it passes. `row`: the tolerance row of the values, `got_name` their
    name in the repro, `scale_code` how the repro computes their scale from its inputs
    (else the scale's values are written into it), `what` the values, as the record
    names them; `once`: judge them rounded once too (_judge_once), on the same steps."""
    got, expected, scale, n, kappa = judged
    ref, keep = _kept(got, expected, scale, ctx.dtype)
    raw = signed_steps(got, expected, ctx.dtype)[keep]
    steps = np.clip(raw, -1.0, 1.0)  # as judged_steps clips them
    count = int(steps.size)
    mean = float(steps.mean()) if count else 0.0
    raw_mean = float(raw.mean()) if count else 0.0
    allowance = bias_compute_allowance(ctx.dtype, n, np.broadcast_to(kappa, ref.shape),
                                       np.broadcast_to(scale, ref.shape), ref, row)[keep]
    limit = rounding_bias_bound(count, float(allowance.mean()) if count else 0.0)
    toward, away = float(np.mean(steps < 0)), float(np.mean(steps > 0))
    named = "" if what == "outputs" else f"{what}: "
    measured = (f"{named}mean signed error {mean:+.3f} ULPs (away from zero, in steps at the element, "
                f"each clipped to +-1; {raw_mean:+.3f} unclipped) over {count} elements of at "
                f"least {BIAS_MIN_MAGNITUDE:g} of their group's scale; {toward:.1%} below the "
                f"oracle's rounding toward zero, {away:.1%} away")
    scale_line = scale_code or (f"scale = np.array({np.asarray(scale, np.float64).tolist()!r})")
    ctx.oracle("from normspec.conformance.checks.rounding import judged_steps", scale_line,
               f"steps = judged_steps({got_name}, expected, scale, {got_name}.dtype)",
               f"print('{named}mean signed error (ULPs, away from zero, as judged):', "
               "steps.mean())")
    if compute_dtype(ctx.dtype) == ctx.dtype:
        return (f"{measured}: reported, not judged ({ctx.dtype.name} is computed in "
                f"{ctx.dtype.name}, so this is the algorithm's error, not a rounding bug)")
    ctx.holds(condition=abs(mean) <= limit, got=measured,
              spec_says=(f"{what} rounded to nearest, whose mean signed error stays within "
                         f"+-{limit:.3f} ULPs over {count} elements (false alarm "
                         f"{BIAS_FALSE_ALARM:g})"),
              call=code)
    said = f"{measured}: unbiased (bound +-{limit:.3f}, false alarm {BIAS_FALSE_ALARM:g})"
    return said + (_judge_once(ctx, raw, allowance, code=code) if once else "")


def _case(ctx, op):
    d = SHAPE[-1]
    with ctx.case(f"{SHAPE[0]} x {d} elements, affine, rounded to {ctx.dtype_name}"):
        x, w = ctx.use(x=ArraySpec(SHAPE, ctx.seed, 0.3, 1.5),
                       weight=ArraySpec((d,), ctx.seed + 1, 1.0, 0.5))
        b = ctx.use(bias=ArraySpec((d,), ctx.seed + 2, 0.0, 0.5)) if op == "layer_norm" else None
        eps = EPS[op]
        params = "weight, bias" if op == "layer_norm" else "weight"
        code = f"result = backend.{op}(x, ({d},), {params}, {eps!r})"
        args = (x, (d,), w, b, eps) if op == "layer_norm" else (x, (d,), w, eps)
        res = ctx.call(code, getattr(ctx.backend, op), *args,
                       outputs_like={"output": (x.shape, x.dtype)})
        e = ctx.effective(eps, "eps")
        x64, w64, b64 = f64(x), f64(w), f64(b)
        if op == "layer_norm":
            expected = spec.layer_norm(x64, (d,), w64, b64, e)
            kappa = centring_kappa(x64, (-1,), e)
            scale = centred_output_scale(spec.layer_norm(x64, (d,), eps=e), np.abs(w64),
                                         np.abs(b64), (-1,))
        else:
            expected = spec.rms_norm(x64, (d,), w64, e)
            kappa = 1.0
            scale = rms_output_scale(spec.rms_norm(x64, (d,), eps=e), np.abs(w64), (-1,))
        ctx.oracle(f"expected = spec.{op}(x, ({d},), {params}, {e!r})",
                   "show(result.output, expected, name='output')")
        # the values themselves, as F2/F3.values judges them (the record's measure)
        ctx.conforms(expected=expected, actual=res.output, scale=scale,
                     bound=bound("output", ctx.dtype, d, kappa), quantity=f"{op}.output",
                     call=code)
        ctx.say(_judge(ctx, Judged(res.output, expected, scale, d, kappa), code=code,
                       once=True))


def _judge_once(ctx, raw, allowance, *, code) -> str:
    """The share of the judged outputs off the oracle's rounding (`raw`: their signed
    steps, `allowance`: their compute allowances, as _judge has them), judged where the
    compute precision is finer than the output's: a kernel that rounds the normalized
    value to the dtype and then multiplies it by gamma in the dtype (Hugging Face's
    LlamaRMSNorm, the catalogue's rms.half_cast_before_weight) rounds twice, stays within
    one ULP of every element and is unbiased, so no other judgement sees it (found by a
    red team: only QK-norm's scores caught it, on one seed), but about a quarter of its
    elements are one step off (tolerances.rounded_once_bound); returns what the record
    says of it."""
    off = raw != 0
    count = int(off.size)
    limit = rounded_once_bound(count, float(np.minimum(allowance, 1.0).mean()) if count else 0.0)
    share = float(off.mean()) if count else 0.0
    measured = f"{share:.2%} of those {count} elements off the oracle's rounding"
    ctx.oracle("print('share off the oracle rounding:', np.mean(judged_steps(result.output, "
               "expected, scale, result.output.dtype) != 0))")
    ctx.holds(condition=share <= limit, got=measured,
              spec_says=(f"outputs rounded to nearest once, from a value computed in "
                         f"{compute_dtype(ctx.dtype).name}: at most {limit:.2%} off (false alarm "
                         f"{BIAS_FALSE_ALARM:g})"), call=code)
    return f"; {measured} (rounded once: at most {limit:.2%})"


def _grad_case(ctx, op):
    """dL/dx of GRAD_SHAPE, judged for bias as the outputs are."""
    d = GRAD_SHAPE[-1]
    with ctx.case(f"dL/dx: {GRAD_SHAPE[0]} x {d} elements, affine, rounded to "
                  f"{ctx.dtype_name}"):
        ctx.require(op, gradient=True)
        x, w, g = ctx.use(x=ArraySpec(GRAD_SHAPE, ctx.seed, 0.3, 1.5),
                          weight=ArraySpec((d,), ctx.seed + 1, 1.0, 0.5),
                          grad=ArraySpec(GRAD_SHAPE, ctx.seed + 3))
        b = ctx.use(bias=ArraySpec((d,), ctx.seed + 2, 0.0, 0.5)) if op == "layer_norm" else None
        eps = EPS[op]
        params = "weight, bias" if op == "layer_norm" else "weight"
        code = f"result = backend.{op}(x, ({d},), {params}, {eps!r}, grad_output=grad)"
        args = (w, b) if op == "layer_norm" else (w,)
        res = ctx.call(code, getattr(ctx.backend, op), x, (d,), *args, eps, g,
                       outputs_like=outputs_like(x, grads=True, param_shape=(d,), weight=True,
                                                 bias=b is not None))
        e = ctx.effective(eps, "eps")
        x64, w64, g64 = f64(x), f64(w), f64(g)
        if op == "layer_norm":
            expected = spec.layer_norm_vjp(x64, (d,), g64, w64, f64(b), e)[0]
            x_hat = spec.layer_norm(x64, (d,), eps=e)
            kappa = centring_kappa(x64, (-1,), e)
            r = 1.0 / np.sqrt(x64.var(axis=-1, keepdims=True) + e)
        else:
            expected = spec.rms_norm_vjp(x64, (d,), g64, w64, e)[0]
            x_hat = spec.rms_norm(x64, (d,), eps=e)
            kappa = 1.0
            r = 1.0 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + e)
        scale = grad_input_scale(r, np.abs(g64 * w64), x_hat, (-1,), centre=op == "layer_norm")
        vjp_args = f"weight, bias, {e!r}" if op == "layer_norm" else f"weight, {e!r}"
        ctx.oracle(f"expected = spec.{op}_vjp(x, ({d},), grad, {vjp_args})[0]",
                   "show(result.grad_input, expected, name='grad_input')")
        # the values themselves, as F2/F3.grad judge them (the record's measure)
        ctx.conforms(expected=expected, actual=res.grad_input, scale=scale,
                     bound=bound("gradient", ctx.dtype, d, kappa), quantity=f"{op}.grad_input",
                     call=code)
        ctx.say(_judge(ctx, Judged(res.grad_input, expected, scale, d, kappa), code=code,
                       row="gradient", got_name="result.grad_input", what="dL/dx"))


@check("F2.rounding_bias", title="LayerNorm outputs and dL/dx are rounded to nearest: no "
       "systematic bias toward (or away from) zero in float16/bfloat16, and outputs rounded "
       "once", ops=("layer_norm",))
def layer_norm_bias(ctx):
    _case(ctx, "layer_norm")
    _grad_case(ctx, "layer_norm")


@check("F3.rounding_bias", title="RMSNorm outputs and dL/dx are rounded to nearest: no "
       "systematic bias toward (or away from) zero in float16/bfloat16, and outputs rounded "
       "once", ops=("rms_norm",))
def rms_norm_bias(ctx):
    _case(ctx, "rms_norm")
    _grad_case(ctx, "rms_norm")


@check("F1.rounding_bias", title="BatchNorm outputs are rounded to nearest: no systematic "
       "bias toward (or away from) zero in float16/bfloat16 (training with and without running "
       "statistics, and eval)", ops=("batch_norm",))
def batch_norm_bias(ctx):
    c = BN_SHAPE[1]
    for track, mode in ((True, "train"), (False, "train"), (True, "eval")):
        what = (f"{mode} forward, {'tracked' if track else 'untracked'}" if mode == "train"
                else "eval forward on the running statistics of a training step")
        with ctx.case(f"{BN_SHAPE[0]} samples of {c} channels, affine, {what}, rounded to "
                      f"{ctx.dtype_name}"):
            ctx.require("batch_norm")
            if not track and not ctx.backend.capabilities.untracked_stats:
                raise Unsupported("capabilities say untracked_stats = False")
            # momentum 1: the running statistics are the batch's; not compared (F4's), so
            # a declared estimator does not make this case a deviation before it is judged
            driver = BatchNormDriver(ctx, c, momentum=1.0, track_running_stats=track,
                                     compare_stats=False,
                                     weight=ArraySpec((c,), ctx.seed + 1, 1.0, 0.5),
                                     bias=ArraySpec((c,), ctx.seed + 2, 0.0, 0.5))
            driver.step("x", ArraySpec(BN_SHAPE, ctx.seed, 0.3, 1.5), mode="train",
                        check_output=mode == "train")
            if mode == "eval":
                driver.set_mode(False)
                driver.step("x_eval", ArraySpec(BN_SHAPE, ctx.seed + 3, 0.3, 1.5), mode="eval")
            ctx.say(_judge(ctx, driver.judged,
                           code=f"result = layer.forward(x{'_eval' * (mode == 'eval')})"))


@check("F6.rounding_bias", title="QK-norm scores are rounded to nearest: no systematic "
       "bias toward (or away from) zero in float16/bfloat16", ops=("qk_norm_scores",))
def qk_scores_bias(ctx):
    d = QK_SHAPE[-1]
    with ctx.case(f"{QK_SHAPE[0]} heads, {QK_SHAPE[1]} queries and keys of {d}, gains, "
                  f"rounded to {ctx.dtype_name}"):
        ctx.require("qk_norm_scores")
        recipes = dict(q=ArraySpec(QK_SHAPE, ctx.seed, 0.3, 1.5),
                       k=ArraySpec(QK_SHAPE, ctx.seed + 1, -0.2, 1.2),
                       q_weight=ArraySpec((d,), ctx.seed + 2, 1.0, 0.3),
                       k_weight=ArraySpec((d,), ctx.seed + 3, 1.0, 0.3))
        eps, s = 1e-6, float(1.0 / np.sqrt(d))
        judged = qk_scores_case(ctx, eps=eps, scale=s, **recipes)
        ctx.say(_judge(ctx, judged, row="scores", got_name="scores",
                       code=f"scores = backend.qk_norm_scores(q, k, q_weight, k_weight, {eps!r}, "
                            f"{s!r})"))


@check("F8.rounding_bias", title="Fused residual add + norm outputs are rounded to nearest: "
       "no systematic bias toward (or away from) zero in float16/bfloat16, in the normalized "
       "output and in the residual written back", ops=("fused_add_norm",))
def fused_bias(ctx):
    d = SHAPE[-1]
    for norm, part in (("layer_norm", "output"), ("rms_norm", "output"),
                       ("layer_norm", "residual")):
        with ctx.case(f"{norm}: {SHAPE[0]} x {d} elements, gamma, the "
                      f"{'residual written back' if part == 'residual' else 'output'} rounded "
                      f"to {ctx.dtype_name}", op="fused_add_norm"):
            ctx.require("fused_add_norm")
            output, residual = fused_add_norm_case(
                ctx, norm=norm, normalized_shape=(d,), eps=EPS[norm],
                x=ArraySpec(SHAPE, ctx.seed, 0.0, 0.5), residual=ArraySpec(SHAPE, ctx.seed + 1,
                                                                          0.3, 1.5),
                weight=ArraySpec((d,), ctx.seed + 2, 1.0, 0.5),
                bias=ArraySpec((d,), ctx.seed + 3, 0.0, 0.5) if norm == "layer_norm" else None)
            code = (f"result = backend.fused_add_norm(x, residual, {norm!r}, ({d},), weight, "
                    f"bias, {EPS[norm]!r})")
            if part == "output":
                ctx.say(_judge(ctx, output, code=code))
            else:
                ctx.say(_judge(ctx, residual, code=code, row="residual_sum",
                               got_name="result.residual",
                               scale_code="scale = np.abs(x.astype(np.float64)) + "
                                          "np.abs(residual.astype(np.float64))"))
