"""F6 QK-norm attention scores of the backend against the oracle."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np

from ..tolerances import bound, qk_scores_scale
from ._common import Judged, f64


def qk_scores_case(ctx, *, q, k, q_weight=None, k_weight=None, eps=1e-6, scale=None) -> Judged:
    """Compare the scores; returns them as they were judged, for checks that go on with
    them."""
    qa, ka, qw, kw = ctx.use(q=q, k=k, q_weight=q_weight, k_weight=k_weight)
    d = qa.shape[-1]
    s = float(1.0 / np.sqrt(d)) if scale is None else float(scale)
    code = f"scores = backend.qk_norm_scores(q, k, q_weight, k_weight, {eps!r}, {s!r})"
    out_shape = qa.shape[:-1] + (ka.shape[-2],)
    got = ctx.call(code, ctx.backend.qk_norm_scores, qa, ka, qw, kw, eps, s,
                   outputs_like={"output": (out_shape, qa.dtype)}, bare=True,
                   refusable=eps == 0 and not ctx.accepts_eps_zero("qk_norm_scores"))
    e = ctx.effective(eps, "eps")
    q64, k64 = f64(qa), f64(ka)
    expected = spec.qk_norm_scores(q64, k64, f64(qw), f64(kw), e, s)
    q_hat = spec.rms_norm(q64, (d,), f64(qw), e)
    k_hat = spec.rms_norm(k64, (d,), f64(kw), e)
    ctx.oracle(f"expected = spec.qk_norm_scores(q, k, q_weight, k_weight, {e!r}, {s!r})",
               "show(scores, expected, name='scores')")
    scores_scale = qk_scores_scale(q_hat, k_hat, s)
    ctx.conforms(expected=expected, actual=got, scale=scores_scale,
                 bound=bound("scores", ctx.dtype, d), quantity="qk_norm_scores.output", call=code)
    return Judged(got, expected, scores_scale, d, 1.0)
