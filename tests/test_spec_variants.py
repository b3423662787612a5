"""The catalogue of formula variants: a well-formed table; every variant differs from
the oracle on an ordinary seeded input by far more than rounding; every variant agrees
with its own definition on a tiny input worked by hand (numbers written out)."""

import inspect

import ml_dtypes
import normspec.spec as s
import numpy as np
import pytest
from normspec.spec import variants as sv

IDS = [v.id for v in s.VARIANTS]
BF16 = ml_dtypes.bfloat16


def close(expected, actual, rtol=1e-12, atol=1e-12):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, rtol=rtol, atol=atol)


def test_variant_table_is_well_formed():
    assert len(IDS) == len(set(IDS))
    for v in s.VARIANTS:
        assert v.id.split(".")[0] == {"layer_norm": "ln", "layer_norm_vjp": "ln", "rms_norm": "rms",
                                      "rms_norm_vjp": "rms", "batch_norm_train": "bn",
                                      "batch_norm_train_vjp": "bn"}[v.op], v.id
        op = getattr(s, v.op)
        assert v.description and "\n" not in v.description and len(v.description) <= 90, v.id
        assert v.seen_in.strip(), v.id
        # same positional signature as the op it varies (extra keyword-only precision args)
        want = [p.name for p in inspect.signature(op).parameters.values()
                if p.kind is p.POSITIONAL_OR_KEYWORD]
        for fn in (v.fn, v.reference):
            got = [p.name for p in inspect.signature(fn).parameters.values()
                   if p.kind is p.POSITIONAL_OR_KEYWORD]
            assert got == want, v.id
        assert s.variant(v.id) is v
        assert v in s.variants_for(v.op)
    with pytest.raises(KeyError, match="unknown variant id 'ln.nope'"):
        s.variant("ln.nope")


def ordinary_args(op, rng):
    """A seeded, ordinary input for each op: d = 12 (not a power of two), a mean well
    away from zero, eps 1e-2, gains stored in bfloat16 (as a half-precision model's)."""
    x = rng.normal(size=(4, 12)) * 2 + 300.0
    w = s.round_to(rng.normal(size=12) + 1.0, BF16).astype(np.float64)
    b, g = rng.normal(size=12), rng.normal(size=(4, 12))
    if op == "layer_norm":
        return (x, (12,), w, b, 1e-2)
    if op == "layer_norm_vjp":
        return (x, (12,), g, w, b, 1e-2)
    xr = rng.normal(size=(4, 12)) * 3 + 0.5
    if op == "rms_norm":
        return (xr, (12,), w, 1e-2)
    if op == "rms_norm_vjp":
        return (xr, (12,), g, w, 1e-2)
    xb, c = rng.normal(size=(8, 3)) * 2 + 300.0, 3
    if op == "batch_norm_train":
        return (xb, rng.normal(size=c), rng.uniform(1, 2, c), w[:c], b[:c], 0.1, 1e-2)
    if op == "batch_norm_train_vjp":
        return (xb, rng.normal(size=(8, 3)), w[:c], b[:c], 1e-2)
    raise AssertionError(op)


def flat(out):
    parts = out if isinstance(out, tuple) else (out,)
    return np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in parts if p is not None])


@pytest.mark.parametrize("variant_id", IDS)
def test_variant_differs_from_the_oracle_on_an_ordinary_input(variant_id):
    v = s.variant(variant_id)
    args = ordinary_args(v.op, np.random.default_rng(2024))
    got, want = flat(v.fn(*args)), flat(v.reference(*args))
    assert got.shape == want.shape
    off = np.max(np.abs(got - want)) / np.max(np.abs(want))
    if v.order_only:
        # the spec's own formula summed in another order: off by float32 rounding alone
        assert 0 < off < 1e-4, (variant_id, off)
    else:
        # float64 rounding would be ~1e-15 relative; every variant is off by > 1e-6
        assert off > 1e-6, variant_id
    # and the reference is the oracle op itself unless the variant is about a half dtype
    if v.reference is getattr(s, v.op):
        np.testing.assert_array_equal(want, flat(getattr(s, v.op)(*args)))


def _ln_one_pass_variance():
    # float32: x^2 = 16769025 and 16785409; the second is above 2^24 (spacing 2), a tie,
    # rounds to 16785408; their sum 33554433 rounds (spacing 4) to 33554432, so
    # E[x^2] = 16777216 = 4096^2 = E[x]^2: variance 0 instead of 1
    x = np.array([4095.0, 4097.0])
    close([-2.0, 2.0], sv.ln_one_pass_variance(x, (2,), eps=0.25))  # (x - 4096) / sqrt(0.25)
    close([-1 / np.sqrt(1.25), 1 / np.sqrt(1.25)], s.layer_norm(x, (2,), eps=0.25))
    # in float64 the same input is fine
    close([-1 / np.sqrt(1.25), 1 / np.sqrt(1.25)],
          sv.ln_one_pass_variance(x, (2,), eps=0.25, compute_dtype=np.float64))


