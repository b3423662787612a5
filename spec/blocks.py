"""The three residual-block wirings of claim F8 and their vector-Jacobian products.

The sub-layer F and the norms are callables, so any oracle (or backend) function can be
plugged in. A VJP takes the same callables plus, for each, a VJP callable
`vjp(input, grad_output) -> (grad_input, param_grads)`, where `param_grads` is whatever
that piece reports for its own parameters (a dict, a tuple, None); the block VJP hands
those back untouched, so the wiring never needs to know what the pieces are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Fn = Callable[[np.ndarray], np.ndarray]
Vjp = Callable[[np.ndarray, np.ndarray], tuple]


def post_ln_block(x, sublayer: Fn, norm: Fn):
    """F8 Post-LN (2017): x <- LN(x + F(x)); the residual sum itself is normalized."""
    return norm(x + sublayer(x))


def pre_ln_block(x, sublayer: Fn, norm: Fn):
    """F8 Pre-LN: x <- x + F(LN(x)); the identity path is never normalized."""
    return x + sublayer(norm(x))


def _per_block(name: str, fns, count: int) -> list:
    """One callable shared by every block, or a sequence with one per block."""
    if callable(fns):
        return [fns] * count
    fns = list(fns)
    if len(fns) != count:
        raise ValueError(f"{name} must be one callable or {count} of them (one per sublayer), "
                         f"got {len(fns)}")
    return fns


def pre_ln_stack(x, sublayers: Sequence[Fn], norm: Fn | Sequence[Fn], final_norm: Fn):
    """F8 Pre-LN network: every block is x + F(LN(x)); one final LN after the last block.

    `norm` is either one callable shared by every block or a sequence with one norm per
    sublayer (a real network gives each block its own LayerNorm parameters).
    """
    for sublayer, block_norm in zip(sublayers, _per_block("norm", norm, len(sublayers)),
                                    strict=True):
        x = pre_ln_block(x, sublayer, block_norm)
    return final_norm(x)


def sandwich_block(x, sublayer: Fn, pre_norm: Fn, post_norm: Fn):
    """F8 Gemma-3 sandwich: h = x + Norm_post(F(Norm_pre(x))).

    The post-norm acts on the branch output only, before the residual add, so the
    identity path of Pre-LN is kept.
    """
    return x + post_norm(sublayer(pre_norm(x)))


def post_ln_block_vjp(x, grad_output, sublayer: Fn, sublayer_vjp: Vjp, norm: Fn, norm_vjp: Vjp):
    """VJP of y = N(u), u = x + F(x): the norm's input gradient g_u reaches x twice, once
    along the identity and once through F, so dL/dx = g_u + J_F(x)^T g_u.

    Returns (grad_x, sublayer_param_grads, norm_param_grads).
    """
    u = x + sublayer(x)
    g_u, norm_grads = norm_vjp(u, grad_output)
    g_f, sub_grads = sublayer_vjp(x, g_u)
    return g_u + g_f, sub_grads, norm_grads


def pre_ln_block_vjp(x, grad_output, sublayer: Fn, sublayer_vjp: Vjp, norm: Fn, norm_vjp: Vjp):
    """VJP of y = x + F(N(x)): the identity passes g through unchanged, the branch adds
    J_N(x)^T J_F(N(x))^T g. Returns (grad_x, sublayer_param_grads, norm_param_grads)."""
    g_n, sub_grads = sublayer_vjp(norm(x), grad_output)
    g_x, norm_grads = norm_vjp(x, g_n)
    return grad_output + g_x, sub_grads, norm_grads


def pre_ln_stack_vjp(x, grad_output, sublayers: Sequence[Fn], sublayer_vjps: Sequence[Vjp],
                     norm: Fn | Sequence[Fn], norm_vjp: Vjp | Sequence[Vjp],
                     final_norm: Fn, final_norm_vjp: Vjp):
    """VJP of `pre_ln_stack`: replay the forward keeping every block's input, then walk
    the blocks backwards with `pre_ln_block_vjp`.

    Returns (grad_x, [sublayer_param_grads per block], [norm_param_grads per block],
    final_norm_param_grads). A norm shared by every block gets one entry per block; the
    caller sums them if it wants the shared parameter's total gradient.
    """
    count = len(sublayers)
    norms = _per_block("norm", norm, count)
    norm_vjps = _per_block("norm_vjp", norm_vjp, count)
    vjps = _per_block("sublayer_vjps", sublayer_vjps, count)
    inputs = []
    for sublayer, block_norm in zip(sublayers, norms, strict=True):
        inputs.append(x)
        x = pre_ln_block(x, sublayer, block_norm)
    g, final_grads = final_norm_vjp(x, grad_output)
    sub_grads, norm_grads = [None] * count, [None] * count
    for i in reversed(range(count)):
        g, sub_grads[i], norm_grads[i] = pre_ln_block_vjp(
            inputs[i], g, sublayers[i], vjps[i], norms[i], norm_vjps[i])
    return g, sub_grads, norm_grads, final_grads


def sandwich_block_vjp(x, grad_output, sublayer: Fn, sublayer_vjp: Vjp, pre_norm: Fn,
                       pre_norm_vjp: Vjp, post_norm: Fn, post_norm_vjp: Vjp):
    """VJP of h = x + P(F(N(x))): identity plus the chain rule through P, F and N.

    Returns (grad_x, sublayer_param_grads, pre_norm_param_grads, post_norm_param_grads).
    """
    n = pre_norm(x)
    f = sublayer(n)
    g_f, post_grads = post_norm_vjp(f, grad_output)
    g_n, sub_grads = sublayer_vjp(n, g_f)
    g_x, pre_grads = pre_norm_vjp(x, g_n)
    return grad_output + g_x, sub_grads, pre_grads, post_grads
