"""The numpy backend's data-parallel BatchNorm (DP): the worked example of
`data_parallel_batch_norm` for third parties.

The replicas are simulated in one process, and every collective is spelled out as the
one function a real backend would call instead (`all_gather_statistics`,
`all_reduce_sum`, `all_reduce_mean`): "local" keeps one ordinary BatchNorm layer per
replica (each with its own buffers: data_parallel_buffers = "per_replica") and averages
the parameter gradients; "sync" has each replica send (count, mean, sum of squared
deviations) of its shard, merges them pairwise (Chan, Golub and LeVeque), so shards of
any size (and the one-value-per-replica batch) are handled, and all-reduces the two
per-channel sums the backward needs. Statistics are computed in the compute dtype.
"""

from __future__ import annotations

import numpy as np

from ._running import RunningStats
from .protocol import DataParallelResult, compute_dtype


def _layout(x):
    return (0,) + tuple(range(2, x.ndim)), (1, x.shape[1]) + (1,) * (x.ndim - 2)


class NumpyDataParallel:
    """Mixed into NumpyBackend; the hooks are overridable one at a time by the tests'
    broken variants."""

    # --- the collectives ---
    def all_gather_statistics(self, summaries):
        """Every replica receives every replica's (count, mean, m2)."""
        return list(summaries)

    def all_reduce_sum(self, values):
        return np.sum(values, axis=0)

    def all_reduce_mean(self, values):
        return np.sum(values, axis=0) / len(values)

    # --- cross-replica statistics ---
    def shard_summary(self, x, ct):
        axes, bshape = _layout(x)
        n = x.size // x.shape[1]
        if n == 0:
            return 0, np.zeros(x.shape[1], ct), np.zeros(x.shape[1], ct)
        mu = x.mean(axis=axes)
        return n, mu, ((x - mu.reshape(bshape)) ** 2).sum(axis=axes)

    def merge_summaries(self, summaries):
        """Pairwise merge of (count, mean, m2): no cancellation, any shard sizes."""
        n, mean, m2 = summaries[0]
        for n_b, mean_b, m2_b in summaries[1:]:
            if n_b == 0:
                continue
            total = n + n_b
            delta = mean_b - mean
            mean = mean + delta * (n_b / total)
            m2 = m2 + m2_b + delta * delta * (n * n_b / total)
            n = total
        return n, mean, m2

    def global_statistics(self, shards, ct):
        n, mean, m2 = self.merge_summaries(
            self.all_gather_statistics([self.shard_summary(x, ct) for x in shards]))
        if n <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got a "
                             f"global count of {n}")
        return n, mean, m2

    # --- the protocol method ---
    def data_parallel_batch_norm(self, steps, *, sync, eps, momentum, dtype, weight, bias,
                                 grad_outputs=None):
        dtype = np.dtype(dtype)
        world = len(steps[0])
        if sync:
            return self._sync_steps(steps, grad_outputs, world, eps, momentum, dtype, weight, bias)
        layers = [self.batch_norm(weight.shape[0], eps=eps, momentum=momentum, affine=True,
                                  track_running_stats=True, dtype=dtype, weight=weight,
                                  bias=bias) for _ in range(world)]
        fields = {f: [] for f in DataParallelResult._fields}
        for t, shards in enumerate(steps):
            grads = None if grad_outputs is None else grad_outputs[t]
            res = [layer.forward(x, None if grads is None else grads[r])
                   for r, (layer, x) in enumerate(zip(layers, shards, strict=True))]
            fields["output"].append([r.output for r in res])
            if grads is not None:
                fields["grad_input"].append([r.grad_input for r in res])
                for name in ("grad_weight", "grad_bias"):
                    local = [getattr(r, name) for r in res]
                    fields[f"replica_{name}"].append(local)
                    ct = compute_dtype(dtype)
                    reduced = self.all_reduce_mean([v.astype(ct) for v in local]).astype(dtype)
                    fields[name].append([reduced.copy() for _ in range(world)])
            fields["running_mean"].append([layer.running_mean for layer in layers])
            fields["running_var"].append([layer.running_var for layer in layers])
        return _result(fields, grad_outputs)

    def _sync_steps(self, steps, grad_outputs, world, eps, momentum, dtype, weight, bias):
        ct = compute_dtype(dtype)
        c = weight.shape[0]
        stats = RunningStats(c, True, ct, dtype, momentum)  # identical on every replica
        w, b = weight.astype(ct), bias.astype(ct)
        fields = {f: [] for f in DataParallelResult._fields}
        for t, shards in enumerate(steps):
            xs = [x.astype(ct) for x in shards]
            n, mu, m2 = self.global_statistics(xs, ct)
            _, bshape = _layout(xs[0])
            r = self.inv_std((m2 / n).reshape(bshape), ct.type(eps))
            x_hats = [(x - mu.reshape(bshape)) * r for x in xs]
            fields["output"].append([(xh * w.reshape(bshape) + b.reshape(bshape)).astype(dtype)
                                     for xh in x_hats])
            if grad_outputs is not None:
                self._sync_backward(fields, grad_outputs[t], x_hats, r, w, n, ct, dtype)
            stats.update(mu, m2, n)
            rm, rv = stats.reported()
            fields["running_mean"].append([rm.copy() for _ in range(world)])
            fields["running_var"].append([rv.copy() for _ in range(world)])
        return _result(fields, grad_outputs)

    def _sync_backward(self, fields, grads, x_hats, r, w, n, ct, dtype):
        axes, bshape = _layout(x_hats[0])
        gs = [g.astype(ct) for g in grads]
        local_g = [g.sum(axis=axes) for g in gs]
        local_gx = [(g * xh).sum(axis=axes) for g, xh in zip(gs, x_hats, strict=True)]
        s_g, s_gx = self.all_reduce_sum(local_g), self.all_reduce_sum(local_gx)
        gamma = w.reshape(bshape)
        fields["grad_input"].append([
            (gamma * r * (g - s_g.reshape(bshape) / n - xh * s_gx.reshape(bshape) / n)).astype(dtype)
            for g, xh in zip(gs, x_hats, strict=True)])
        world = len(gs)
        for name, local in (("grad_weight", local_gx), ("grad_bias", local_g)):
            fields[f"replica_{name}"].append([v.astype(dtype) for v in local])
            reduced = self.all_reduce_mean(local).astype(dtype)
            fields[name].append([reduced.copy() for _ in range(world)])


def _result(fields, grad_outputs) -> DataParallelResult:
    if grad_outputs is None:
        for f in ("grad_input", "replica_grad_weight", "replica_grad_bias", "grad_weight",
                  "grad_bias"):
            fields[f] = None
    return DataParallelResult(**fields)