def _ln_serial_sum():
    # bfloat16 (spacing 2 at 256): 256 + 1 is a tie and rounds to 256, so the serial sum
    # of [256, 1, 1, 1] is 256: mean 64 (exact 64.75); the squares 192^2 = 36864 and
    # 63^2 = 3969 -> 3968 sum, each addition a tie at spacing 256 rounded to even, to
    # 49152: variance 12288 (exact 12192.1875)
    x = np.array([256.0, 1.0, 1.0, 1.0])
    close((x - 64.0) / np.sqrt(12288.0), sv.ln_serial_sum(x, (4,), eps=0.0, compute_dtype=BF16))
    close((x - 64.75) / np.sqrt(12192.1875), s.layer_norm(x, (4,), eps=0.0))


def _bn_serial_sum():
    x = np.array([[256.0], [1.0], [1.0], [1.0]])  # as _ln_serial_sum, over the batch
    y, _, _ = sv.bn_serial_sum(x, None, None, eps=0.0, compute_dtype=BF16)
    close((x - 64.0) / np.sqrt(12288.0), y)


def _ln_eps_outside_sqrt():
    x = np.array([1.0, 3.0])  # mu 2, var 1
    close([-0.5, 0.5], sv.ln_eps_outside_sqrt(x, (2,), eps=1.0))  # / (1 + 1)
    close([-1 / np.sqrt(2), 1 / np.sqrt(2)], s.layer_norm(x, (2,), eps=1.0))  # / sqrt(1 + 1)
    close([-0.5 * 2 + 1, 0.5 * 3 - 1],
          sv.ln_eps_outside_sqrt(x, (2,), np.array([2.0, 3.0]), np.array([1.0, -1.0]), 1.0))


def _ln_unbiased_std():
    x = np.array([1.0, 3.0])  # sum of squared deviations 2: unbiased std sqrt(2 / 1)
    close([-1 / np.sqrt(2), 1 / np.sqrt(2)], sv.ln_unbiased_std(x, (2,), eps=0.0))
    x3 = np.array([1.0, 2.0, 3.0])  # unbiased std sqrt(2 / 2) = 1, plus eps 1
    close([-0.5, 0.0, 0.5], sv.ln_unbiased_std(x3, (3,), eps=1.0))
    close(np.array([-1.0, 0.0, 1.0]) / np.sqrt(2 / 3 + 1), s.layer_norm(x3, (3,), eps=1.0))
    with pytest.raises(ValueError, match="needs d >= 2"):
        sv.ln_unbiased_std(np.array([[1.0]]), (1,))


def _ln_unbiased_var():
    x3 = np.array([1.0, 2.0, 3.0])  # unbiased variance 2 / 2 = 1, plus eps 1: / sqrt(2)
    close(np.array([-1.0, 0.0, 1.0]) / np.sqrt(2.0), sv.ln_unbiased_var(x3, (3,), eps=1.0))
    close(np.array([-1.0, 0.0, 1.0]) / np.sqrt(2 / 3 + 1), s.layer_norm(x3, (3,), eps=1.0))
    with pytest.raises(ValueError, match="needs d >= 2"):
        sv.ln_unbiased_var(np.array([[1.0]]), (1,))


def _ln_padded_lanes_in_variance():
    x = np.array([1.0, 2.0, 3.0])  # d 3 padded to 4: mu 2, sum (x - mu)^2 = 2, plus 1 * 2^2
    close([-1 / np.sqrt(2), 0.0, 1 / np.sqrt(2)], sv.ln_padded_lanes_in_variance(x, (3,), eps=0.0))
    close([-np.sqrt(1.5), 0.0, np.sqrt(1.5)], s.layer_norm(x, (3,), eps=0.0))  # var 2/3
    x4 = np.array([1.0, 2.0, 3.0, 6.0])  # d = 4 is a power of two: nothing padded
    close(s.layer_norm(x4, (4,), eps=0.0), sv.ln_padded_lanes_in_variance(x4, (4,), eps=0.0))


def _ln_vjp_constant_statistics():
    x, g = np.array([[1.0, 3.0]]), np.array([[1.0, 0.0]])  # r = 1, x_hat = [-1, 1]
    gx, gw, gb = sv.ln_vjp_constant_statistics(x, (2,), g, np.array([2.0, 5.0]), np.zeros(2), eps=0.0)
    close([[2.0, 0.0]], gx)  # gamma g r
    close([-1.0, 0.0], gw)
    close([1.0, 0.0], gb)
    # the oracle: with two values the output is +-gamma whatever x, so dL/dx = 0
    close([[0.0, 0.0]], s.layer_norm_vjp(x, (2,), g, np.array([2.0, 5.0]), np.zeros(2), eps=0.0)[0])


