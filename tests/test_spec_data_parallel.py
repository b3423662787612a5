"""Claim family DP: BatchNorm under data parallelism. Sync BatchNorm on shards is one
BatchNorm on the concatenated batch (forward, running statistics and VJP); local
BatchNorm is the oracle per shard; E4's numbers split over two replicas show that local
and global differ; B3 is a rule on the global count."""

import normspec.spec as s
import numpy as np
import pytest
from test_spec_gradients import assert_vjp, numeric_vjp

SPLITS = {  # replica count -> shard sizes along the batch axis (equal and unequal)
    "R1": [6], "R2_equal": [3, 3], "R2_unequal": [1, 5], "R4_equal": [2, 2, 2, 2],
    "R4_unequal": [3, 1, 0, 4],
}


def split(x, sizes):
    return np.split(x, np.cumsum(sizes)[:-1])


def close(expected, actual, rtol=1e-13, atol=1e-13):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape_tail", [(3,), (3, 4)], ids=["NC", "NCL"])
@pytest.mark.parametrize("sizes", SPLITS.values(), ids=SPLITS.keys())
def test_DP_sync_batch_norm_equals_batch_norm_of_the_concatenated_batch(sizes, shape_tail):
    rng = np.random.default_rng(sum(sizes) * 7 + len(sizes))
    x = rng.normal(size=(sum(sizes), *shape_tail)) * 3 + 50.0  # large mean, unit-ish spread
    g = rng.normal(size=x.shape)
    c = shape_tail[0]
    w, b, rm, rv = rng.normal(size=c), rng.normal(size=c), rng.normal(size=c), rng.uniform(1, 2, c)
    y, new_rm, new_rv = s.batch_norm_train(x, rm, rv, w, b, momentum=0.3, eps=1e-5)
    ys, sync_rm, sync_rv = s.sync_batch_norm_train(split(x, sizes), rm, rv, w, b, momentum=0.3, eps=1e-5)
    close(y, np.concatenate(ys))
    close(new_rm, sync_rm)
    close(new_rv, sync_rv)
    gx, gw, gb = s.batch_norm_train_vjp(x, g, w, b, eps=1e-5)
    gxs, sgw, sgb = s.sync_batch_norm_train_vjp(split(x, sizes), split(g, sizes), w, b, eps=1e-5)
    close(gx, np.concatenate(gxs), atol=1e-12)
    close(gw, sgw, atol=1e-12)
    close(gb, sgb, atol=1e-12)
    _, mgw, mgb = s.sync_batch_norm_train_vjp(split(x, sizes), split(g, sizes), w, b, eps=1e-5,
                                              reduction="mean")
    close(gw / len(sizes), mgw, atol=1e-12)  # what DDP's averaging leaves in .grad
    close(gb / len(sizes), mgb, atol=1e-12)


def test_DP_sync_momentum_none_is_the_cumulative_average_over_the_global_batch():
    x = np.array([[1.0], [3.0], [8.0]])
    _, rm, rv = s.sync_batch_norm_train([x[:1], x[1:]], np.array([9.0]), np.array([9.0]),
                                        momentum=None, num_batches_tracked=1)
    _, erm, erv = s.batch_norm_train(x, np.array([9.0]), np.array([9.0]), momentum=None,
                                     num_batches_tracked=1)
    close(erm, rm)
    close(erv, rv)
    close([(9 + 4) / 2], rm)  # mean 4, unbiased variance 13, a = 1/2
    close([(9 + 13) / 2], rv)


def test_DP_sync_vjp_matches_finite_differences_through_every_shard():
    rng = np.random.default_rng(3)
    sizes = [2, 1, 3]
    x, g = rng.normal(size=(6, 2, 2)) + 1.0, rng.normal(size=(6, 2, 2))
    w, b = rng.normal(size=2), rng.normal(size=2)

    def forward(xv=x, wv=w, bv=b):
        return np.concatenate(s.sync_batch_norm_train(split(xv, sizes), None, None, wv, bv, eps=1e-3)[0])

    gxs, gw, gb = s.sync_batch_norm_train_vjp(split(x, sizes), split(g, sizes), w, b, eps=1e-3)
    assert_vjp(numeric_vjp(lambda v: forward(xv=v), x, g), np.concatenate(gxs))
    assert_vjp(numeric_vjp(lambda v: forward(wv=v), w, g), gw)
    assert_vjp(numeric_vjp(lambda v: forward(bv=v), b, g), gb)


