"""The oracle against every claim of claims.md that it can show alone, with the
document's numbers written out literally. Test names carry the claim id."""

import normspec.spec as s
import numpy as np
import pytest


def assert_close(expected, actual, rtol=1e-7, atol=1e-7):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def test_E1_layer_norm_and_rms_norm_of_1_3():
    x = np.array([1.0, 3.0])
    assert_close([-1.0, 1.0], s.layer_norm(x, (2,), eps=0.0))
    assert_close([0.4472136, 1.3416408], s.rms_norm(x, (2,), eps=0.0))


def test_E2_shift_by_10_keeps_layer_norm_but_not_rms_norm():
    x = np.array([11.0, 13.0])
    assert_close([-1.0, 1.0], s.layer_norm(x, (2,), eps=0.0))
    assert_close([0.9135003, 1.0795912], s.rms_norm(x, (2,), eps=0.0))
    assert_close(np.array([11.0, 13.0]) / np.sqrt(145.0), s.rms_norm(x, (2,), eps=0.0))


def test_E3_batch_norm_train_then_eval_on_the_same_batch():
    x = np.array([[1.0], [3.0]])
    y, rm, rv = s.batch_norm_train(x, np.zeros(1), np.ones(1), momentum=1.0, eps=0.0)
    assert_close([[-1.0], [1.0]], y)
    assert_close([2.0], rm)
    assert_close([2.0], rv)  # unbiased: ((1-2)^2 + (3-2)^2) / (m - 1), m = 2
    y_eval = s.batch_norm_eval(x, rm, rv, eps=0.0)
    assert_close([[-0.7071068], [0.7071068]], y_eval)


def test_E4_B7_gradient_accumulation_is_not_one_big_batch():
    full = np.array([[0.0], [2.0], [10.0], [12.0]])
    y, rm, rv = s.batch_norm_train(full, np.zeros(1), np.ones(1), momentum=0.1, eps=0.0)
    assert_close([0.6], rm)
    assert_close([4.3666667], rv)
    assert_close([0.9 + 0.1 * 104 / 3], rv)
    assert_close([[-1.1766968], [-0.7844645], [0.7844645], [1.1766968]], y)

    y1, rm1, rv1 = s.batch_norm_train(full[:2], np.zeros(1), np.ones(1), momentum=0.1, eps=0.0)
    assert_close([0.1], rm1)
    assert_close([1.1], rv1)
    y2, rm2, rv2 = s.batch_norm_train(full[2:], rm1, rv1, momentum=0.1, eps=0.0)
    assert_close([1.19], rm2)
    assert_close([1.19], rv2)
    assert_close([[-1.0], [1.0]], y1)
    assert_close([[-1.0], [1.0]], y2)
    assert not np.allclose(y, np.concatenate([y1, y2]))


def test_E4_B7_gradients_of_a_loss_differ_between_full_and_micro_batches():
    full = np.array([[0.0], [2.0], [10.0], [12.0]])
    g = np.array([[1.0], [0.0], [0.0], [2.0]])  # dL/dy of L = sum(g * y)
    w, b = np.array([1.5]), np.array([0.25])
    gx, gw, gb = s.batch_norm_train_vjp(full, g, w, b, eps=0.0)
    parts = [s.batch_norm_train_vjp(full[i:i + 2], g[i:i + 2], w, b, eps=0.0) for i in (0, 2)]
    assert_close(gb, parts[0][2] + parts[1][2])  # dL/dbeta is a plain sum: it does agree
    assert not np.allclose(gx, np.concatenate([parts[0][0], parts[1][0]]))
    assert not np.allclose(gw, parts[0][1] + parts[1][1])


def test_E5_softmax_turns_nearly_one_hot_when_projections_grow():
    q, keys = np.array([2.0, 1.0]), np.array([[1.0, 0.0], [0.0, 1.0]])
    assert_close([2.0, 1.0], keys @ q)
    assert_close([0.7310586, 0.2689414], s.softmax(keys @ q))
    q3, keys3 = 3 * q, 3 * keys
    assert_close([18.0, 9.0], keys3 @ q3)
    assert_close([0.99987661, 0.00012339], s.softmax(keys3 @ q3), atol=1e-8)


