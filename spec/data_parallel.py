"""Claim family DP (beyond the document): BatchNorm under data parallelism over R
replicas, each holding one shard of the global batch along the batch axis.

Two behaviours ship in practice:

* local BatchNorm: every replica normalizes its shard with the shard's own statistics
  and updates its own running statistics from its shard (a plain BatchNorm inside
  DistributedDataParallel). Only the parameter gradients are all-reduced;
* cross-replica ("sync") BatchNorm: the statistics are those of the whole global batch,
  assembled by a collective from per-shard summaries, so the result equals one BatchNorm
  on the concatenated batch.

Shards are arrays [N_r, C, ...] that agree on every axis but the first; N_r may differ
between replicas (and, for sync BatchNorm, may be 0). All functions are pure: running
statistics go in as arguments and come out as return values.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._validate import as_float64, check_eps, check_momentum, check_same_shape, ieee
from .batch_norm import (
    SingleValuePerChannelError,
    _affine,
    _channel_layout,
    _params,
    batch_norm_train,
    batch_norm_train_vjp,
)

REDUCTIONS = ("sum", "mean")


def _shards(name, shards, allow_empty):
    if isinstance(shards, np.ndarray) or not isinstance(shards, Sequence) or len(shards) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of arrays, one per replica")
    out = [as_float64(f"{name}[{r}]", s) for r, s in enumerate(shards)]
    for r, s in enumerate(out):
        _channel_layout(s)
        if s.shape[1:] != out[0].shape[1:]:
            raise ValueError(f"{name}[{r}] has shape {tuple(s.shape)}; every shard must match "
                             f"{name}[0] {tuple(out[0].shape)} on all axes but the first")
        if not allow_empty and s.shape[0] == 0:
            raise ValueError(f"{name}[{r}] is empty; local BatchNorm needs data on every replica")
    return out


def _grads(shards, grad_outputs):
    gs = _shards("grad_outputs", grad_outputs, allow_empty=True)
    if len(gs) != len(shards):
        raise ValueError(f"grad_outputs has {len(gs)} shards, shards has {len(shards)}")
    for r, (x, g) in enumerate(zip(shards, gs, strict=True)):
        check_same_shape(f"grad_outputs[{r}]", g, x.shape)
    return gs


def _check_reduction(reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def _all_reduce(values, reduction):
    """Sum over replicas; "mean" divides by R afterwards, as DistributedDataParallel does
    with every gradient (it all-reduces with a sum and divides by the world size)."""
    if values[0] is None:
        return None
    total = np.sum(values, axis=0)
    return total / len(values) if reduction == "mean" else total


# --- local BatchNorm ------------------------------------------------------------------

@ieee
def local_batch_norm_train(shards, running_means=None, running_vars=None, weight=None, bias=None,
                           momentum=0.1, eps=1e-5):
    """DP.local forward: replica r computes batch_norm_train(shard_r, rm_r, rv_r, ...).

    Each shard is normalized by its own mean and biased variance and each replica
    updates its own running statistics (unbiased variance from its own count m_r), so
    the replicas' buffers drift apart unless something (such as DDP's buffer broadcast
    from replica 0 at the start of each forward) overwrites them. `running_means` and
    `running_vars` are sequences with one array per replica, or both None. A shard with
    one value per channel raises (B3, per replica). Returns (ys, new_running_means,
    new_running_vars) as lists (the latter two None when not tracked).
    """
    xs = _shards("shards", shards, allow_empty=False)
    if (running_means is None) != (running_vars is None):
        raise ValueError("running_means and running_vars must both be sequences or both be None")
    if running_means is not None:
        for name, seq in (("running_means", running_means), ("running_vars", running_vars)):
            if len(seq) != len(xs):
                raise ValueError(f"{name} has {len(seq)} entries for {len(xs)} replicas")
    ys, means, varis = [], [], []
    for r, x in enumerate(xs):
        rm = None if running_means is None else running_means[r]
        rv = None if running_vars is None else running_vars[r]
        try:
            y, m, v = batch_norm_train(x, rm, rv, weight, bias, momentum, eps)
        except SingleValuePerChannelError as err:
            raise SingleValuePerChannelError(f"replica {r}: {err}") from None
        ys.append(y)
        means.append(m)
        varis.append(v)
    if running_means is None:
        return ys, None, None
    return ys, means, varis


@ieee
def local_batch_norm_train_vjp(shards, grad_outputs, weight=None, bias=None, eps=1e-5, *,
                               reduction="sum"):
    """DP.local backward: batch_norm_train_vjp on every shard, then the all-reduce.

    grad_x of replica r involves only shard r (no cross-replica term: the statistics
    were local). dL/dgamma and dL/dbeta are all-reduced: reduction="sum" gives the
    gradient of the summed loss sum_r L_r; reduction="mean" divides by R, which is what
    DistributedDataParallel leaves in .grad. Returns (grad_xs, grad_weight, grad_bias).
    """
    xs = _shards("shards", shards, allow_empty=False)
    gs = _grads(xs, grad_outputs)
    _check_reduction(reduction)
    parts = [batch_norm_train_vjp(x, g, weight, bias, eps) for x, g in zip(xs, gs, strict=True)]
    return ([p[0] for p in parts], _all_reduce([p[1] for p in parts], reduction),
            _all_reduce([p[2] for p in parts], reduction))


# --- cross-replica (sync) BatchNorm ---------------------------------------------------

def shard_statistics(shard):
    """What one replica contributes to the collective, per channel: (count, mean, m2)
    with m2 = sum (x - mean)^2 the sum of squared deviations about the shard's own mean.

    An empty shard contributes (0, 0, 0). Sending (sum x, sum x^2) instead would let the
    merge compute E[x^2] - E[x]^2, which cancels catastrophically when |mean| is large
    compared with the spread (the one-pass-variance bug class); deviations about each
    shard's mean keep every term non-negative and of the size of the spread.
    """
    x = as_float64("shard", shard)
    axes, m, _ = _channel_layout(x)
    c = x.shape[1]
    if m == 0:
        return 0, np.zeros(c), np.zeros(c)
    mu = x.mean(axis=axes)
    mu_b = mu.reshape((1, c) + (1,) * (x.ndim - 2))
    mu = mu + (x - mu_b).mean(axis=axes)  # one refinement step, as the oracle does
    mu_b = mu.reshape((1, c) + (1,) * (x.ndim - 2))
    return m, mu, ((x - mu_b) ** 2).sum(axis=axes)


def merge_statistics(stats):
    """Combine per-shard (count, mean, m2) into the global ones (Chan, Golub and LeVeque's
    pairwise update), folding replicas in order 0, 1, ..., R-1:

    n = n_a + n_b, delta = mean_b - mean_a, mean = mean_a + delta n_b / n,
    m2 = m2_a + m2_b + delta^2 n_a n_b / n.

    Every term is a sum of non-negative quantities, so m2 never goes negative and no
    cancellation against the squared mean can occur.
    """
    n, mean, m2 = stats[0]
    mean, m2 = np.array(mean, dtype=np.float64), np.array(m2, dtype=np.float64)
    for n_b, mean_b, m2_b in stats[1:]:
        if n_b == 0:
            continue
        if n == 0:
            n, mean, m2 = n_b, np.array(mean_b, dtype=np.float64), np.array(m2_b, dtype=np.float64)
            continue
        total = n + n_b
        delta = mean_b - mean
        mean = mean + delta * (n_b / total)
        m2 = m2 + m2_b + delta * delta * (n * n_b / total)
        n = total
    return n, mean, m2


def _global_stats(xs):
    n, mean, m2 = merge_statistics([shard_statistics(x) for x in xs])
    if n <= 1:
        counts = [shard_statistics(x)[0] for x in xs]
        raise SingleValuePerChannelError(
            f"expected more than 1 value per channel in training over all replicas, got a "
            f"global count of {n} per channel (per-replica counts {counts}; B3)")
    return n, mean, m2


@ieee
def sync_batch_norm_train(shards, running_mean=None, running_var=None, weight=None, bias=None,
                          momentum=0.1, eps=1e-5, *, num_batches_tracked=0):
    """DP.sync forward: batch_norm_train of the concatenated batch, computed the way a
    collective does it: every replica sends (count, mean, m2) of its shard, the merge
    (`merge_statistics`) gives the global count n, mean mu and m2, and each replica
    normalizes its own shard with them:

    y_r = gamma (x_r - mu) / sqrt(m2 / n + eps) + beta (biased variance, global count),
    running stats <- (1 - a) run + a (mu, m2 / (n - 1)) (unbiased from the global count,
    identical on every replica; momentum=None is the cumulative average, as in F4).

    Shards of unequal sizes, including empty ones, are allowed. B3 is a rule on the
    global count: it raises only when n <= 1, whatever the per-replica counts.
    Returns (ys, new_running_mean, new_running_var).
    """
    xs = _shards("shards", shards, allow_empty=True)
    weight, bias, running_mean, running_var = _params(xs[0], weight, bias, running_mean, running_var)
    momentum = check_momentum(momentum)
    eps = check_eps(eps)
    n, mu, m2 = _global_stats(xs)
    _, _, bshape = _channel_layout(xs[0])
    r = 1.0 / np.sqrt(m2 / n + eps)
    ys = [_affine((x - mu.reshape(bshape)) * r.reshape(bshape), weight, bias, bshape) for x in xs]
    if running_mean is None:
        return ys, None, None
    a = 1.0 / (num_batches_tracked + 1) if momentum is None else momentum
    return ys, (1.0 - a) * running_mean + a * mu, (1.0 - a) * running_var + a * m2 / (n - 1)


@ieee
def sync_batch_norm_train_vjp(shards, grad_outputs, weight=None, bias=None, eps=1e-5, *,
                              reduction="sum"):
    """DP.sync backward. The statistics depend on every replica's data, so replica r's
    input gradient needs two all-reduced per-channel sums, S_g = sum over all replicas
    of g and S_gx = sum of g x_hat (x_hat with the global mu and r = 1/sqrt(v_b + eps)):

    dL/dx_r = gamma r (g_r - S_g / n - x_hat_r S_gx / n),

    the training VJP of the concatenated batch, restricted to shard r. The same sums are
    dL/dgamma = S_gx and dL/dbeta = S_g with reduction="sum" (the gradient of the total
    loss; equals batch_norm_train_vjp on the concatenation). reduction="mean" divides the
    parameter gradients by R: a framework that computes each replica's parameter
    gradient from its own shard and lets DistributedDataParallel average them ends
    there. grad_x is the same for both. Returns (grad_xs, grad_weight, grad_bias).
    """
    xs = _shards("shards", shards, allow_empty=True)
    gs = _grads(xs, grad_outputs)
    weight, bias, _, _ = _params(xs[0], weight, bias, None, None)
    eps = check_eps(eps)
    _check_reduction(reduction)
    n, mu, m2 = _global_stats(xs)
    axes, _, bshape = _channel_layout(xs[0])
    r = (1.0 / np.sqrt(m2 / n + eps)).reshape(bshape)
    x_hats = [(x - mu.reshape(bshape)) * r for x in xs]
    # the two all-reduces: sum over replicas of each replica's local sums
    s_g = np.sum([g.sum(axis=axes) for g in gs], axis=0)
    s_gx = np.sum([(g * xh).sum(axis=axes) for g, xh in zip(gs, x_hats, strict=True)], axis=0)
    gamma = weight.reshape(bshape) if weight is not None else 1.0
    grad_xs = [gamma * r * (g - s_g.reshape(bshape) / n - xh * s_gx.reshape(bshape) / n)
               for g, xh in zip(gs, x_hats, strict=True)]
    scale = 1.0 / len(xs) if reduction == "mean" else 1.0
    grad_weight = s_gx * scale if weight is not None else None
    grad_bias = s_g * scale if bias is not None else None
    return grad_xs, grad_weight, grad_bias
