"""Bad arguments to the oracle raise errors that name the bad value; inputs are never
mutated."""

import normspec.spec as s
import numpy as np
import pytest

X = np.array([[1.0, 2.0, 4.0], [0.0, -1.0, 3.0]])


# fmt: off
@pytest.mark.parametrize("call,error,match", [
    (lambda: s.layer_norm(X, (3,), eps=-1e-5), ValueError, r"eps must be finite and >= 0, got -1e-05"),
    (lambda: s.layer_norm(X, (4,)), ValueError, r"normalized_shape \(4,\) does not match .*\(2, 3\)"),
    (lambda: s.layer_norm(X, ()), ValueError, "at least one trailing axis"),
    (lambda: s.layer_norm(X, (3,), weight=np.ones(4)), ValueError, r"weight must have shape \(3,\), got \(4,\)"),
    (lambda: s.layer_norm(X.astype(int), (3,)), TypeError, "x must be a floating array.*got dtype int"),
    (lambda: s.rms_norm(X, (3,), eps=float("nan")), ValueError, "eps must be finite"),
    (lambda: s.rms_norm(X, 3, weight=np.ones((1, 3))), ValueError, r"weight must have shape \(3,\), got \(1, 3\)"),
    (lambda: s.batch_norm_train(X, np.zeros(3), np.ones(3), momentum=1.5), ValueError, "momentum must lie in \\[0, 1\\], got 1.5"),
    (lambda: s.batch_norm_train(X, np.zeros(3), None), ValueError, "both be arrays or both be None"),
    (lambda: s.batch_norm_train(X, np.zeros(2), np.ones(2)), ValueError, r"running_mean must have shape \(3,\)"),
    (lambda: s.batch_norm_train(X[0], None, None), ValueError, r"\[N, C, \.\.\.\]"),
    (lambda: s.batch_norm_eval(X, np.zeros(3), np.ones(3), eps=True), TypeError, "eps must be a real number"),
    (lambda: s.batch_norm_eval_vjp(X, X[:1], np.zeros(3), np.ones(3)), ValueError, r"grad_output must have shape \(2, 3\)"),
    (lambda: s.batch_norm_eval_vjp(X, X, np.zeros(3), None), ValueError, "both be arrays or both be None"),
    (lambda: s.qk_norm_scores(X, X), ValueError, "heads, tokens, head_dim"),
    (lambda: s.qk_norm_scores(X[None], X[None, :, :2]), ValueError, "must agree"),
    (lambda: s.softcap(X, 0.0), ValueError, "cap must be a finite number > 0, got 0.0"),
    (lambda: s.rope(np.ones((2, 4)), np.arange(3)), ValueError, r"positions must have shape \(2,\)"),
    (lambda: s.round_to(X, np.int32), TypeError, "dtype must be one of"),
])
# fmt: on
def test_bad_arguments_name_the_bad_value(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_oracle_functions_do_not_mutate_their_inputs():
    x, w, b, g = X.copy(), np.array([1.0, 2.0, 3.0]), np.array([0.1, 0.2, 0.3]), np.ones_like(X)
    rm, rv = np.zeros(3), np.ones(3)
    snapshot = [a.copy() for a in (x, w, b, g, rm, rv)]
    s.layer_norm(x, (3,), w, b)
    s.layer_norm_vjp(x, (3,), g, w, b)
    s.rms_norm(x, (3,), w)
    s.rms_norm_vjp(x, (3,), g, w)
    s.batch_norm_train(x, rm, rv, w, b)
    s.batch_norm_eval(x, rm, rv, w, b)
    s.batch_norm_train_vjp(x, g, w, b)
    s.batch_norm_eval_vjp(x, g, rm, rv, w, b)
    for before, after in zip(snapshot, (x, w, b, g, rm, rv), strict=False):
        np.testing.assert_array_equal(before, after)