def _rms_centred():
    x = np.array([11.0, 13.0])  # centred: var 1; raw: mean square 145
    close([11.0, 13.0], sv.rms_centred(x, (2,), eps=0.0))
    close([11 / np.sqrt(145), 13 / np.sqrt(145)], s.rms_norm(x, (2,), eps=0.0))


def _rms_one_plus_weight():
    x, w = np.array([1.0, 3.0]), np.array([0.0, 1.0])  # x_hat = [1, 3] / sqrt(5)
    close([1 / np.sqrt(5), 6 / np.sqrt(5)], sv.rms_one_plus_weight(x, (2,), w, eps=0.0))
    close([0.0, 3 / np.sqrt(5)], s.rms_norm(x, (2,), w, eps=0.0))


def _rms_one_plus_weight_in_half():
    # 16.8125 lies halfway between the bfloat16 neighbours 16.75 and 16.875 (spacing
    # 0.125 at 16): ties to even gives 16.75
    x, w = np.array([3.0]), np.array([15.8125])  # x_hat = 1 with eps 0
    close([16.75], sv.rms_one_plus_weight_in_half(x, (1,), w, eps=0.0))
    close([16.8125], sv._rms_one_plus_reference(x, (1,), w, eps=0.0))
    close([16.8125], sv.rms_one_plus_weight_in_half(x, (1,), w, eps=0.0, dtype=np.float32))


def _rms_half_cast_before_weight():
    # x = [1, 5]: x_hat_2 = 5 / sqrt(13) = 1.38675; bfloat16 (spacing 1/128): 1.390625;
    # times 3 = 4.171875 is a tie at spacing 1/32 -> 4.1875. Exact: 3 x_hat_2 = 4.16025
    # rounds once to 4.15625. (x_hat_1 = 0.27735 gives 0.83203125 both ways.)
    x, w = np.array([1.0, 5.0]), np.array([3.0, 3.0])
    got = sv.rms_half_cast_before_weight(x, (2,), w, eps=0.0)
    assert got.dtype == np.dtype(BF16)
    close([0.83203125, 4.1875], got)
    close([0.83203125, 4.15625], sv._rms_rounded_once(x, (2,), w, eps=0.0))


def _rms_sum_of_squares_in_half():
    x = np.array([200.0, 200.0])  # 40000 + 40000 = 80000 > 65504: the float16 sum is inf
    close([0.0, 0.0], sv.rms_sum_of_squares_in_half(x, (2,), eps=0.0))
    close([1.0, 1.0], s.rms_norm(x, (2,), eps=0.0))
    close([1.0, 1.0], sv.rms_sum_of_squares_in_half(x, (2,), eps=0.0, compute_dtype=np.float32))


def _rms_vjp_weight_twice():
    # x = [1, 3], g = [1, 1], gamma = [2, 2], eps 0: r = 1/sqrt(5); the oracle's
    # h = g gamma = [2, 2], mean(h x) = 4, dx = r ([2, 2] - x r^2 4) = r [1.2, -0.4];
    # gamma twice: h = [4, 4], mean(h x) = 8, dx = r [2.4, -0.8]
    x, g, w = np.array([1.0, 3.0]), np.array([1.0, 1.0]), np.array([2.0, 2.0])
    gx, gw = sv.rms_vjp_weight_twice(x, (2,), g, w, eps=0.0)
    close(np.array([2.4, -0.8]) / np.sqrt(5), gx)
    close(np.array([1.2, -0.4]) / np.sqrt(5), s.rms_norm_vjp(x, (2,), g, w, eps=0.0)[0])
    close(np.array([1.0, 3.0]) / np.sqrt(5), gw)  # dgamma is untouched


def _bn_biased_running_var():
    x = np.array([[1.0], [3.0]])  # E3: mean 2, biased var 1, unbiased 2
    y, rm, rv = sv.bn_biased_running_var(x, np.zeros(1), np.ones(1), momentum=1.0, eps=0.0)
    close([[-1.0], [1.0]], y)
    close([2.0], rm)
    close([1.0], rv)  # the oracle stores 2
    _, _, rv = sv.bn_biased_running_var(x, np.zeros(1), np.ones(1), momentum=0.1, eps=0.0)
    close([0.9 * 1 + 0.1 * 1], rv)


