"""Real sublayers for the F8 wirings: multi-head self-attention and the feed-forward
network of a Transformer encoder layer, with dropout 0, and the encoder layer and stack
built from them with `blocks` and `layer_norm`. Every function has a VJP that returns
the input gradient and the gradient of every parameter.

Layout and parameter names follow torch.nn.TransformerEncoderLayer(batch_first=True,
bias=True) so that weights can be shared by name: x is [B, T, E]; a linear layer's
weight is [out, in] and computes x W^T + b; attention packs the q, k, v projections in
`in_proj_weight` [3E, E] and `in_proj_bias` [3E], in that order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ._validate import as_float64, check_eps, check_param_shape, check_same_shape, ieee
from .blocks import (
    post_ln_block,
    post_ln_block_vjp,
    pre_ln_block,
    pre_ln_block_vjp,
    pre_ln_stack,
    pre_ln_stack_vjp,
)
from .layer_norm import layer_norm, layer_norm_vjp

ACTIVATIONS = ("relu", "gelu")

#: Parameter names of one encoder layer (torch's state_dict names) and their shapes,
#: given E = d_model and F = dim_feedforward.
ENCODER_LAYER_PARAMS = (
    "self_attn.in_proj_weight", "self_attn.in_proj_bias",
    "self_attn.out_proj.weight", "self_attn.out_proj.bias",
    "linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias",
    "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
)


# --- the exact (erf) GELU -------------------------------------------------------------
# NumPy has no erf and the oracle may not import math or scipy, so the normal CDF is
# evaluated here: a positive-term series for erf on [0, 1) (no cancellation), and the
# Laplace continued fraction for erfc on [1, inf), evaluated from the tail backwards.
# Measured against math.erf / math.erfc: relative error below 2e-13 everywhere, ~1e-15
# for |x| < 1 (see tests/test_spec_transformer.py).

_SERIES_TERMS = 160
_FRACTION_TERMS = 400


def _erf_series(a):
    """erf(a) = 2/sqrt(pi) exp(-a^2) sum_n a (2a^2)^n / (1*3*...*(2n+1)), a >= 0."""
    term, total, two_a2 = a.copy(), a.copy(), 2.0 * a * a
    for n in range(_SERIES_TERMS):
        term = term * two_a2 / (2 * n + 3)
        total = total + term
    return 2.0 / np.sqrt(np.pi) * np.exp(-a * a) * total


def _erfc_fraction(a):
    """erfc(a) = exp(-a^2)/sqrt(pi) / (a + (1/2)/(a + 1/(a + (3/2)/(a + ...)))), a >= 1."""
    f = a.copy()
    for k in range(_FRACTION_TERMS, 0, -1):
        f = a + (k / 2.0) / f
    return np.exp(-a * a) / (np.sqrt(np.pi) * f)


def _erfc(z):
    """erfc for any real z, each branch chosen so nothing cancels badly."""
    a = np.abs(z)
    small = a < 1.0
    a_small, a_large = np.where(small, a, 0.0), np.where(small, 1.0, a)
    erf_small, erfc_large = _erf_series(a_small), _erfc_fraction(a_large)
    positive = np.where(small, 1.0 - erf_small, erfc_large)  # erfc(|z|)
    return np.where(z >= 0, positive, 2.0 - positive)


def normal_cdf(x):
    """Phi(x) = erfc(-x / sqrt(2)) / 2, accurate in both tails."""
    x = as_float64("x", x)
    return 0.5 * _erfc(-x / np.sqrt(2.0))


def _normal_pdf(x):
    return np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi)


@ieee
def gelu(x):
    """Exact GELU, gelu(x) = x Phi(x) with Phi the standard normal CDF (not the tanh
    approximation): torch's activation="gelu" in TransformerEncoderLayer."""
    x = as_float64("x", x)
    return x * normal_cdf(x)


def _activation(name, h):
    return np.maximum(h, 0.0) if name == "relu" else h * normal_cdf(h)


def _activation_grad(name, h):
    """relu'(h) = [h > 0] (0 at h = 0, as torch); gelu'(h) = Phi(h) + h phi(h)."""
    if name == "relu":
        return (h > 0).astype(np.float64)
    return normal_cdf(h) + h * _normal_pdf(h)


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


# --- validation -----------------------------------------------------------------------

