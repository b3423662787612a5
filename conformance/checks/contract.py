"""Contract: the protocol's promises. Output shape and dtype equal the input's and inputs
are never modified (Context.call enforces both on every call of every check; here each
op is driven once on purpose); and the conventions a backend declares are what it does:
running-variance estimator, eps = 0 acceptance, momentum meaning."""

from __future__ import annotations

import normspec.spec as spec
import numpy as np

from ..cases import ArraySpec, Literal
from ..ops import BatchNormDriver, layer_norm_case, qk_scores_case, rms_norm_case
from . import check

#: the ops the protocol checks drive, one case each: a backend offering none of them (a
#: softcap or fused_add_norm alone) has these checks recorded unsupported, not run empty
#: (found by a red team: a correct BatchNorm-only backend failed with "no result")
PROTOCOL_OPS = ("layer_norm", "rms_norm", "qk_norm_scores", "batch_norm")


@check("protocol.shape_dtype_inputs", title="Every op returns arrays of the input's shape and dtype "
       "and leaves its inputs alone", ops=PROTOCOL_OPS)
def shapes(ctx):
    x = ArraySpec((2, 3, 10), ctx.seed, 1.0, 2.0)
    grad = ArraySpec((2, 3, 10), 3)
    for op in PROTOCOL_OPS:
        if op not in ctx.backend.capabilities.ops:
            continue
        with ctx.case(op, op=op):
            ctx.require(op)
            g = grad if ctx.has_gradient(op) else None
            if op == "layer_norm":
                layer_norm_case(ctx, x=x, normalized_shape=(10,), eps=1e-5, grad=g,
                                         weight=ArraySpec((10,), 1, 1.0), bias=ArraySpec((10,), 2))
            elif op == "rms_norm":
                rms_norm_case(ctx, x=x, normalized_shape=(10,), eps=1e-5, grad=g,
                                       weight=ArraySpec((10,), 1, 1.0))
            elif op == "qk_norm_scores":
                qk_scores_case(ctx, q=x, k=ArraySpec((2, 5, 10), 4))
            else:
                driver = BatchNormDriver(ctx, 3)
                driver.step("x", x, mode="train", grad=g)


@check("F4.declared_estimator", title="The declared running-variance estimator is the one "
       "used", ops=("batch_norm",))
def estimator(ctx):
    declared = getattr(ctx.conventions, "running_var_estimator", "unbiased")
    with ctx.case(f"declared {declared!r}"):
        driver = BatchNormDriver(ctx, 1, momentum=1.0, affine=False, compare_stats=False)
        driver.step("x", Literal(values=((1.0,), (3.0,))), mode="train", check_output=False)
        got = float(np.asarray(driver.rv, dtype=np.float64)[0])
        observed = {2.0: "unbiased", 1.0: "biased"}.get(got, f"neither (running_var = {got!r})")
        ctx.holds(condition=observed == declared,
                     got=f"a {observed} estimate (running_var = {got!r} for [[1], [3]])",
                     spec_says=f"the backend declared {declared!r}", call="layer.forward(x)")


@check("F4.momentum_meaning", title="momentum weights the new batch once translated: 0.1 "
       "moves running_mean 10% of the way", ops=("batch_norm",))
def momentum(ctx):
    with ctx.case("momentum 0.1, batch mean 10, running_mean 0"):
        driver = BatchNormDriver(ctx, 1, momentum=0.1, affine=False, compare_stats=False)
        driver.step("x", Literal(values=((9.0,), (11.0,))), mode="train", check_output=False)
        got = float(np.asarray(driver.rm, dtype=np.float64)[0])
        ctx.holds(condition=abs(got - 1.0) < 1e-2,
                     got=f"running_mean = {got!r}" + (" (momentum weights the old value)"
                                                      if abs(got - 9.0) < 1e-2 else ""),
                     spec_says="running_mean = 1.0 (0.9 * 0 + 0.1 * 10; F4)",
                     call="layer.forward(x)")


@check("protocol.eps_zero", title="eps = 0 is accepted or refused as the backend declares",
       ops=PROTOCOL_OPS)
