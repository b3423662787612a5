"""The F8 sublayers (self-attention, feed-forward), the encoder layer and the Pre-LN
stack: VJPs against central finite differences, the erf GELU against math.erf, block
VJPs on generic callables, validation, and the forward and input gradient against
torch.nn.TransformerEncoderLayer / TransformerEncoder (skipped visibly without torch)."""

import math

import normspec.spec as s
import numpy as np
import pytest
from test_spec_gradients import assert_vjp, numeric_vjp

E, H, F = 4, 2, 6


def layer_params(rng, e=E, f=F):
    shapes = {"self_attn.in_proj_weight": (3 * e, e), "self_attn.in_proj_bias": (3 * e,),
              "self_attn.out_proj.weight": (e, e), "self_attn.out_proj.bias": (e,),
              "linear1.weight": (f, e), "linear1.bias": (f,), "linear2.weight": (e, f),
              "linear2.bias": (e,), "norm1.weight": (e,), "norm1.bias": (e,),
              "norm2.weight": (e,), "norm2.bias": (e,)}
    params = {k: rng.normal(size=shape) * 0.7 for k, shape in shapes.items()}
    params["norm1.weight"] += 1.0
    params["norm2.weight"] += 1.0
    return params


def check_param_grads(forward, params, g, grads):
    """Every parameter's gradient against finite differences of forward(params)."""
    assert set(grads) == set(params)
    for name, value in params.items():
        def f(v, name=name):
            return forward({**params, name: v})
        assert_vjp(numeric_vjp(f, value, g), grads[name])


def test_normal_cdf_and_gelu_match_math_erf():
    x = np.concatenate([np.linspace(-37, 8, 4001), [0.0, -1e-300, 1e-8]])
    phi = s.normal_cdf(x)
    expected = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x])
    tiny = expected > 0
    np.testing.assert_allclose(phi[tiny], expected[tiny], rtol=2e-13, atol=0)
    np.testing.assert_allclose(s.gelu(x), x * expected, rtol=2e-13, atol=1e-300)
    bulk = np.abs(x) < 1
    np.testing.assert_allclose(phi[bulk], expected[bulk], rtol=2e-15, atol=0)


@pytest.mark.parametrize("heads", [1, 2])
def test_F8_attention_vjp_matches_finite_differences(heads):
    rng = np.random.default_rng(10)
    x, g = rng.normal(size=(2, 3, E)), rng.normal(size=(2, 3, E))
    w = {"in_proj_weight": rng.normal(size=(3 * E, E)), "in_proj_bias": rng.normal(size=3 * E),
         "out_proj_weight": rng.normal(size=(E, E)), "out_proj_bias": rng.normal(size=E)}

    def fwd(p, xv=x):
        return s.multi_head_self_attention(xv, **p, num_heads=heads)

    gx, grads = s.multi_head_self_attention_vjp(x, g, **w, num_heads=heads)
    assert_vjp(numeric_vjp(lambda v: fwd(w, v), x, g), gx)
    check_param_grads(fwd, w, g, grads)