def _check_tokens(x):
    if x.ndim != 3:
        raise ValueError(f"x must be [batch, tokens, d_model], got shape {tuple(x.shape)}")
    return x.shape[-1]


def _check_heads(num_heads, d_model):
    if not isinstance(num_heads, (int, np.integer)) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if d_model % num_heads:
        raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}")
    return int(num_heads)


def _param(name, value, shape):
    p = as_float64(name, value)
    check_param_shape(name, p, shape)
    return p


def _linear(x, w, b):
    return x @ w.T + b


def _linear_vjp(x, g, w):
    """y = x W^T + b: dx = g W, dW = sum over rows of g^T x, db = sum of g."""
    e_in, e_out = x.shape[-1], g.shape[-1]
    gw = g.reshape(-1, e_out).T @ x.reshape(-1, e_in)
    return g @ w, gw, g.reshape(-1, e_out).sum(axis=0)


# --- multi-head self-attention --------------------------------------------------------

def _split_heads(t, h):
    b, n, e = t.shape
    return t.reshape(b, n, h, e // h).transpose(0, 2, 1, 3)  # [B, H, T, D]


def _merge_heads(t):
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def _attention_params(x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads):
    x = as_float64("x", x)
    e = _check_tokens(x)
    h = _check_heads(num_heads, e)
    return (x, h, _param("in_proj_weight", in_proj_weight, (3 * e, e)),
            _param("in_proj_bias", in_proj_bias, (3 * e,)),
            _param("out_proj_weight", out_proj_weight, (e, e)),
            _param("out_proj_bias", out_proj_bias, (e,)))


def _attention_forward(x, h, w_in, b_in, w_out, b_out):
    e = x.shape[-1]
    qkv = _linear(x, w_in, b_in)
    q, k, v = (_split_heads(qkv[..., i * e:(i + 1) * e], h) for i in range(3))
    scale = 1.0 / np.sqrt(e // h)
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    z = np.exp(s - s.max(axis=-1, keepdims=True))
    p = z / z.sum(axis=-1, keepdims=True)
    o = _merge_heads(p @ v)
    return _linear(o, w_out, b_out), (q, k, v, p, o, scale)


@ieee
def multi_head_self_attention(x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
                              num_heads):
    """Self-attention as torch.nn.MultiheadAttention(batch_first=True) with no mask.

    [q | k | v] = x W_in^T + b_in; each of q, k, v is split into H heads of width
    D = E / H; per head O = softmax(q k^T / sqrt(D)) v (softmax over keys); the heads
    are concatenated back to [B, T, E] and y = O W_out^T + b_out.
    """
    x, h, w_in, b_in, w_out, b_out = _attention_params(
        x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads)
    return _attention_forward(x, h, w_in, b_in, w_out, b_out)[0]


@ieee
def multi_head_self_attention_vjp(x, grad_output, in_proj_weight, in_proj_bias, out_proj_weight,
                                  out_proj_bias, num_heads):
    """Closed-form gradients of `multi_head_self_attention` for g = dL/dy.

    Backwards through each step: dO = g W_out; per head dP = dO v^T, dv = P^T dO, the
    softmax Jacobian dS = P * (dP - rowsum(dP * P)), dq = dS k / sqrt(D),
    dk = dS^T q / sqrt(D); then the packed projection: dx = d[q|k|v] W_in.
    Returns (grad_x, {"in_proj_weight", "in_proj_bias", "out_proj_weight",
    "out_proj_bias"}).
    """
    x, h, w_in, b_in, w_out, b_out = _attention_params(
        x, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, num_heads)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    _, (q, k, v, p, o, scale) = _attention_forward(x, h, w_in, b_in, w_out, b_out)
    g_o, g_w_out, g_b_out = _linear_vjp(o, g, w_out)
    g_oh = _split_heads(g_o, h)
    g_p = g_oh @ np.swapaxes(v, -1, -2)
    g_v = np.swapaxes(p, -1, -2) @ g_oh
    g_s = p * (g_p - (g_p * p).sum(axis=-1, keepdims=True))
    g_q = (g_s @ k) * scale
    g_k = (np.swapaxes(g_s, -1, -2) @ q) * scale
    g_qkv = np.concatenate([_merge_heads(t) for t in (g_q, g_k, g_v)], axis=-1)
    g_x, g_w_in, g_b_in = _linear_vjp(x, g_qkv, w_in)
    return g_x, {"in_proj_weight": g_w_in, "in_proj_bias": g_b_in,
                 "out_proj_weight": g_w_out, "out_proj_bias": g_b_out}


# --- feed-forward ---------------------------------------------------------------------

def _ffn_params(x, linear1_weight, linear1_bias, linear2_weight, linear2_bias, activation):
    x = as_float64("x", x)
    e = _check_tokens(x)
    _check_activation(activation)
    w1 = as_float64("linear1_weight", linear1_weight)
    if w1.ndim != 2 or w1.shape[1] != e:
        raise ValueError(f"linear1_weight must have shape (dim_feedforward, {e}), got {tuple(w1.shape)}")
    f = w1.shape[0]
    return (x, w1, _param("linear1_bias", linear1_bias, (f,)),
            _param("linear2_weight", linear2_weight, (e, f)),
            _param("linear2_bias", linear2_bias, (e,)))


@ieee
def feed_forward(x, linear1_weight, linear1_bias, linear2_weight, linear2_bias, activation="relu"):
    """y = linear2(act(linear1(x))) = act(x W1^T + b1) W2^T + b2, act relu or exact gelu,
    applied to every token independently (torch's _ff_block with dropout 0)."""
    x, w1, b1, w2, b2 = _ffn_params(x, linear1_weight, linear1_bias, linear2_weight,
                                    linear2_bias, activation)
    return _linear(_activation(activation, _linear(x, w1, b1)), w2, b2)


@ieee
def feed_forward_vjp(x, grad_output, linear1_weight, linear1_bias, linear2_weight, linear2_bias,
                     activation="relu"):
    """Closed-form gradients of `feed_forward`: with h = x W1^T + b1 and a = act(h),
    da = g W2, dh = da * act'(h), dx = dh W1; dW2 = g^T a, dW1 = dh^T x, biases sum.
    Returns (grad_x, {"linear1_weight", "linear1_bias", "linear2_weight", "linear2_bias"})."""
    x, w1, b1, w2, b2 = _ffn_params(x, linear1_weight, linear1_bias, linear2_weight,
                                    linear2_bias, activation)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    hid = _linear(x, w1, b1)
    g_a, g_w2, g_b2 = _linear_vjp(_activation(activation, hid), g, w2)
    g_x, g_w1, g_b1 = _linear_vjp(x, g_a * _activation_grad(activation, hid), w1)
    return g_x, {"linear1_weight": g_w1, "linear1_bias": g_b1,
                 "linear2_weight": g_w2, "linear2_bias": g_b2}


# --- encoder layer and stack ----------------------------------------------------------

def _layer_params(params, x, name="params"):
    if not isinstance(params, Mapping):
        raise TypeError(f"{name} must be a mapping of parameter name to array, got {type(params).__name__}")
    missing = [k for k in ENCODER_LAYER_PARAMS if k not in params]
    if missing:
        raise ValueError(f"{name} is missing {missing}")
    extra = sorted(set(params) - set(ENCODER_LAYER_PARAMS))
    if extra:
        raise ValueError(f"{name} has unknown entries {extra}")
    e = x.shape[-1]
    for k in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"):
        _param(f"{name}[{k!r}]", params[k], (e,))
    return params


def _sublayers(params, num_heads, activation, eps):
    """The four pieces of one encoder layer as (forward, vjp) callables over one input,
    each vjp returning its parameter gradients under the layer's parameter names."""
    p = params
    attn = (p["self_attn.in_proj_weight"], p["self_attn.in_proj_bias"],
            p["self_attn.out_proj.weight"], p["self_attn.out_proj.bias"])
    ffn = (p["linear1.weight"], p["linear1.bias"], p["linear2.weight"], p["linear2.bias"])

    def sa(h):
        return multi_head_self_attention(h, *attn, num_heads)

    def sa_vjp(h, g):
        gx, gp = multi_head_self_attention_vjp(h, g, *attn, num_heads)
        return gx, {"self_attn.in_proj_weight": gp["in_proj_weight"],
                    "self_attn.in_proj_bias": gp["in_proj_bias"],
                    "self_attn.out_proj.weight": gp["out_proj_weight"],
                    "self_attn.out_proj.bias": gp["out_proj_bias"]}

    def ff(h):
        return feed_forward(h, *ffn, activation)

    def ff_vjp(h, g):
        gx, gp = feed_forward_vjp(h, g, *ffn, activation)
        return gx, {"linear1.weight": gp["linear1_weight"], "linear1.bias": gp["linear1_bias"],
                    "linear2.weight": gp["linear2_weight"], "linear2.bias": gp["linear2_bias"]}

    def norm_pair(prefix):
        w, b = p[f"{prefix}.weight"], p[f"{prefix}.bias"]

        def norm(h):
            return layer_norm(h, (h.shape[-1],), w, b, eps)

        def norm_vjp(h, g):
            gx, gw, gb = layer_norm_vjp(h, (h.shape[-1],), g, w, b, eps)
            return gx, {f"{prefix}.weight": gw, f"{prefix}.bias": gb}

        return norm, norm_vjp

    return (sa, sa_vjp), (ff, ff_vjp), norm_pair("norm1"), norm_pair("norm2")


def _prepare(x, num_heads, activation, eps):
    x = as_float64("x", x)
    e = _check_tokens(x)
    _check_heads(num_heads, e)
    _check_activation(activation)
    return x, check_eps(eps)


@ieee
def transformer_encoder_layer(x, params: Mapping, num_heads, *, norm_first=False,
                              activation="relu", eps=1e-5):
    """torch.nn.TransformerEncoderLayer with dropout 0, built from the F8 wirings.

    norm_first=False is Post-LN, two `post_ln_block`s: x <- LN1(x + SA(x)),
    x <- LN2(x + FFN(x)). norm_first=True is Pre-LN, two `pre_ln_block`s:
    x <- x + SA(LN1(x)), x <- x + FFN(LN2(x)). `params` maps the names in
    ENCODER_LAYER_PARAMS (torch's state_dict names) to arrays.
    """
    x, eps = _prepare(x, num_heads, activation, eps)
    params = _layer_params(params, x)
    (sa, _), (ff, _), (n1, _), (n2, _) = _sublayers(params, num_heads, activation, eps)
    block = pre_ln_block if norm_first else post_ln_block
    return block(block(x, sa, n1), ff, n2)


@ieee
def transformer_encoder_layer_vjp(x, grad_output, params: Mapping, num_heads, *, norm_first=False,
                                  activation="relu", eps=1e-5):
    """Gradients of `transformer_encoder_layer`, through the block VJPs of `blocks`.

    Returns (grad_x, grads) where grads maps every name of ENCODER_LAYER_PARAMS to the
    gradient of that parameter.
    """
    x, eps = _prepare(x, num_heads, activation, eps)
    params = _layer_params(params, x)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    (sa, sa_vjp), (ff, ff_vjp), (n1, n1_vjp), (n2, n2_vjp) = _sublayers(
        params, num_heads, activation, eps)
    block, block_vjp = (pre_ln_block, pre_ln_block_vjp) if norm_first else (post_ln_block,
                                                                             post_ln_block_vjp)
    mid = block(x, sa, n1)
    g_mid, ff_grads, n2_grads = block_vjp(mid, g, ff, ff_vjp, n2, n2_vjp)
    g_x, sa_grads, n1_grads = block_vjp(x, g_mid, sa, sa_vjp, n1, n1_vjp)
    return g_x, {**sa_grads, **ff_grads, **n1_grads, **n2_grads}


def _final_norm(final_norm, x, eps):
    """final_norm is None (no final LN) or a mapping with "weight" and "bias"."""
    if final_norm is None:
        return (lambda h: h), (lambda h, g: (g, None))
    if not isinstance(final_norm, Mapping) or set(final_norm) != {"weight", "bias"}:
        raise ValueError("final_norm must be None or a mapping with exactly 'weight' and 'bias', "
                         f"got {final_norm!r}")
    e = x.shape[-1]
    w = _param("final_norm['weight']", final_norm["weight"], (e,))
    b = _param("final_norm['bias']", final_norm["bias"], (e,))

    def norm(h):
        return layer_norm(h, (e,), w, b, eps)

    def norm_vjp(h, g):
        gx, gw, gb = layer_norm_vjp(h, (e,), g, w, b, eps)
        return gx, {"weight": gw, "bias": gb}

    return norm, norm_vjp


def _stack_pieces(x, layers, num_heads, activation, eps):
    if isinstance(layers, Mapping) or not isinstance(layers, Sequence) or len(layers) == 0:
        raise ValueError("layers must be a non-empty sequence of parameter mappings, one per layer")
    subs, sub_vjps, norms, norm_vjps = [], [], [], []
    for i, params in enumerate(layers):
        pieces = _sublayers(_layer_params(params, x, f"layers[{i}]"), num_heads, activation, eps)
        (sa, sa_vjp), (ff, ff_vjp), (n1, n1_vjp), (n2, n2_vjp) = pieces
        subs += [sa, ff]
        sub_vjps += [sa_vjp, ff_vjp]
        norms += [n1, n2]
        norm_vjps += [n1_vjp, n2_vjp]
    return subs, sub_vjps, norms, norm_vjps


@ieee
def transformer_encoder(x, layers: Sequence[Mapping], num_heads, final_norm=None, *,
                        norm_first=True, activation="relu", eps=1e-5):
    """torch.nn.TransformerEncoder(layer, num_layers, norm=LayerNorm) with dropout 0.

    With norm_first=True this is F8's Pre-LN network, `pre_ln_stack` over the sequence
    SA_1, FFN_1, SA_2, FFN_2, ... with each block's own LayerNorm and one final LN
    (`final_norm`, a mapping with "weight" and "bias"; None means no final LN).
    With norm_first=False the Post-LN layers are chained, then the final LN if given.
    `layers` holds one parameter mapping per layer (see transformer_encoder_layer).
    """
    x, eps = _prepare(x, num_heads, activation, eps)
    subs, _, norms, _ = _stack_pieces(x, layers, num_heads, activation, eps)
    fnorm, _ = _final_norm(final_norm, x, eps)
    if norm_first:
        return pre_ln_stack(x, subs, norms, fnorm)
    for i in range(0, len(subs), 2):
        x = post_ln_block(post_ln_block(x, subs[i], norms[i]), subs[i + 1], norms[i + 1])
    return fnorm(x)


@ieee
def transformer_encoder_vjp(x, grad_output, layers: Sequence[Mapping], num_heads, final_norm=None,
                            *, norm_first=True, activation="relu", eps=1e-5):
    """Gradients of `transformer_encoder`; for norm_first=True via `pre_ln_stack_vjp`.

    Returns (grad_x, [grads per layer, each a mapping over ENCODER_LAYER_PARAMS],
    final_norm_grads) with final_norm_grads a mapping {"weight", "bias"} or None.
    """
    x, eps = _prepare(x, num_heads, activation, eps)
    g = as_float64("grad_output", grad_output)
    check_same_shape("grad_output", g, x.shape)
    subs, sub_vjps, norms, norm_vjps = _stack_pieces(x, layers, num_heads, activation, eps)
    fnorm, fnorm_vjp = _final_norm(final_norm, x, eps)
    if norm_first:
        g_x, sub_grads, norm_grads, final_grads = pre_ln_stack_vjp(
            x, g, subs, sub_vjps, norms, norm_vjps, fnorm, fnorm_vjp)
    else:
        inputs = []
        for i in range(0, len(subs), 2):
            inputs.append(x)
            x = post_ln_block(post_ln_block(x, subs[i], norms[i]), subs[i + 1], norms[i + 1])
        g_x, final_grads = fnorm_vjp(x, g)
        sub_grads, norm_grads = [None] * len(subs), [None] * len(subs)
        for j in reversed(range(len(inputs))):
            i = 2 * j
            mid = post_ln_block(inputs[j], subs[i], norms[i])
            g_x, sub_grads[i + 1], norm_grads[i + 1] = post_ln_block_vjp(
                mid, g_x, subs[i + 1], sub_vjps[i + 1], norms[i + 1], norm_vjps[i + 1])
            g_x, sub_grads[i], norm_grads[i] = post_ln_block_vjp(
                inputs[j], g_x, subs[i], sub_vjps[i], norms[i], norm_vjps[i])
    per_layer = [{**sub_grads[i], **sub_grads[i + 1], **norm_grads[i], **norm_grads[i + 1]}
                 for i in range(0, len(subs), 2)]
    return g_x, per_layer, final_grads
