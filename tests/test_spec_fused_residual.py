"""F8's fused residual add + norm in the oracle: the VJP against finite differences, the
two contracts' shared formula, and that the checks' LayerNorm cases tell the contracts
apart far beyond the bound in float16 and bfloat16 (so the check cannot silently lose
that power), while RMSNorm and the float32/float64 dtypes cannot (as documented)."""

from __future__ import annotations

import sys

import normspec.spec as spec
import numpy as np
import pytest
from normspec.conformance.assertions import error_ulps
from normspec.conformance.cases import ArraySpec
from normspec.conformance.checks import all_checks
from normspec.conformance.ops.fused import _norm_terms
from normspec.conformance.tolerances import bound
from normspec.impls.protocol import FUSED_RESIDUAL_SUMS, np_dtype

# every family registered in FAMILIES order first (importing one family alone would put
# its checks first in the registry, and the report's order with them)
all_checks()
_FAMILY = sys.modules["normspec.conformance.checks.fused_residual"]
layer_norm_cases, rms_norm_cases = _FAMILY.layer_norm_cases, _FAMILY.rms_norm_cases


def test_contract_names_agree():
    assert spec.FUSED_RESIDUAL_SUMS == FUSED_RESIDUAL_SUMS


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_vjp_matches_finite_differences(norm):
    rng = np.random.default_rng(3)
    x, r = rng.normal(size=(2, 5)), rng.normal(3.0, 1.0, size=(2, 5))
    w = rng.normal(1.0, 0.2, size=5)
    b = rng.normal(size=5) if norm == "layer_norm" else None
    gy, gr = rng.normal(size=(2, 5)), rng.normal(size=(2, 5))

    def loss(xv, rv, wv, bv):
        y, res = spec.fused_add_norm(xv, rv, norm, (5,), wv, bv, 1e-3)
        return float((y * gy).sum() + (res * gr).sum())

    gx, gres, gw, gb = spec.fused_add_norm_vjp(x, r, gy, gr, norm, (5,), w, b, 1e-3)
    h = 1e-6
    for k, (got, arg) in enumerate(((gx, x), (gres, r), (gw, w)) + (((gb, b),) if b is not None else ())):
        fd = np.zeros_like(arg)
        for i in np.ndindex(arg.shape):
            args = [x, r, w, b]
            plus, minus = arg.copy(), arg.copy()
            plus[i] += h
            minus[i] -= h
            args[k] = plus
            up = loss(*args)
            args[k] = minus
            fd[i] = (up - loss(*args)) / (2 * h)
        np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-7)


def test_rounded_contract_is_the_norm_of_the_rounded_sum_with_the_same_vjp_formula():
    x = ArraySpec((3, 8), 1, 0.0, 1.0).build("float16")
    r = ArraySpec((3, 8), 2, 200.0, 1.0).build("float16")
    gy, gr = np.ones((3, 8)), np.full((3, 8), 0.5)
    s = x.astype(np.float64) + r.astype(np.float64)
    rounded = spec.round_to(s, np.float16).astype(np.float64)
    for contract, at in (("rounded", rounded), ("float32", s)):
        y, res = spec.fused_add_norm(x, r, "layer_norm", (8,), eps=1e-5, contract=contract)
        np.testing.assert_array_equal(res, rounded)
        np.testing.assert_array_equal(y, spec.layer_norm(at, (8,), eps=1e-5))
        gx = spec.fused_add_norm_vjp(x, r, gy, gr, "layer_norm", (8,), eps=1e-5,
                                     contract=contract)[0]
        np.testing.assert_array_equal(gx, spec.layer_norm_vjp(at, (8,), gy, eps=1e-5)[0] + gr)


def _gap(name, kw, dtype):
    """The largest miss of the other contract's answer, rounded to `dtype`, against the
    declared one's bound (as a multiple of it), for each declared contract."""
    dt = np_dtype(dtype)
    p = tuple(kw["normalized_shape"])
    x = ArraySpec(kw["shape"], kw["seed"], 0.0, kw["update"]).build(dt).astype(np.float64)
    r = ArraySpec(kw["shape"], kw["seed"] + 1, kw["mean"], kw["spread"]).build(dt).astype(np.float64)
    w = ArraySpec(p, kw["seed"] + 2, 1.0, 0.3).build(dt).astype(np.float64) if kw["weight"] else None
    b = ArraySpec(p, kw["seed"] + 3, 0.0, 0.3).build(dt).astype(np.float64) if kw["bias"] else None
    axes = tuple(range(x.ndim - len(p), x.ndim))
    ratios = []
    for declared, other in (("rounded", "float32"), ("float32", "rounded")):
        args = (x, r, kw["norm"], p, w, b, kw["eps"])
        want = spec.fused_add_norm(*args, contract=declared, dtype=dt)[0]
        got = spec.round_to(spec.fused_add_norm(*args, contract=other, dtype=dt)[0], dt)
        s, _ = spec.fused_residual_sum(x, r, contract=declared, dtype=dt)
        _, _, kappa, scale = _norm_terms(kw["norm"], s, p, axes, w, b, kw["eps"])
        err = error_ulps(expected=want, actual=got, dtype=dt, scale=scale)
        ratios.append(float(np.max(err / bound("output", dt, int(np.prod(p)), kappa))))
    return min(ratios)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_layer_norm_cases_tell_the_contracts_apart_in_half_precision(dtype):
    for name, kw in layer_norm_cases(980):
        assert _gap(name, kw, dtype) > 5.0, name


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_contracts_coincide_within_the_bound_in_float32_and_float64(dtype):
    for name, kw in layer_norm_cases(980) + rms_norm_cases(950):
        assert _gap(name, kw, dtype) <= 1.0, name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rms_norm_passes_the_rounding_on_unamplified(dtype):
    """RMSNorm's two contracts differ by about one ULP: within the bound (the check's
    docstring says it cannot tell them apart)."""
    for name, kw in rms_norm_cases(950):
        assert _gap(name, kw, dtype) <= 1.0, name
