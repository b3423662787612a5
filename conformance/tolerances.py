"""The one tolerance table. Every bound normspec applies is derived here.

Metric. A backend's output in dtype T is compared with the oracle's float64 answer
rounded to T. The error of an element is |got - round_T(ref)| divided by ulp_T(s), the
spacing of T at the *scale* s of the element's group (the largest |ref| of its
normalized row, BatchNorm channel or score row; for reductions such as dL/dgamma the sum
of the magnitudes that were added). Normalization is normwise, not componentwise,
stable: an element near zero inherits the absolute error of its row's statistics, so its
own ULP count is no measure of the kernel's quality; ULPs at the row's scale are.

Bound. round_T of the backend's result and round_T of the oracle's each contribute half
an ULP: `base_ulps` = 1. On top comes the error of computing in the backend's compute
precision u_c (float32 for float16/bfloat16 inputs, T otherwise), in units of T's
roundoff u_T: the steps after the reductions, a fixed count of roundings whatever n
(`fixed`), and the reductions themselves:

    bound = base_ulps + (fixed + growth * kappa * (log2(n) + 1)) * u_c / u_T

`fixed` counts the elementwise steps of the formula, each at most one u_c at the
group's scale (where T is the compute dtype, one fewer per compared result: the last
step's rounding is then the rounding to T that base_ulps counts; for dL/dgamma, a sum,
that last rounding is the sum's own, which growth and base count between them), with a
reciprocal square root counted at 4 u_c (2 ULPs: an approximate rsqrt within the 2 ULPs
CUDA documents for rsqrtf, not only a correctly rounded sqrt and division). They were
once left to the growth term, which at n = 1 (BatchNorm in eval, RMSNorm over d = 1) has
room for two roundings; a correctly rounded float32 chain then reached 0.9998 of the
bound and a kernel with a 1-ULP rsqrt failed 20-30% of eval cases (found by a review with
legitimate kernels).

(log2(n) + 1) is the error growth of a tree or blocked summation of n terms (Higham,
"The accuracy of floating point summation", 1993), what GPU kernels and PyTorch's CPU
kernels do: that is normspec's accuracy bar. A serial sum errs by up to (n - 1) u_c
(typically sqrt(n) u_c), so a kernel that sums a long row in one accumulator or a few
SIMD lanes can miss it at n in the tens of thousands; the record is then a fail whose
diagnosis says so (`ln.serial_sum`, `bn.serial_sum`), not a wrong formula. kappa
is the conditioning of the op on that input: for centring ops (LayerNorm, BatchNorm)
1 + mean|x| / sqrt(var + eps), since the mean's rounding error is shifted onto every
output and divided by the spread; for RMSNorm 1, as sum x^2 has no cancellation. BatchNorm
in eval mode computes no statistics: it shifts by the given running mean, and that shift
(x - running_mean, or a kernel's folded beta - running_mean gamma r) rounds at
|running_mean|, so its kappa is 1 + |running_mean| / sqrt(running_var + eps)
(`shift_kappa`), with n = 1 (no reduction).
Nothing here is loosened to make a backend pass; where a backend misses a bound, the
report says so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from normspec.impls.protocol import compute_dtype, np_dtype
from normspec.spec import ulp
from normspec.spec._reductions import fast_max, fast_mean, fast_var


@dataclass(frozen=True)
class Tolerance:
    quantity: str
    base_ulps: float
    growth: float
    reason: str
    #: compute roundings of the elementwise steps, whatever n (see the module doc)
    fixed: float = 0.0
    #: results rounded to T the row compares (2 for a backend against itself): where T is
    #: the compute dtype, each one's last elementwise step is that rounding, which
    #: base_ulps counts
    rounded: int = 1


#: The steps after a LayerNorm's statistics, in u_c at the row's scale: var + eps (half
#: of one on r), the reciprocal square root (4), x - mean, the product by r, by gamma and
#: the addition of beta (1 each). RMSNorm has one fewer; BatchNorm the same.
NORMALIZE_STEPS = 8.5
#: dL/dx's steps after its two reductions: x_hat as the forward makes it (NORMALIZE_STEPS
#: less gamma and beta: 6.5), h = g gamma, x_hat mean(h x_hat), the two subtractions and
#: the product by r (1 each).
VJP_STEPS = 11.5


TABLE: dict[str, Tolerance] = {t.quantity: t for t in (
    Tolerance("output", 1.0, 2.0,
              "Forward outputs of LayerNorm, RMSNorm and BatchNorm. 1 ULP for the two "
              "roundings to T; 2 * kappa * (log2 n + 1) compute ULPs covers one rounding per "
              "summation level in the mean and in the variance; 8.5 more for the steps after "
              "them (var + eps, rsqrt at 4, x - mean, the products by r and gamma, + beta).",
              fixed=NORMALIZE_STEPS),
    Tolerance("gradient", 1.0, 4.0,
              "dL/dx. The VJP takes two more reductions (mean(h), mean(h x_hat)) on top of "
              "the forward's two: twice the forward's growth; 11.5 for its elementwise steps "
              "(x_hat as the forward makes it, h = g gamma, x_hat mean(h x_hat), two "
              "subtractions, the product by r). Scale: the row's r max|h|.", fixed=VJP_STEPS),
    Tolerance("eval_gradient", 1.0, 0.0,
              "dL/dx of BatchNorm in eval mode with running statistics, gamma g / "
              "sqrt(running_var + eps): an elementwise product, no reduction. Its steps in "
              "compute precision: running_var + eps (half a u_c on the root), the rsqrt (4), "
              "g gamma and the product (1 each), relative to the element; scale: the "
              "channel's largest |dL/dx|.", fixed=6.5),
    Tolerance("param_gradient", 1.0, 4.0,
              "dL/dgamma is a sum over the batch of g x_hat: one more reduction over the "
              "rows, scale = the sum of the magnitudes added; each term carries x_hat's "
              "steps (6.5) and its product (1). n = the terms summed times the values their "
              "statistics reduce over (LayerNorm: rows x d); BatchNorm's: m, its sum and its "
              "statistics reducing over the same m values. kappa = the worst of those "
              "statistics' (every row's for a LayerNorm gain, the channel's own for "
              "BatchNorm's).", fixed=7.5),
    Tolerance("bias_gradient", 1.0, 1.0,
              "dL/dbeta, the sum over the batch of g: the reduction alone, (log2 n + 1) "
              "compute roundings at the sum of |g| (its scale), n = the terms summed (the "
              "rows; BatchNorm's m), with kappa 1: g is an input, "
              "so no step comes before the sum and no statistic of x enters it, in "
              "BatchNorm's training VJP as everywhere."),
    Tolerance("scores", 2.0, 2.0,
              "QK-norm scores: 1 ULP for the two final roundings plus 1 because q_hat and "
              "k_hat are each legitimately stored in T (half an ULP, relative, each) before "
              "the dot product; growth over the d-term dot product; each term q_hat k_hat "
              "carries both RMSNorms' steps (6.5 each: var + eps, rsqrt, the products by r "
              "and gamma), its product and the scale's (1 each): 15. Scale: sum of |terms|.",
              fixed=15.0),
    Tolerance("running_stat", 1.0, 2.0,
              "Running mean/variance after an update: one reduction over m values and the "
              "momentum blend (two roundings), scale = the magnitudes blended, in the "
              "precision the layer computes in (its statistics may be reported finer). The "
              "batch variance's share of the scale has the batch's centring kappa "
              "(running_var_kappa): a variance centred on a rounded mean, or merged from "
              "partial ones (Welford, Chan), errs in proportion to it (found by a review: a "
              "correct chunked-Welford layer failed at 2988 ULPs against 27 on a channel of "
              "mean 1000 and spread 0.01); the mean's kappa is 1."),
    Tolerance("block", 1.0, 1.0,
              "A Transformer encoder layer (F8), output and dL/dx, dropout 0. Every reduction "
              "stage on the path adds at most (log2 n + 1) u_c relative to the magnitudes it "
              "sums (n = max(d_model, dim_feedforward), the largest reduction): growth 1 per "
              "stage, and the stages are counted by the caller (`block_stages`: 10 per layer "
              "forward - in_proj, q k^T, softmax's sum, p v, out_proj, linear1, linear2 and "
              "the two statistics of each of two LayerNorms counted as one stage each, two "
              "per LN -, 2 more for a final LN, twice that for dL/dx). kappa = 1 + sqrt(d_model): "
              "a LayerNorm divides its input's absolute error by the row's spread, and a "
              "row's largest |h - mean| is at most sqrt(d_model - 1) spreads, so a relative "
              "error at the scale of h reaches at most (1 + sqrt(d)) times that at the "
              "output's scale (gain-1 sublayers: the weights are drawn with spread "
              "1/sqrt(fan_in)). Scale: the token's largest |reference|."),
    Tolerance("residual_sum", 1.0, 1.0,
              "The residual a fused add + norm writes back (F8), round_T(x + residual): one "
              "addition, so n = 1 and kappa = 1; a kernel that adds in its compute precision "
              "and rounds that to T errs by one u_c more (growth 1). Scale: |x| + |residual|, "
              "the magnitudes added."),
    Tolerance("fused_gradient", 2.0, 4.0,
              "dL/dx and dL/dresidual of a fused add + norm (F8): the norm's dL/ds (the "
              "'gradient' row: growth 4, its steps 11.5) plus the written-back residual's "
              "upstream gradient g_r. Autograd holds the norm's part in T before adding g_r, "
              "one more rounding in T: base 2. Scale: the norm VJP's scale plus the row's "
              "largest |g_r|.", fixed=VJP_STEPS),
    Tolerance("constant_row", 1.0, 2.0,
              "LayerNorm and BatchNorm outputs on a constant row or channel (every x = c), "
              "computed as the spec writes them, x - mean first: every centred value is the "
              "same rounding delta of the mean, so the variance is delta^2 to within the "
              "growth below (or overflows, and x_hat is 0), and |x_hat| = |delta| / "
              "sqrt(var + eps) <= 1 + 2 (log2 n + 1) u_c whatever delta: y is beta to within "
              "|gamma| that much, allowed per element on top of the base ULP at the row's "
              "scale |gamma| + |beta|. The oracle gives beta; NaN, inf, or 0 where |beta| > "
              "|gamma| fails, and so does a kernel that folds the affine step into x a + "
              "(beta - mean a), a = gamma r, whose x a and mean a swallow beta here."),
    Tolerance("reported_stats", 0.0, 1.0,
              "BatchNorm in eval when the layer reports its running statistics in a dtype "
              "coarser than its compute precision (float16 buffers): it may hold and use "
              "them more precisely (float32 copies), and the oracle has only what it "
              "reports, each within half an ULP of that dtype of what it uses (u_s relative "
              "in its normal range, absolute below it). Per element, added to the eval "
              "bounds: that half ULP of the mean times r |gamma|, and of the variance times "
              "|x_hat gamma| / (2 (var + eps)) (dL/dx: |dL/dx| / (2 (var + eps))), over the "
              "spacing of T at the element's scale; none for a statistic reported in the "
              "compute precision or finer (found by a review: the numpy backend's own "
              "float16 eval failed at 1.5 ULPs against 1.001). A report that overflowed "
              "(inf for a finite held value) is not used: see BatchNormDriver._held."),
    Tolerance("invariance", 2.0, 4.0,
              "Backend against itself on two inputs (B1/B2): both sides carry the output "
              "bound, so base, growth and steps double.", fixed=2 * NORMALIZE_STEPS,
              rounded=2),
)}

_UNIT_ROUNDOFF = {
    np.dtype(np.float16): 2.0**-11,
    np.dtype(ml_dtypes.bfloat16): 2.0**-8,
    np.dtype(np.float32): 2.0**-24,
    np.dtype(np.float64): 2.0**-53,
}


@functools.lru_cache(maxsize=None, typed=True)
def unit_roundoff(dtype) -> float:
    """u of `dtype` (a name, a type or a NumPy dtype). Cached: every comparison's bound
    asks it several times, and np_dtype names the dtype, a few microseconds a call.
    Keyed by type as well as value: np.float16(1.0) == np.float32(1.0), and np.dtype
    takes either for its type."""
    return _UNIT_ROUNDOFF[np_dtype(dtype)]


@functools.lru_cache(maxsize=None, typed=True)
def compute_roundoff(dtype) -> float:
    """u of the precision a conforming kernel computes `dtype` in (compute_dtype)."""
    return unit_roundoff(compute_dtype(dtype))


def bound(quantity: str, dtype, n: int, kappa=1.0, *, compute=None):
    """Allowed error in ULPs of `dtype` at the group's scale (see the module docstring).
    `compute`: the dtype the quantity was computed in, where it is coarser than `dtype`'s
    own compute dtype (a float32 layer's running statistics reported as float64: judged
    at float64's, they failed by 3e8 ULPs at 0.6 float32 ULP; found by a review)."""
    t = TABLE[quantity]
    u_c = compute_roundoff(dtype)
    if compute is not None:
        u_c = max(u_c, compute_roundoff(compute))
    ratio = u_c / unit_roundoff(dtype)
    # where T is the compute dtype, the last step's rounding is the rounding to T that
    # base_ulps counts (found by a review: counted twice)
    steps = t.fixed - t.rounded if t.fixed and ratio == 1.0 else t.fixed
    return t.base_ulps + (steps + t.growth * np.asarray(kappa)
                          * (np.log2(max(n, 1)) + 1.0)) * ratio


def reported_stats_ulps(dtype, scale, *, mean=None, mean_sens=0.0, var=None, var_sens=0.0):
    """TABLE["reported_stats"], per element: ULPs of `dtype` at `scale` a BatchNorm eval
    quantity may be off the oracle's, evaluated at the running statistics `mean` and `var`
    as the layer reports them (arrays of their own dtype), because the layer used more
    precise ones: each within half an ULP of its reported value (u_s relative in the
    reporting dtype's normal range, and absolute, half its smallest spacing, below it: a
    float16 variance of 1e-8 is reported as 0 or 6e-8; found by a review). `mean_sens`
    and `var_sens` are what a unit change of the statistic moves the element by.
    Statistics reported in the compute precision or finer allow nothing."""
    u_c = compute_roundoff(dtype)
    moved = 0.0
    for stat, sens in ((mean, mean_sens), (var, var_sens)):
        if stat is not None and unit_roundoff(stat.dtype) > u_c:
            value = np.asarray(stat, np.float64)
            # (an infinite report is not used at all: BatchNormDriver._held)
            half = np.where(np.isfinite(value), 0.5 * ulp(np.where(np.isfinite(value), value, 0.0),
                                                            np_dtype(stat.dtype)), 0.0)
            moved = moved + half * np.asarray(sens, dtype=np.float64)
    return TABLE["reported_stats"].growth * moved / ulp(scale, np_dtype(dtype))


def constant_row_bound(dtype, n: int, gamma, scale):
    """TABLE["constant_row"] in ULPs of `dtype` at `scale`, per element: the base ULPs plus
    |gamma| (1 + growth (log2 n + 1) u_c) over the spacing of `dtype` at the scale."""
    t = TABLE["constant_row"]
    x_hat = 1.0 + t.growth * (np.log2(max(n, 1)) + 1.0) * compute_roundoff(dtype)
    return t.base_ulps + np.abs(gamma) * x_hat / ulp(scale, np_dtype(dtype))


def block_stages(num_layers: int, final_norm: bool, *, gradient: bool) -> int:
    """The reduction stages of an encoder stack (see TABLE["block"]): 10 per layer, 2
    for a final LayerNorm; the backward pass repeats each, so dL/dx counts twice."""
    stages = 10 * num_layers + (2 if final_norm else 0)
    return 2 * stages if gradient else stages


def block_kappa(d_model: int) -> float:
    """1 + sqrt(d_model): the most a LayerNorm amplifies a relative error (TABLE["block"])."""
    return 1.0 + float(np.sqrt(d_model))


def running_var_kappa(kappa, a, batch_var, scale) -> np.ndarray:
    """The kappa of a running variance's bound (TABLE["running_stat"]): the batch's
    centring kappa on the batch term's share of the scale, a v_u / ((1 - a)|old| + a v_u),
    1 on the rest: the old value is an input, exact, and only the batch variance carries
    the conditioning (found by a review: kappa on the whole scale let a one-pass variance
    of a channel of mean 1000 and spread 0.01 pass at 319,408 ULPs, where the old value
    1 dominated the scale). A constant batch (variance 0) adds nothing."""
    share = np.divide(a * np.asarray(batch_var, np.float64), scale,
                      out=np.zeros(np.broadcast(batch_var, scale).shape), where=scale > 0)
    with np.errstate(invalid="ignore"):
        k = 1.0 + (np.asarray(kappa, np.float64) - 1.0) * share
    return np.where(share > 0, k, 1.0)


@dataclass(frozen=True, eq=False)
class BatchMoments:
    """What the bounds and scales of a BatchNorm step need of its batch, per channel,
    computed once a step: a BatchNorm batch is reduced over its non-contiguous axes, one
    pass of NumPy's inner loop per sample (3.5 ms for the variance of 131072 x 2), and the
    output's kappa, the running statistics' scales and the running variance's bound each
    took these again."""

    #: values a channel
    count: int
    #: the biased variance, keepdims
    var: np.ndarray
    #: mean |x|, keepdims
    mean_abs: np.ndarray
    #: centring_kappa's, keepdims
    kappa: np.ndarray

    def unbiased_var(self) -> np.ndarray:
        """The variance a running estimate stores, flat: v count / (count - 1)."""
        return self.var.reshape(-1) * self.count / max(self.count - 1, 1)


def batch_moments(x64: np.ndarray, axes, eps: float) -> BatchMoments:
    """The BatchMoments of the batch x64 (reduced over `axes`, all but the channel's)."""
    mean_abs = fast_mean(np.abs(x64), axes, keepdims=True)
    var = fast_var(x64, axes, keepdims=True)
    return BatchMoments(x64.size // x64.shape[1], var, mean_abs, _kappa(mean_abs, var, eps))


def running_var_bound(dtype, compute, moments: BatchMoments, a, scale) -> np.ndarray:
    """TABLE["running_stat"] for a running variance of `dtype`, per channel, after a blend
    with weight `a` of a batch (its `moments`) into a layer computing in `compute`'s
    precision, at `scale` (running_stat_scales'): the batch's unbiased variance and
    centring kappa give running_var_kappa."""
    kappa = running_var_kappa(moments.kappa.reshape(-1), a, moments.unbiased_var(), scale)
    return bound("running_stat", dtype, moments.count, kappa, compute=compute)


def running_stat_bound(field: str, dtype, compute, moments: BatchMoments, a,
                       scale) -> np.ndarray | float:
    """The bound of running statistic `field` ("running_mean" or "running_var") of
    `dtype` after a blend as running_var_bound's: the mean's at kappa 1, the variance's
    running_var_bound."""
    if field == "running_mean":
        return bound("running_stat", dtype, moments.count, compute=compute)
    return running_var_bound(dtype, compute, moments, a, scale)


def centring_kappa(x64: np.ndarray, axes, eps: float) -> np.ndarray:
    """1 + mean|x| / sqrt(var + eps) over `axes`, keepdims: how much the mean's rounding
    is amplified by centring and dividing by the spread."""
    return _kappa(fast_mean(np.abs(x64), axes, keepdims=True),
                  fast_var(x64, axes, keepdims=True), eps)


def _kappa(mean_abs, var, eps: float) -> np.ndarray:
    """centring_kappa's formula, from the group's mean |x| and variance."""
    spread = np.sqrt(var + eps)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = 1.0 + mean_abs / spread
    return np.where(np.isfinite(k), k, np.inf)


def shift_kappa(shift: np.ndarray, var: np.ndarray, eps: float) -> np.ndarray:
    """1 + |shift| / sqrt(var + eps): the conditioning of normalizing with given (not
    computed) statistics, BatchNorm in eval mode: the rounding of the shift by `shift`
    (x - running_mean, or a folded bias) is divided by the running spread."""
    with np.errstate(divide="ignore", invalid="ignore"):
        k = 1.0 + np.abs(shift) / np.sqrt(var + eps)
    return np.where(np.isfinite(k), k, np.inf)


# ---------------------------------------------------------------- rounding bias
# A correctly rounded output errs to either side of the oracle: over many elements its
# signed error averages out. One that truncates (rounds toward zero) stays within 1 ULP
# of every element, so no per-element bound sees it, but it moves every activation
# toward zero: its mean signed error is about -1/2 ULP. The bias check measures, per
# element, the signed error away from zero in representable steps of the dtype at the
# element itself, s_i = sign(ref) (got - round_T(ref)) / step, clipped to [-1, 1].
# At the element, not at the row's scale: rounding happens at the element's own spacing,
# and at scale a small element's rounding error would count for almost nothing.

#: The probability that a correctly rounding backend is flagged, per record.
BIAS_FALSE_ALARM = 1e-6
#: Elements smaller than this fraction of their group's scale are left out: there the
#: compute error, which lives at the scale, is not negligible against the element's ULP.
BIAS_MIN_MAGNITUDE = 1.0 / 16.0


def bias_compute_allowance(dtype, n, kappa, scale, values, row: str = "output") -> np.ndarray:
    """Per element, in steps of `dtype` at the element: the most the compute error (the
    output bound's growth term, at the group's scale) can move the rounded result's
    expected value. It bounds E[s_i] for a correct rounding of a value computed with that
    error: a midpoint lies between the computed value and the oracle's with probability
    |difference| / step. Tiny for float16/bfloat16 computed in float32 (u_c / u_T = 2^-13
    or 2^-16); large where the compute precision is the output's (float32, float64), where
    no bias below it can be told from the algorithm's own error. `row`: the table row the
    values' bound comes from ("scores" for QK-norm scores)."""
    growth = bound(row, dtype, n, kappa) - TABLE[row].base_ulps
    return growth * ulp(scale, dtype) / ulp(values, dtype)


def rounding_bias_bound(n: int, allowance: float = 0.0,
                        false_alarm: float = BIAS_FALSE_ALARM) -> float:
    """The largest |mean of s_i| over n independent elements that a correct rounding
    reaches, but with probability `false_alarm`: `allowance` (the mean compute allowance,
    which bounds the mean of E[s_i]) plus Hoeffding's deviation for n independent terms in
    [-1, 1], P(|mean - E mean| >= t) <= 2 exp(-n t^2 / 2), so t = sqrt(2 ln(2/p) / n).
    Elements whose error is exactly 0 (correctly rounded) count as 0 among the n: the
    claim is about the mean over all elements, and dropping them would turn a few
    near-midpoint flips into a large mean. Hoeffding needs no variance, so the bound is
    conservative where most elements are 0, and still ~0.08 for 4000 elements against a
    truncation's ~0.5."""
    if n <= 0:
        return float("inf")
    return float(allowance + np.sqrt(2.0 * np.log(2.0 / false_alarm) / n))


def rounded_once_bound(n: int, allowance: float = 0.0,
                       false_alarm: float = BIAS_FALSE_ALARM) -> float:
    """The largest share of n elements a single correct rounding leaves off the oracle's
    rounding, but with probability `false_alarm`: an element is off only where a midpoint
    of the dtype lies between the computed value and the exact one, which happens with
    probability at most its compute allowance (bias_compute_allowance: |difference| /
    step); `allowance` is their mean, plus Hoeffding's one-sided deviation for n
    independent indicators, P(mean - E mean >= t) <= exp(-2 n t^2), so t = sqrt(ln(1/p) /
    (2 n)). A second rounding (a normalized value rounded to the dtype, then multiplied by
    gamma and rounded again) leaves about a quarter of them off, each by one step: within
    every per-element bound, and unbiased."""
    if n <= 0:
        return float("inf")
    return float(allowance + np.sqrt(np.log(1.0 / false_alarm) / (2.0 * n)))


def table_rows() -> list[dict]:
    return [{"quantity": t.quantity, "base_ulps": t.base_ulps, "fixed": t.fixed,
             "growth": t.growth, "reason": t.reason} for t in TABLE.values()]


# ---------------------------------------------------------------- scales
# The scale each element is measured at: the magnitude of the terms its formula adds up,
# from the oracle's float64 quantities (see the module docstring).

def centred_output_scale(x_hat, gamma, beta, axes) -> np.ndarray:
    """LayerNorm and BatchNorm outputs: max over the group of max(|x_hat|, 1) |gamma| + |beta|.
    max(|x_hat|, 1): the mean's rounding error reaches the output as gamma * delta_mu * r
    even where x_hat is 0 (d = 1, constant rows), so gamma itself bounds the error's scale."""
    return fast_max(np.maximum(np.abs(x_hat), 1.0) * np.abs(gamma) + np.abs(beta), axes,
                    keepdims=True)


def rms_output_scale(x_r, gamma, axes) -> np.ndarray:
    """RMSNorm outputs: max |x / rms| |gamma| over the row (no centring, no shift)."""
    return fast_max(np.abs(x_r) * gamma, axes, keepdims=True)


def grad_input_scale(r, h, x_hat, axes, *, centre: bool) -> np.ndarray:
    """The magnitude of the terms of dL/dx = r (h - mean(h) - x_hat mean(h x_hat)) over
    the normalized `axes` (no mean(h) term for RMSNorm), with h = |g gamma|."""
    terms = fast_max(h, axes, keepdims=True) + fast_max(np.abs(x_hat), axes, keepdims=True) \
        * fast_mean(h * np.abs(x_hat), axes, keepdims=True)
    if centre:
        terms = terms + fast_mean(h, axes, keepdims=True)
    return r * terms


def param_grad_scales(g64, x_hat, sum_axes) -> tuple[np.ndarray, np.ndarray]:
    """dL/dgamma = sum g x_hat and dL/dbeta = sum g over `sum_axes`: the sums of the
    magnitudes added (max(|x_hat|, 1) for the same reason as the output's scale)."""
    return ((np.abs(g64) * np.maximum(np.abs(x_hat), 1.0)).sum(axis=sum_axes),
            np.abs(g64).sum(axis=sum_axes))


def qk_scores_scale(q_hat, k_hat, scale) -> np.ndarray:
    """Each score is a dot product of d products of normalized entries, each carrying
    its own relative error (the RMSNorms', the products'), so its scale is its own sum
    of |terms|: the row's largest let a score of a near-orthogonal key off by 2e-4
    relative pass at 27 ULPs of the row's scale, 1718 of its own (a review)."""
    return np.matmul(np.abs(q_hat), np.swapaxes(np.abs(k_hat), -1, -2)) * abs(scale)


def running_stat_scales(old_rm, old_rv, moments: BatchMoments, a):
    """running_mean and running_var after a blend with weight a of a batch (its
    `moments`): the magnitudes blended, (1 - a)|old| + a |batch statistic| (unbiased
    variance for the latter)."""
    return ((1 - a) * np.abs(old_rm) + a * moments.mean_abs.reshape(-1),
            (1 - a) * np.abs(old_rv) + a * moments.unbiased_var())