def _bn_momentum_on_old():
    x = np.array([[1.0], [3.0]])
    _, rm, rv = sv.bn_momentum_on_old(x, np.zeros(1), np.ones(1), momentum=0.1, eps=0.0)
    close([0.1 * 0 + 0.9 * 2], rm)  # 1.8; the oracle: 0.9 * 0 + 0.1 * 2 = 0.2
    close([0.1 * 1 + 0.9 * 2], rv)  # 1.9; the oracle: 1.1
    _, orm, orv = s.batch_norm_train(x, np.zeros(1), np.ones(1), momentum=0.1, eps=0.0)
    close([0.2], orm)
    close([1.1], orv)


def _bn_one_pass_variance():
    # the column [4095, 4097] of ln.one_pass_variance: float32 variance 0 (true 1)
    x = np.array([[4095.0], [4097.0]])
    y, rm, rv = sv.bn_one_pass_variance(x, np.zeros(1), np.ones(1), momentum=0.1, eps=0.25)
    close([[-2.0], [2.0]], y)
    close([409.6], rm)
    close([0.9], rv)  # 0.9 * 1 + 0.1 * 0; the oracle: 0.9 + 0.1 * 2 = 1.1
    # [12345, 12347, 12349]: in float32 E[x^2] - E[x]^2 comes out negative (true 8/3);
    # unclamped (ln.one_pass_variance) that is NaN, clamped it is 0: y = (x - mu) / sqrt(eps)
    x = np.array([12345.0, 12347.0, 12349.0])
    assert np.all(np.isnan(sv.ln_one_pass_variance(x, (3,), eps=1e-5)))
    y = sv.bn_one_pass_variance(x[:, None], None, None, eps=1e-5)[0]
    close([[-2.0], [0.0], [2.0]], y * np.sqrt(1e-5))


def _bn_vjp_constant_statistics():
    x, g = np.array([[1.0], [3.0]]), np.array([[1.0], [0.0]])  # r = 1, x_hat = [-1, 1]
    gx, gw, gb = sv.bn_vjp_constant_statistics(x, g, np.array([2.0]), np.array([0.0]), eps=0.0)
    close([[2.0], [0.0]], gx)
    close([-1.0], gw)
    close([1.0], gb)
    close([[0.0], [0.0]], s.batch_norm_train_vjp(x, g, np.array([2.0]), np.array([0.0]), eps=0.0)[0])


WORKED = {name[1:].replace("_", ".", 1): fn for name, fn in globals().items()
          if name.startswith(("_ln_", "_rms_", "_bn_")) and callable(fn)}


def test_every_variant_has_a_worked_example():
    assert set(WORKED) == set(IDS)


@pytest.mark.parametrize("variant_id", IDS)
def test_variant_agrees_with_its_definition_on_a_worked_example(variant_id):
    WORKED[variant_id]()


# fmt: off
@pytest.mark.parametrize("call,error,match", [
    (lambda: sv.ln_one_pass_variance(np.ones((2, 3)), (3,), compute_dtype=np.int8), TypeError, "dtype must be one of"),  # noqa: E501
    (lambda: sv.ln_eps_outside_sqrt(np.ones((2, 3)), (4,)), ValueError, r"normalized_shape \(4,\) does not match"),  # noqa: E501
    (lambda: sv.rms_one_plus_weight(np.ones((2, 3)), (3,), np.ones(2)), ValueError, r"weight must have shape \(3,\), got \(2,\)"),  # noqa: E501
    (lambda: sv.rms_sum_of_squares_in_half(np.ones((2, 3)), (3,), eps=-1.0), ValueError, "eps must be finite and >= 0, got -1.0"),  # noqa: E501
    (lambda: sv.rms_vjp_weight_twice(np.ones((2, 3)), (3,), np.ones((3, 3))), ValueError, r"grad_output must have shape \(2, 3\)"),  # noqa: E501
    (lambda: sv.bn_momentum_on_old(np.ones((2, 3)), np.zeros(3), np.ones(3), momentum=None), ValueError, "momentum=None"),  # noqa: E501
    (lambda: sv.bn_biased_running_var(np.ones((1, 3)), np.zeros(3), np.ones(3)), s.SingleValuePerChannelError, "more than 1 value"),  # noqa: E501
    (lambda: sv.bn_one_pass_variance(np.ones((2, 3)), np.zeros(2), np.ones(2)), ValueError, r"running_mean must have shape \(3,\)"),  # noqa: E501
])
# fmt: on
def test_variant_bad_arguments_name_the_bad_value(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("variant_id", IDS)
def test_variants_do_not_mutate_their_inputs(variant_id):
    v = s.variant(variant_id)
    args = ordinary_args(v.op, np.random.default_rng(7))
    before = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    v.fn(*args)
    for a, b in zip(before, args, strict=True):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
