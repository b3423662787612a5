"""Running statistics for the built-in BatchNorm adapters that keep their own (numpy,
numba, triton): F4's update, in one place."""

from __future__ import annotations

import numpy as np

from .protocol import BatchNormLayer


class RunningStats:
    """running_mean / running_var kept in `store` precision and reported in `dtype`;
    None for both when not tracked (track_running_stats=False)."""

    def __init__(self, c: int, track: bool, store, dtype, momentum):
        self.mean = np.zeros(c, store) if track else None
        self.var = np.ones(c, store) if track else None
        self.store, self.dtype, self.momentum = np.dtype(store), np.dtype(dtype), momentum
        self.num_batches_tracked = 0

    @property
    def tracked(self) -> bool:
        return self.mean is not None

    def update(self, batch_mean, sum_sq, m: int) -> None:
        """run <- (1 - a) run + a stat; the variance statistic is the unbiased
        sum_sq / (m - 1); a = 1 / (t + 1) when momentum is None (cumulative average)."""
        self.num_batches_tracked += 1
        a = 1.0 / self.num_batches_tracked if self.momentum is None else self.momentum
        batch_mean, sum_sq = np.asarray(batch_mean, np.float64), np.asarray(sum_sq, np.float64)
        self.mean = ((1 - a) * self.mean + a * batch_mean).astype(self.store)
        self.var = ((1 - a) * self.var + a * sum_sq / (m - 1)).astype(self.store)

    def reported(self):
        if not self.tracked:
            return None, None
        return self.mean.astype(self.dtype), self.var.astype(self.dtype)


class RunningStatsLayer(BatchNormLayer):
    """A BatchNorm layer whose running statistics live in `self.stats` (RunningStats)."""

    stats: RunningStats

    @property
    def running_mean(self):
        return self.stats.reported()[0]

    @property
    def running_var(self):
        return self.stats.reported()[1]

    @property
    def num_batches_tracked(self):
        """Training forwards folded into the statistics (None when none are kept)."""
        return self.stats.num_batches_tracked if self.stats.tracked else None