def test_F8_attention_is_softmax_of_scaled_scores_per_head():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(1, 3, E))
    w_in, w_out = rng.normal(size=(3 * E, E)), rng.normal(size=(E, E))
    b_in, b_out = rng.normal(size=3 * E), rng.normal(size=E)
    q, k, v = np.split(x[0] @ w_in.T + b_in, 3, axis=-1)
    heads = []
    for sl in (slice(0, 2), slice(2, 4)):
        p = s.softmax(q[:, sl] @ k[:, sl].T / np.sqrt(2))
        heads.append(p @ v[:, sl])
    expected = np.concatenate(heads, axis=-1) @ w_out.T + b_out
    np.testing.assert_allclose(s.multi_head_self_attention(x, w_in, b_in, w_out, b_out, 2)[0],
                               expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_F8_feed_forward_vjp_matches_finite_differences(activation):
    rng = np.random.default_rng(12)
    x, g = rng.normal(size=(2, 3, E)), rng.normal(size=(2, 3, E))
    w = {"linear1_weight": rng.normal(size=(F, E)), "linear1_bias": rng.normal(size=F),
         "linear2_weight": rng.normal(size=(E, F)), "linear2_bias": rng.normal(size=E)}

    def fwd(p, xv=x):
        return s.feed_forward(xv, **p, activation=activation)

    gx, grads = s.feed_forward_vjp(x, g, **w, activation=activation)
    assert_vjp(numeric_vjp(lambda v: fwd(w, v), x, g), gx)
    check_param_grads(fwd, w, g, grads)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_F8_encoder_layer_vjp_matches_finite_differences(norm_first, activation):
    rng = np.random.default_rng(13)
    x, g, params = rng.normal(size=(2, 3, E)), rng.normal(size=(2, 3, E)), layer_params(rng)
    kw = {"norm_first": norm_first, "activation": activation, "eps": 1e-3}

    def fwd(p, xv=x):
        return s.transformer_encoder_layer(xv, p, H, **kw)

    gx, grads = s.transformer_encoder_layer_vjp(x, g, params, H, **kw)
    assert_vjp(numeric_vjp(lambda v: fwd(params, v), x, g), gx)
    check_param_grads(fwd, params, g, grads)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_ln_stack", "post_ln_stack"])
def test_F8_encoder_stack_with_final_norm_vjp_matches_finite_differences(norm_first):
    rng = np.random.default_rng(14)
    x, g = rng.normal(size=(2, 3, E)), rng.normal(size=(2, 3, E))
    layers = [layer_params(rng), layer_params(rng)]
    final = {"weight": 1 + rng.normal(size=E) * 0.3, "bias": rng.normal(size=E)}
    kw = {"norm_first": norm_first, "activation": "gelu", "eps": 1e-3}

    def fwd(ls, fn=final, xv=x):
        return s.transformer_encoder(xv, ls, H, fn, **kw)

    gx, layer_grads, final_grads = s.transformer_encoder_vjp(x, g, layers, H, final, **kw)
    assert_vjp(numeric_vjp(lambda v: fwd(layers, final, v), x, g), gx)
    for i, params in enumerate(layers):
        def fwd_i(p, i=i):
            return fwd([p if j == i else layers[j] for j in range(len(layers))])
        check_param_grads(fwd_i, params, g, layer_grads[i])
    check_param_grads(lambda p: fwd(layers, p), final, g, final_grads)


def test_F8_pre_ln_encoder_is_the_pre_ln_stack_of_its_sublayers():
    rng = np.random.default_rng(15)
    x, layers = rng.normal(size=(1, 3, E)), [layer_params(rng), layer_params(rng)]
    h = x
    for p in layers:
        h = s.transformer_encoder_layer(h, p, H, norm_first=True)
    expected = s.layer_norm(h, (E,), np.full(E, 2.0), np.zeros(E))
    got = s.transformer_encoder(x, layers, H, {"weight": np.full(E, 2.0), "bias": np.zeros(E)})
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-14)
    # without a final norm the stack is just the layers chained
    np.testing.assert_allclose(s.transformer_encoder(x, layers, H, None), h, rtol=1e-14, atol=1e-14)