def test_DP_merge_of_shard_statistics_does_not_cancel_at_a_large_mean():
    """The collective sends deviations about each shard's mean, not (sum x, sum x^2):
    at mean 1e9 and spread 1 the naive E[x^2] - E[x]^2 loses every digit in float64."""
    x = 1e9 + np.array([[1.0], [2.0], [3.0], [4.0], [5.0]])
    n, mean, m2 = s.merge_statistics([s.shard_statistics(p) for p in split(x, [2, 0, 3])])
    assert n == 5
    close([1e9 + 3.0], mean, rtol=0, atol=0)
    close([10.0], m2, rtol=1e-15, atol=0)  # (-2)^2 + (-1)^2 + 0 + 1 + 4
    naive = (x * x).sum() / 5 - (x.sum() / 5) ** 2
    assert abs(naive - 2.0) > 1.0  # what the sums-of-powers collective would have produced


@pytest.mark.parametrize("sizes", [[3, 3], [2, 4], [2, 2, 2]], ids=["equal", "unequal", "R3"])
def test_DP_local_batch_norm_is_the_oracle_per_shard(sizes):
    rng = np.random.default_rng(5)
    x, g = rng.normal(size=(6, 3, 2)) * 2 + 1, rng.normal(size=(6, 3, 2))
    w, b = rng.normal(size=3), rng.normal(size=3)
    rms = [rng.normal(size=3) for _ in sizes]
    rvs = [rng.uniform(1, 2, 3) for _ in sizes]
    ys, new_rms, new_rvs = s.local_batch_norm_train(split(x, sizes), rms, rvs, w, b, 0.2, 1e-4)
    gxs, gw, gb = s.local_batch_norm_train_vjp(split(x, sizes), split(g, sizes), w, b, 1e-4)
    _, mgw, mgb = s.local_batch_norm_train_vjp(split(x, sizes), split(g, sizes), w, b, 1e-4,
                                               reduction="mean")
    sum_w, sum_b = 0.0, 0.0
    for r, (xr, gr) in enumerate(zip(split(x, sizes), split(g, sizes), strict=True)):
        y, m, v = s.batch_norm_train(xr, rms[r], rvs[r], w, b, 0.2, 1e-4)
        np.testing.assert_array_equal(y, ys[r])
        np.testing.assert_array_equal(m, new_rms[r])
        np.testing.assert_array_equal(v, new_rvs[r])
        gx, gwr, gbr = s.batch_norm_train_vjp(xr, gr, w, b, 1e-4)
        np.testing.assert_array_equal(gx, gxs[r])
        sum_w, sum_b = sum_w + gwr, sum_b + gbr
    close(sum_w, gw)
    close(sum_b, gb)
    close(sum_w / len(sizes), mgw)
    close(sum_b / len(sizes), mgb)


def test_DP_E4_split_over_two_replicas_local_is_not_global():
    """E4's batch [0, 2, 10, 12], running_mean 0, running_var 1, momentum 0.1, eps 0,
    on two replicas holding [0, 2] and [10, 12]."""
    zero, one = np.zeros(1), np.ones(1)
    shards = [np.array([[0.0], [2.0]]), np.array([[10.0], [12.0]])]
    ys, rms, rvs = s.local_batch_norm_train(shards, [zero, zero], [one, one], momentum=0.1, eps=0.0)
    close([[-1.0], [1.0]], ys[0])
    close([[-1.0], [1.0]], ys[1])
    close([0.1], rms[0])  # 0.9 * 0 + 0.1 * 1
    close([1.1], rms[1])  # 0.9 * 0 + 0.1 * 11: the replicas' buffers now disagree
    close([1.1], rvs[0])  # 0.9 * 1 + 0.1 * 2 (unbiased variance of [0, 2] is 2)
    close([1.1], rvs[1])
    # ... which is neither the global batch nor gradient accumulation (1.19 after both)
    ys, rm, rv = s.sync_batch_norm_train(shards, zero, one, momentum=0.1, eps=0.0)
    close([[-1.1766968], [-0.7844645]], ys[0], rtol=1e-7, atol=1e-7)
    close([[0.7844645], [1.1766968]], ys[1], rtol=1e-7, atol=1e-7)
    close([0.6], rm)
    close([0.9 + 0.1 * 104 / 3], rv)  # 4.3666667, from the global count 4

    # gradients of L = sum(g * y) with g = [1, 0, 0, 2], gamma 1.5, beta 0.25
    g = [np.array([[1.0], [0.0]]), np.array([[0.0], [2.0]])]
    w, b = np.array([1.5]), np.array([0.25])
    gxs, gw, gb = s.local_batch_norm_train_vjp(shards, g, w, b, eps=0.0)
    # two values per shard and eps 0: each shard's output is [-1, 1] whatever x is
    close([[0.0], [0.0]], gxs[0])
    close([[0.0], [0.0]], gxs[1])
    close([1.0], gw)  # sum g x_hat = 1 * (-1) + 2 * 1, summed over replicas
    close([3.0], gb)
    _, gw_mean, gb_mean = s.local_batch_norm_train_vjp(shards, g, w, b, eps=0.0, reduction="mean")
    close([0.5], gw_mean)
    close([1.5], gb_mean)
    gxs, gw, gb = s.sync_batch_norm_train_vjp(shards, g, w, b, eps=0.0)
    close([[0.1753730824], [-0.1527442976]], gxs[0], atol=1e-10)
    close([[-0.2885170065], [0.2658882217]], gxs[1], atol=1e-10)
    close([6 / np.sqrt(26)], gw)  # x_hat = [-6, -4, 4, 6] / sqrt(26): 1.1766968
    close([3.0], gb)  # dL/dbeta is a plain sum: local and global agree on it alone