def test_E6_qk_norm_removes_the_growth():
    assert_close([1.2649111, 0.6324555], s.rms_norm(np.array([6.0, 3.0]), (2,), eps=0.0))
    assert_close(s.rms_norm(np.array([2.0, 1.0]), (2,), eps=0.0),
                 s.rms_norm(np.array([6.0, 3.0]), (2,), eps=0.0), rtol=1e-15)
    q, k = np.array([[[2.0, 1.0]]]), np.array([[[1.0, 0.0], [0.0, 1.0]]])
    assert_close(s.qk_norm_scores(q, k, eps=0.0), s.qk_norm_scores(3 * q, 3 * k, eps=0.0),
                 rtol=1e-15)


def test_E7_qk_norm_bound_for_head_dim_128():
    assert_close(11.3137085, np.sqrt(128))
    q = np.full((1, 1, 128), 0.37)
    k = np.full((1, 1, 128), 42.0)  # parallel to q: the bound is reached
    score = s.qk_norm_scores(q, k, eps=0.0)
    assert_close([[[11.3137085]]], score)
    assert_close([[[-11.3137085]]], s.qk_norm_scores(q, -k, eps=0.0))


def test_E7_learned_gains_raise_the_bound():
    q = np.full((1, 1, 4), 1.0)
    gain = np.full(4, 2.0)
    assert_close([[[2.0]]], s.qk_norm_scores(q, q, eps=0.0))  # sqrt(4)
    assert_close([[[8.0]]], s.qk_norm_scores(q, q, q_weight=gain, k_weight=gain, eps=0.0))


def test_E8_rope_keeps_lengths_so_the_bound_holds_before_or_after_it():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(2, 6, 16)) * 50
    rotated = s.rope(x, np.arange(6))
    assert_close(np.linalg.norm(x, axis=-1), np.linalg.norm(rotated, axis=-1), rtol=1e-12)
    q, k = x[:1], x[1:]
    before = s.qk_norm_scores(s.rope(q, np.arange(6)), s.rope(k, np.arange(6)), eps=0.0)
    after = s.qk_norm_scores(q, k, eps=0.0)  # same bound either way
    assert np.all(np.abs(before) <= np.sqrt(16) * (1 + 1e-12))
    assert np.all(np.abs(after) <= np.sqrt(16) * (1 + 1e-12))
    assert_close(s.rope(x, np.zeros(6)), x)  # position 0 is the identity rotation


def test_F1_batch_norm_statistics_run_over_N_and_every_L_axis():
    x = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4) ** 1.5
    y, _, _ = s.batch_norm_train(x, None, None, eps=0.0)
    per_channel = np.moveaxis(x, 1, 0).reshape(3, -1)
    mu, var = per_channel.mean(axis=1), per_channel.var(axis=1)
    assert_close((x - mu[None, :, None]) / np.sqrt(var[None, :, None]), y)


def test_F2_layer_norm_eps_is_inside_the_sqrt_and_variance_is_biased():
    x = np.array([1.0, 3.0])
    assert_close([-1 / np.sqrt(1.5), 1 / np.sqrt(1.5)], s.layer_norm(x, (2,), eps=0.5))
    gamma, beta = np.array([2.0, 3.0]), np.array([0.5, -0.5])
    assert_close([-1.5, 2.5], s.layer_norm(x, (2,), gamma, beta, eps=0.0))


def test_F3_rms_norm_uses_the_raw_second_moment():
    x = np.array([11.0, 13.0])
    assert_close(x / np.sqrt((121 + 169) / 2 + 1.0), s.rms_norm(x, (2,), eps=1.0))
    assert_close(2 * x / np.sqrt(145.0), s.rms_norm(x, (2,), np.array([2.0, 2.0]), eps=0.0))


def test_F4_running_variance_is_unbiased_and_momentum_weights_the_new_batch():
    x = np.array([[1.0], [2.0], [6.0]])  # mean 3, sum of squares 14
    _, rm, rv = s.batch_norm_train(x, np.array([10.0]), np.array([5.0]), momentum=0.25)
    assert_close([0.75 * 10 + 0.25 * 3], rm)
    assert_close([0.75 * 5 + 0.25 * 14 / 2], rv)


def test_F4_momentum_none_is_a_cumulative_average():
    batches = [np.array([[1.0], [3.0]]), np.array([[5.0], [9.0]]), np.array([[0.0], [4.0]])]
    rm, rv = np.zeros(1), np.ones(1)
    for t, x in enumerate(batches):
        _, rm, rv = s.batch_norm_train(x, rm, rv, momentum=None, num_batches_tracked=t)
    assert_close([(2 + 7 + 2) / 3], rm)
    assert_close([(2 + 8 + 8) / 3], rv)


