"""The QK logit bound (E5-E8, F7): with unit gains |s| <= sqrt(d_k) whatever the scale of
q and k; scaling q or k changes nothing; learned gains move the bound as the oracle says;
RoPE (a rotation) keeps the bound; soft-capping keeps |s| <= cap."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np
from hypothesis import strategies as st

from .. import strategies as ns
from ..cases import ArraySpec, Literal
from ..ops import qk_scores_case
from ..tolerances import bound
from . import check


def _eps(ctx):
    """eps = 0 makes the bound exact; a backend that refuses it is recorded as refusing."""
    return 0.0 if ctx.accepts_eps_zero("qk_norm_scores") else 1e-12


def _largest_magnitude(ctx) -> float:
    """Huge, but representable: float16 tops out at 65504, so 1e3 (4-sigma values 4e3,
    squares far past float16's range) is its 'huge'."""
    return 1e3 if ctx.dtype == np.float16 else 1e6


def _assert_bound(ctx, got, d, limit, what):
    tol = float(bound("scores", ctx.dtype, d)) * float(spec.ulp(np.array([limit]), ctx.dtype)[0])
    worst = float(np.max(np.abs(got.astype(np.float64)))) if got.size else 0.0
    ctx.holds(condition=worst <= limit + tol,
                 got=f"max |s| = {worst!r}",
                 spec_says=f"|s| <= {limit!r} (+ {tol:.3g} for rounding) (E7)",
                 call=ctx.calls[-2] if len(ctx.calls) > 1 else "qk_norm_scores")


@check("E7.bound", title="With unit gains |s| <= sqrt(d_k), for any q and k, huge "
       "projections included", ops=("qk_norm_scores",))
def bound_holds(ctx):
    def body(pair):
        q, k = pair
        got = qk_scores_case(ctx, q=q, k=k, eps=_eps(ctx)).got
        _assert_bound(ctx, got, q.shape[-1], float(np.sqrt(q.shape[-1])), "scores")

    ctx.explore("drawn q, k (magnitudes up to 1e6, 1e3 in float16)",
                ns.qk_pairs(max_magnitude=_largest_magnitude(ctx)), body)
    with ctx.case("q parallel to k, d_k = 128: the bound 11.3137085 is reached"):
        q, k = Literal.of(np.full((1, 1, 128), 0.375)), Literal.of(np.full((1, 2, 128), 48.0))
        got = qk_scores_case(ctx, q=q, k=k, eps=_eps(ctx)).got
        _assert_bound(ctx, got, 128, float(np.sqrt(128)), "scores")


@check("E6.scale_invariance", also=("E5",), title="E5/E6: scaling W_Q and W_K (q = [2,1] -> [6,3], keys "
       "x3) no longer changes the scores", ops=("qk_norm_scores",))
def scale_invariance(ctx):
    q, k = Literal(values=(((2.0, 1.0),),)), Literal(values=(((1.0, 0.0), (0.0, 1.0)),))
    q3, k3 = Literal(values=(((6.0, 3.0),),)), Literal(values=(((3.0, 0.0), (0.0, 3.0)),))
    with ctx.case("E5 q = [2, 1], keys [1, 0], [0, 1], then all x3"):
        plain = qk_scores_case(ctx, q=q, k=k, eps=_eps(ctx)).got
        scaled = qk_scores_case(ctx, q=q3, k=k3, eps=_eps(ctx)).got
        ctx.conforms(expected=plain.astype(np.float64), actual=scaled,
                                       scale=1.0,
                                       bound=bound("invariance", ctx.dtype, 2),
                                       quantity="qk_norm_scores.output", what="scores after x3",
                     call="scaled vs plain")
    for factor in (2.0**-6, 2.0**12):
        with ctx.case(f"drawn q, k; q scaled by {factor:g}"):
            qr, kr = ArraySpec((2, 3, 48), ctx.seed, 0.0, 1.0), ArraySpec((2, 4, 48), ctx.seed + 1)
            plain = qk_scores_case(ctx, q=qr, k=kr, eps=_eps(ctx)).got
            scaled = qk_scores_case(ctx, q=ArraySpec((2, 3, 48), ctx.seed, factor=factor),
                                    k=kr, eps=_eps(ctx)).got
            ctx.conforms(expected=plain.astype(np.float64), actual=scaled,
                                           scale=np.sqrt(48),
                                           bound=bound("invariance", ctx.dtype, 48),
                                           quantity="qk_norm_scores.output", what="scores after scaling q",
                         call="scaled vs plain")


@check("E7.gains", title="Learned gains move the bound as the oracle says", ops=("qk_norm_scores",))
def gains(ctx):
    with ctx.case("q parallel to k, gains 2 and 1.5: s = 3 sqrt(d_k)"):
        d = 16
        q, k = Literal.of(np.full((1, 1, d), 0.5)), Literal.of(np.full((1, 1, d), 7.0))
        qw, kw = Literal.of(np.full(d, 2.0)), Literal.of(np.full(d, 1.5))
        got, expected = qk_scores_case(ctx, q=q, k=k, q_weight=qw, k_weight=kw,
                                       eps=_eps(ctx))[:2]
        ctx.holds(condition=float(np.max(np.abs(got.astype(np.float64)))) > np.sqrt(d),
                     got=f"max |s| = {float(np.max(np.abs(got.astype(np.float64))))!r}",
                     spec_says=f"gains lift the score above sqrt(d_k) = {np.sqrt(d)!r}, to "
                               f"{float(expected.ravel()[0])!r}", call="qk_norm_scores")

    @st.composite
    def with_gains(draw):
        q, k = draw(ns.qk_pairs(max_head_dim=64, max_magnitude=_largest_magnitude(ctx)),
                    label="q, k")
        d = q.shape[-1]
        return (q, k, ArraySpec((d,), draw(ns.seeds, label="q gain seed"), 1.0, 1.0),
                ArraySpec((d,), draw(ns.seeds, label="k gain seed"), 1.0, 1.0))

    def body(c):
        q, k, qw, kw = c
        got = qk_scores_case(ctx, q=q, k=k, q_weight=qw, k_weight=kw, eps=_eps(ctx)).got
        # the oracle's bound with gains: |s| <= |g_q * q_hat| |g_k * k_hat| / sqrt(d)
        d = q.shape[-1]
        qh = spec.rms_norm(ctx.inputs["q"].build(ctx.dtype), (d,), qw.build(ctx.dtype), _eps(ctx))
        kh = spec.rms_norm(ctx.inputs["k"].build(ctx.dtype), (d,), kw.build(ctx.dtype), _eps(ctx))
        limit = float(np.max(np.linalg.norm(qh, axis=-1)) * np.max(np.linalg.norm(kh, axis=-1))
                      / np.sqrt(d))
        _assert_bound(ctx, got, d, limit, "scores with gains")

    ctx.explore("drawn q, k and gains", with_gains(), body)


@check("E8.rope", title="RoPE is a rotation: the bound holds with q and k rotated first",
       ops=("qk_norm_scores",))
def rope_bound(ctx):
    with ctx.case("positions 0..7, d_k = 64, magnitudes 1e3"):
        q64 = spec.rope(ArraySpec((2, 8, 64), ctx.seed, 0.0, 1e3).values64(), np.arange(8))
        k64 = spec.rope(ArraySpec((2, 8, 64), ctx.seed + 1, 0.0, 1e3).values64(), np.arange(8))
        got = qk_scores_case(ctx, q=Literal.of(q64), k=Literal.of(k64), eps=_eps(ctx)).got
        _assert_bound(ctx, got, 64, 8.0, "scores after RoPE")


#: (cap, scores): Gemma 2's two caps, 30 (final logits) and 50 (attention logits), each
#: over scores from far inside to far beyond it, so a backend with its own fixed cap fails.
SOFTCAP_CASES = (
    (30.0, np.concatenate([-np.logspace(4, -2, 9), [0.0], np.logspace(-2, 4, 9)])),
    (50.0, np.concatenate([-np.logspace(3, -3, 7), [0.0], np.logspace(-3, 3, 7)]) * 1.5),
)


@check("F7.softcap", title="Soft-capping c tanh(s / c) keeps every score within the cap",
       ops=("softcap",))
def softcap(ctx):
    for cap, values in SOFTCAP_CASES:
        lo, hi = float(values.min()), float(values.max())
        with ctx.case(f"scores from {lo:g} to {hi:g}, cap {cap:g}"):
            scores = ctx.use(scores=Literal.of(values))
            code = f"capped = backend.softcap(scores, {cap!r})"
            got = ctx.call(code, ctx.backend.softcap, scores, cap,
                           outputs_like={"output": (scores.shape, scores.dtype)}, bare=True)
            expected = spec.softcap(scores.astype(np.float64), cap)
            ctx.oracle(f"show(capped, spec.softcap(scores, {cap!r}), name='capped')")
            ctx.conforms(expected=expected, actual=got, scale=cap,
                         bound=bound("output", ctx.dtype, 1), quantity="softcap.output",
                         call=code)
            # in floating point c tanh(s/c) can round to c itself: <= is what T can promise
            worst = float(np.max(np.abs(got.astype(np.float64))))
            ctx.holds(condition=worst <= cap, got=f"max |capped| = {worst!r}",
                      spec_says=f"|capped| <= {cap:g} (F7)", call=code)