def test_F8_generic_block_vjps_on_closed_form_pieces():
    """The block VJPs only chain the pieces' VJPs: check them with F(x) = tanh(x) A and
    an RMSNorm, against finite differences, for all three wirings and the stack."""
    rng = np.random.default_rng(16)
    x, g, a, w = rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), rng.normal(size=(4, 4)), rng.normal(size=4)

    def sub(h):
        return np.tanh(h) @ a

    def sub_vjp(h, gy):
        return (gy @ a.T) * (1 - np.tanh(h) ** 2), np.tanh(h).T @ gy

    def norm(h):
        return s.rms_norm(h, (4,), w, 1e-3)

    def norm_vjp(h, gy):
        return s.rms_norm_vjp(h, (4,), gy, w, 1e-3)

    cases = [
        (lambda v: s.post_ln_block(v, sub, norm), s.post_ln_block_vjp(x, g, sub, sub_vjp, norm, norm_vjp)),
        (lambda v: s.pre_ln_block(v, sub, norm), s.pre_ln_block_vjp(x, g, sub, sub_vjp, norm, norm_vjp)),
        (lambda v: s.sandwich_block(v, sub, norm, norm),
         s.sandwich_block_vjp(x, g, sub, sub_vjp, norm, norm_vjp, norm, norm_vjp)),
        (lambda v: s.pre_ln_stack(v, [sub, sub], norm, norm),
         s.pre_ln_stack_vjp(x, g, [sub, sub], [sub_vjp, sub_vjp], norm, norm_vjp, norm, norm_vjp)),
    ]
    for forward, result in cases:
        assert_vjp(numeric_vjp(forward, x, g), result[0])
    # parameter gradients: dL/dA of the pre-LN block, dL/dw of the post-LN block's norm
    assert_vjp(numeric_vjp(lambda v: s.pre_ln_block(x, lambda h: np.tanh(h) @ v, norm), a, g),
               cases[1][1][1])
    assert_vjp(numeric_vjp(lambda v: s.post_ln_block(x, sub, lambda h: s.rms_norm(h, (4,), v, 1e-3)),
                           w, g), cases[0][1][2])