def test_DP_B3_is_a_rule_on_the_global_count():
    one_each = [np.array([[1.0, 2.0]]), np.array([[3.0, 5.0]])]
    with pytest.raises(s.SingleValuePerChannelError, match="replica 0: expected more than 1 value"):
        s.local_batch_norm_train(one_each, None, None)
    ys, rm, rv = s.sync_batch_norm_train(one_each, np.zeros(2), np.ones(2), momentum=1.0, eps=0.0)
    close([[-1.0, -1.0]], ys[0])
    close([[1.0, 1.0]], ys[1])
    close([2.0, 4.5], rv)  # unbiased from the global count 2
    with pytest.raises(s.SingleValuePerChannelError, match=r"global count of 1 .*\[1, 0\]"):
        s.sync_batch_norm_train([np.array([[1.0, 2.0]]), np.zeros((0, 2))], None, None)
    with pytest.raises(s.SingleValuePerChannelError, match="global count of 1"):
        s.sync_batch_norm_train_vjp([np.array([[1.0, 2.0]])], [np.ones((1, 2))])


# fmt: off
@pytest.mark.parametrize("call,error,match", [
    (lambda: s.sync_batch_norm_train(np.ones((4, 2)), None, None), ValueError, "shards must be a non-empty sequence"),  # noqa: E501
    (lambda: s.sync_batch_norm_train([], None, None), ValueError, "shards must be a non-empty sequence"),
    (lambda: s.sync_batch_norm_train([np.ones((2, 2)), np.ones((2, 3))], None, None), ValueError, r"shards\[1\] has shape \(2, 3\)"),  # noqa: E501
    (lambda: s.sync_batch_norm_train([np.ones((2, 2), dtype=int)], None, None), TypeError, r"shards\[0\] must be a floating array"),  # noqa: E501
    (lambda: s.sync_batch_norm_train([np.ones((2, 2))], np.zeros(3), np.ones(3)), ValueError, r"running_mean must have shape \(2,\)"),  # noqa: E501
    (lambda: s.sync_batch_norm_train([np.ones((2, 2))], None, None, momentum=2.0), ValueError, "momentum must lie in"),  # noqa: E501
    (lambda: s.sync_batch_norm_train_vjp([np.ones((2, 2))], [np.ones((2, 2)), np.ones((2, 2))]), ValueError, "grad_outputs has 2 shards, shards has 1"),  # noqa: E501
    (lambda: s.sync_batch_norm_train_vjp([np.ones((2, 2))], [np.ones((3, 2))]), ValueError, r"grad_outputs\[0\] must have shape \(2, 2\)"),  # noqa: E501
    (lambda: s.sync_batch_norm_train_vjp([np.arange(4.0).reshape(2, 2)], [np.ones((2, 2))], reduction="avg"), ValueError, "reduction must be one of .*got 'avg'"),  # noqa: E501
    (lambda: s.local_batch_norm_train([np.ones((2, 2)), np.zeros((0, 2))]), ValueError, r"shards\[1\] is empty"),  # noqa: E501
    (lambda: s.local_batch_norm_train([np.ones((2, 2))], [np.zeros(2)], None), ValueError, "both be sequences or both be None"),  # noqa: E501
    (lambda: s.local_batch_norm_train([np.ones((2, 2))], [np.zeros(2)] * 2, [np.ones(2)] * 2), ValueError, "running_means has 2 entries for 1 replicas"),  # noqa: E501
])
# fmt: on
def test_DP_bad_arguments_name_the_bad_value(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_DP_functions_do_not_mutate_their_inputs():
    rng = np.random.default_rng(9)
    shards = [rng.normal(size=(3, 2)), rng.normal(size=(2, 2))]
    grads = [rng.normal(size=(3, 2)), rng.normal(size=(2, 2))]
    w, b, rm, rv = rng.normal(size=2), rng.normal(size=2), np.zeros(2), np.ones(2)
    arrays = [*shards, *grads, w, b, rm, rv]
    before = [a.copy() for a in arrays]
    s.local_batch_norm_train(shards, [rm, rm], [rv, rv], w, b)
    s.local_batch_norm_train_vjp(shards, grads, w, b)
    s.sync_batch_norm_train(shards, rm, rv, w, b)
    s.sync_batch_norm_train_vjp(shards, grads, w, b)
    for a, c in zip(before, arrays, strict=True):
        np.testing.assert_array_equal(a, c)
