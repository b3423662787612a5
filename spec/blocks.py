"""The three residual-block wirings of claim F8. The sub-layer F and the norms are
callables, so any oracle (or backend) function can be plugged in."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Fn = Callable[[np.ndarray], np.ndarray]


def post_ln_block(x, sublayer: Fn, norm: Fn):
    """F8 Post-LN (2017): x <- LN(x + F(x)); the residual sum itself is normalized."""
    return norm(x + sublayer(x))


def pre_ln_block(x, sublayer: Fn, norm: Fn):
    """F8 Pre-LN: x <- x + F(LN(x)); the identity path is never normalized."""
    return x + sublayer(norm(x))


def pre_ln_stack(x, sublayers: Sequence[Fn], norm: Fn, final_norm: Fn):
    """F8 Pre-LN network: every block is x + F(LN(x)); one final LN after the last block."""
    for sublayer in sublayers:
        x = pre_ln_block(x, sublayer, norm)
    return final_norm(x)


def sandwich_block(x, sublayer: Fn, pre_norm: Fn, post_norm: Fn):
    """F8 Gemma-3 sandwich: h = x + Norm_post(F(Norm_pre(x))).

    The post-norm acts on the branch output only, before the residual add, so the
    identity path of Pre-LN is kept.
    """
    return x + post_norm(sublayer(pre_norm(x)))