# fmt: off
@pytest.mark.parametrize("call,error,match", [
    (lambda: s.multi_head_self_attention(np.ones((2, 4)), np.ones((12, 4)), np.ones(12), np.ones((4, 4)), np.ones(4), 2), ValueError, r"x must be \[batch, tokens, d_model\], got shape \(2, 4\)"),  # noqa: E501
    (lambda: s.multi_head_self_attention(np.ones((1, 2, 4)), np.ones((12, 4)), np.ones(12), np.ones((4, 4)), np.ones(4), 3), ValueError, "d_model 4 is not divisible by num_heads 3"),  # noqa: E501
    (lambda: s.multi_head_self_attention(np.ones((1, 2, 4)), np.ones((8, 4)), np.ones(12), np.ones((4, 4)), np.ones(4), 2), ValueError, r"in_proj_weight must have shape \(12, 4\), got \(8, 4\)"),  # noqa: E501
    (lambda: s.multi_head_self_attention(np.ones((1, 2, 4)), np.ones((12, 4)), np.ones(12), np.ones((4, 4)), np.ones(4), 0), ValueError, "num_heads must be a positive integer, got 0"),  # noqa: E501
    (lambda: s.feed_forward(np.ones((1, 2, 4)), np.ones((6, 4)), np.ones(6), np.ones((4, 6)), np.ones(4), "swish"), ValueError, "activation must be one of .*got 'swish'"),  # noqa: E501
    (lambda: s.feed_forward(np.ones((1, 2, 4)), np.ones((6, 3)), np.ones(6), np.ones((4, 6)), np.ones(4)), ValueError, r"linear1_weight must have shape \(dim_feedforward, 4\), got \(6, 3\)"),  # noqa: E501
    (lambda: s.transformer_encoder_layer(np.ones((1, 2, 4)), {"linear1.weight": np.ones((6, 4))}, 2), ValueError, "params is missing"),  # noqa: E501
    (lambda: s.transformer_encoder(np.ones((1, 2, 4)), [], 2), ValueError, "non-empty sequence"),
    (lambda: s.transformer_encoder(np.ones((1, 2, 4)), [layer_params(np.random.default_rng(0))], 2, {"weight": np.ones(4)}), ValueError, "final_norm must be None or a mapping"),  # noqa: E501
])
# fmt: on
def test_F8_bad_arguments_name_the_bad_value(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_F8_sublayers_do_not_mutate_their_inputs():
    rng = np.random.default_rng(17)
    x, g, params = rng.normal(size=(2, 3, E)), rng.normal(size=(2, 3, E)), layer_params(rng)
    before = (x.copy(), g.copy(), {k: v.copy() for k, v in params.items()})
    for nf in (False, True):
        s.transformer_encoder_layer_vjp(x, g, params, H, norm_first=nf, activation="gelu")
        s.transformer_encoder_vjp(x, g, [params], H, {"weight": params["norm1.weight"],
                                                      "bias": params["norm1.bias"]}, norm_first=nf)
    np.testing.assert_array_equal(before[0], x)
    np.testing.assert_array_equal(before[1], g)
    for k, v in params.items():
        np.testing.assert_array_equal(before[2][k], v)


# --- against torch --------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch", reason="torch is not installed: the torch comparison of "
                               "the F8 encoder oracle is skipped")


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_F8_encoder_layer_matches_torch_transformer_encoder_layer(norm_first, activation):
    torch = _torch()
    torch.manual_seed(0)
    e, heads, f = 16, 4, 24
    layer = torch.nn.TransformerEncoderLayer(e, heads, f, dropout=0.0, activation=activation,
                                             batch_first=True, norm_first=norm_first,
                                             layer_norm_eps=1e-5, dtype=torch.float64)
    with torch.no_grad():  # non-trivial LayerNorm parameters, so they matter too
        for norm in (layer.norm1, layer.norm2):
            norm.weight.add_(torch.randn(e, dtype=torch.float64) * 0.3)
            norm.bias.add_(torch.randn(e, dtype=torch.float64) * 0.3)
    params = {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
    rng = np.random.default_rng(20)
    x, g = rng.normal(size=(3, 7, e)), rng.normal(size=(3, 7, e))
    xt = torch.tensor(x, requires_grad=True)
    yt = layer(xt)
    yt.backward(torch.tensor(g))
    y = s.transformer_encoder_layer(x, params, heads, norm_first=norm_first, activation=activation)
    gx, grads = s.transformer_encoder_layer_vjp(x, g, params, heads, norm_first=norm_first,
                                                activation=activation)
    assert _rel(y, yt.detach().numpy()) < 1e-12
    assert _rel(gx, xt.grad.numpy()) < 1e-12
    for name, p in layer.named_parameters():
        assert _rel(grads[name], p.grad.numpy()) < 1e-11, name


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_ln_stack", "post_ln_stack"])
def test_F8_encoder_stack_matches_torch_transformer_encoder_with_final_norm(norm_first):
    torch = _torch()
    torch.manual_seed(1)
    e, heads, f, depth = 16, 4, 32, 3
    layer = torch.nn.TransformerEncoderLayer(e, heads, f, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=norm_first,
                                             dtype=torch.float64)
    final = torch.nn.LayerNorm(e, dtype=torch.float64)
    enc = torch.nn.TransformerEncoder(layer, depth, norm=final, enable_nested_tensor=False)
    with torch.no_grad():  # the clones start identical: make every layer its own
        for p in enc.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    state = {k: v.detach().numpy().copy() for k, v in enc.state_dict().items()}
    layers = [{k[len(f"layers.{i}."):]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
              for i in range(depth)]
    fnorm = {"weight": state["norm.weight"], "bias": state["norm.bias"]}
    rng = np.random.default_rng(21)
    x, g = rng.normal(size=(2, 5, e)), rng.normal(size=(2, 5, e))
    xt = torch.tensor(x, requires_grad=True)
    yt = enc(xt)
    yt.backward(torch.tensor(g))
    kw = {"norm_first": norm_first, "activation": "gelu"}
    y = s.transformer_encoder(x, layers, heads, fnorm, **kw)
    gx, layer_grads, final_grads = s.transformer_encoder_vjp(x, g, layers, heads, fnorm, **kw)
    assert _rel(y, yt.detach().numpy()) < 1e-12
    assert _rel(gx, xt.grad.numpy()) < 1e-12
    grads = {f"layers.{i}.{k}": v for i, lg in enumerate(layer_grads) for k, v in lg.items()}
    grads |= {"norm.weight": final_grads["weight"], "norm.bias": final_grads["bias"]}
    for name, p in enc.named_parameters():
        assert _rel(grads[name], p.grad.numpy()) < 1e-11, name