def test_F5_eval_uses_running_stats_or_batch_stats_without_tracking():
    x = np.array([[1.0], [3.0]])
    assert_close([[0.0], [1.0]], s.batch_norm_eval(x, np.array([1.0]), np.array([4.0]), eps=0.0))
    assert_close([[-1.0], [1.0]], s.batch_norm_eval(x, None, None, eps=0.0))


def test_F6_qk_norm_scores_are_normalized_dot_products_over_sqrt_dk():
    rng = np.random.default_rng(6)
    q, k = rng.normal(size=(2, 3, 5, 8)), rng.normal(size=(2, 3, 4, 8))
    qw, kw = rng.normal(size=8), rng.normal(size=8)
    q_hat = q / np.sqrt((q * q).mean(-1, keepdims=True) + 1e-6) * qw
    k_hat = k / np.sqrt((k * k).mean(-1, keepdims=True) + 1e-6) * kw
    expected = np.einsum("bhqd,bhkd->bhqk", q_hat, k_hat) / np.sqrt(8)
    assert_close(expected, s.qk_norm_scores(q, k, qw, kw, eps=1e-6), rtol=1e-12)


def test_F7_softcap_keeps_scores_inside_the_cap():
    scores = np.array([-1e6, -50.0, 0.0, 3.0, 1e6])
    capped = s.softcap(scores, 30.0)
    assert np.all(np.abs(capped) <= 30.0)
    assert np.all(np.abs(capped[1:-1]) < 30.0)
    assert_close(30 * np.tanh(3 / 30), capped[3])


def test_F8_block_wirings():
    x = np.array([[1.0, 3.0, 2.0]])
    sub = lambda h: 10 * h + 1  # noqa: E731
    ln = lambda h: s.layer_norm(h, (3,), eps=0.0)  # noqa: E731
    assert_close(ln(x + sub(x)), s.post_ln_block(x, sub, ln))
    assert_close(x + sub(ln(x)), s.pre_ln_block(x, sub, ln))
    assert_close(ln(x + sub(ln(x)) + sub(ln(x + sub(ln(x))))),
                 s.pre_ln_stack(x, [sub, sub], ln, ln))
    sandwich = s.sandwich_block(x, sub, ln, ln)
    assert_close(x + ln(sub(ln(x))), sandwich)
    # the identity path survives: the residual x is added back un-normalized
    assert_close(x, sandwich - ln(sub(ln(x))))
    assert not np.allclose(s.post_ln_block(x, sub, ln), sandwich)


def test_B3_a_batch_of_one_cannot_train_but_can_eval():
    with pytest.raises(s.SingleValuePerChannelError, match="more than 1 value per channel"):
        s.batch_norm_train(np.array([[1.0, 2.0, 3.0]]), np.zeros(3), np.ones(3))
    y = s.batch_norm_eval(np.array([[1.0, 2.0, 3.0]]), np.zeros(3), np.ones(3), eps=0.0)
    assert_close([[1.0, 2.0, 3.0]], y)
    x = np.array([[[1.0, 2.0, 4.0]]])  # [1, C=1, L=3]: statistics run across time
    y, _, rv = s.batch_norm_train(x, np.zeros(1), np.ones(1), momentum=1.0, eps=0.0)
    assert_close([np.var([1.0, 2.0, 4.0], ddof=1)], rv)
    assert_close((x - 7 / 3) / np.std([1.0, 2.0, 4.0]), y)


def test_B4_train_and_eval_diverge_on_the_same_batch():
    x = np.array([[0.5, 1.0], [2.0, -1.0], [4.0, 0.0]])
    y_train, rm, rv = s.batch_norm_train(x, np.zeros(2), np.ones(2), momentum=1.0)
    assert not np.allclose(y_train, s.batch_norm_eval(x, rm, rv))


def test_B8_normalized_shape_decides_the_axes():
    rng = np.random.default_rng(88)
    x = rng.normal(size=(2, 5, 4))
    per_token = s.layer_norm(x, (4,))
    mixed = s.layer_norm(x, (5, 4))
    assert_close(per_token[0, 1], s.layer_norm(x[0, 1], (4,)))
    assert_close(mixed[0], s.layer_norm(x[0].reshape(-1), (20,)).reshape(5, 4))
    assert not np.allclose(per_token, mixed)