def eps_zero(ctx):
    declared = dict(getattr(ctx.conventions, "eps_zero", {}) or {})
    x = Literal(values=((1.0, 3.0, 2.0), (0.5, -1.0, 4.0)))
    calls = {
        "layer_norm": ("result = backend.layer_norm(x, (3,), None, None, 0.0)",
                       lambda xa: ctx.backend.layer_norm(xa, (3,), None, None, 0.0)),
        "rms_norm": ("result = backend.rms_norm(x, (3,), None, 0.0)",
                     lambda xa: ctx.backend.rms_norm(xa, (3,), None, 0.0)),
        "qk_norm_scores": ("scores = backend.qk_norm_scores(x[None], x[None], None, None, 0.0, "
                           "1.0)", lambda xa: ctx.backend.qk_norm_scores(
                               xa[None], xa[None], None, None, 0.0, 1.0)),
        "batch_norm": (f"result = backend.batch_norm(3, eps=0.0, momentum=0.1, affine=False, "
                       f"track_running_stats=True, dtype={ctx.dtype_name!r}).forward(x)",
                       lambda xa: ctx.backend.batch_norm(
                           3, eps=0.0, momentum=0.1, affine=False, track_running_stats=True,
                           dtype=ctx.dtype).forward(xa)),
    }
    for op, (code, fn) in calls.items():
        if op not in ctx.backend.capabilities.ops:
            continue
        accepts = bool(declared.get(op, True))
        with ctx.case(f"{op} declared {'accepting' if accepts else 'refusing'} eps = 0", op=op):
            ctx.require(op)
            raised = ctx.raises(code, fn, ctx.use(x=x))
            ctx.holds(condition=(raised is None) == accepts,
                         got=f"it raised {raised}" if raised else "it accepted eps = 0",
                         spec_says=("the backend declared it accepts eps = 0" if accepts else
                                    "the backend declared it refuses eps = 0"),
                         call=code)


@check("protocol.parameter_dtype", title="eps is held in the precision the backend declares "
       "(parameter_dtype): float64 rows where float32(eps) moves the output by 1e6 ULPs",
       ops=("layer_norm", "rms_norm"), dtypes=("float64",))
def parameter_dtype(ctx):
    declared = ctx.convention("parameter_dtype") or "float64"
    # var = 1e-5 = eps: the output's relative change from float32(eps) is about 1e-9
    x = Literal(values=((0.0, 2 * 0.0031622776601683794), (1.0, 1.0 + 2 * 0.0031622776601683794)))
    for op in ("layer_norm", "rms_norm"):
        if not ctx.backend.capabilities.supports(op, ctx.dtype_name):
            continue
        with ctx.case(f"{op}, eps = 1e-5, declared {declared}", op=op):
            xa = ctx.use(x=x)
            eps = 1e-5
            if op == "layer_norm":
                code = f"result = backend.layer_norm(x, (2,), None, None, {eps!r})"
                got = ctx.call(code, ctx.backend.layer_norm, xa, (2,), None, None, eps,
                               outputs_like={"output": (xa.shape, xa.dtype)}).output
                at = {p: spec.layer_norm(xa, (2,), eps=float(spec.round_to(eps, p)))
                      for p in ("float32", "float64")}
            else:
                code = f"result = backend.rms_norm(x, (2,), None, {eps!r})"
                got = ctx.call(code, ctx.backend.rms_norm, xa, (2,), None, eps,
                               outputs_like={"output": (xa.shape, xa.dtype)}).output
                at = {p: spec.rms_norm(xa, (2,), eps=float(spec.round_to(eps, p)))
                      for p in ("float32", "float64")}
            errors = {p: float(np.max(np.abs(got - ref) / np.abs(ref).max())) for p, ref in at.items()}
            observed = min(errors, key=errors.get)
            other = max(errors.values())
            # which precision explains the output, decided with a margin; how close the
            # output is to it is the value checks' business (F2, F3), not this one's
            ctx.oracle(*(f"print('{p}:', spec.{op}(x, (2,), eps=float(spec.round_to({eps!r}, "
                         f"'{p}'))), 'got', result.output)" for p in at))
            told = other > 100 * errors[observed]
            # (undecided, it named the closer precision as the match: found by a review,
            # "matches eps held in float32" for an output off by 0.0954 in both)
            got = (f"an output that matches eps held in {observed} (relative error "
                   f"{errors[observed]:.3g}; in the other precision {other:.3g})" if told else
                   "an output that matches eps held in neither precision (relative error "
                   + "; ".join(f"{errors[p]:.3g} with eps in {p}" for p in at) + ")")
            ctx.holds(condition=told and observed == declared, got=got,
                      spec_says=f"the backend declared parameter_dtype = {declared}", call=code)
