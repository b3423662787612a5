"""Broken backends that put inf or NaN where the spec has a finite value, one per place a
non-finite number can enter a record: an output, a gradient, a running statistic. The
run must survive each, record the values, and render them (test_results_survive.py)."""

from __future__ import annotations

import time

import numpy as np
from normspec.impls.numpy_ref import NumpyBackend, NumpyBatchNorm


class InfOutput(NumpyBackend):
    """LayerNorm whose first output element is +inf (an empty output has none)."""

    def layer_norm(self, x, *args, **kwargs):
        res = super().layer_norm(x, *args, **kwargs)
        out = res.output.copy()
        out.reshape(-1)[:1] = np.inf
        return res._replace(output=out)


class NanOutput(NumpyBackend):
    """RMSNorm whose last output element is NaN (an empty output has none)."""

    def rms_norm(self, x, *args, **kwargs):
        res = super().rms_norm(x, *args, **kwargs)
        out = res.output.copy()
        out.reshape(-1)[-1:] = np.nan
        return res._replace(output=out)


class InfGradient(NumpyBackend):
    """LayerNorm whose input gradient is -inf everywhere."""

    def layer_norm(self, x, *args, **kwargs):
        res = super().layer_norm(x, *args, **kwargs)
        if res.grad_input is None:
            return res
        return res._replace(grad_input=np.full_like(res.grad_input, -np.inf))


class _NanStatsLayer(NumpyBatchNorm):
    def update_running(self, mu, sum_sq, m):
        super().update_running(mu, sum_sq * np.nan, m)


class NanRunningStats(NumpyBackend):
    """BatchNorm whose running variance turns NaN at the first training step."""

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return _NanStatsLayer(self, num_features, eps, momentum, affine, track_running_stats,
                              np.dtype(dtype), weight, bias)


class Slow(NumpyBackend):
    """A conforming backend that takes a while per call: something to interrupt."""

    def layer_norm(self, *args, **kwargs):
        time.sleep(0.3)
        return super().layer_norm(*args, **kwargs)

    def rms_norm(self, *args, **kwargs):
        time.sleep(0.3)
        return super().rms_norm(*args, **kwargs)


class Segfaults(NumpyBackend):
    """Kills its own process in LayerNorm, as a crashing native kernel would."""

    def layer_norm(self, *args, **kwargs):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)


class SegfaultsNamedByPid(Segfaults):
    """Segfaults whose name holds its process id: the process started after the crash
    calls the backend something else."""

    def __init__(self):
        super().__init__()
        import os

        self.name = f"pid{os.getpid()}"


class ForksAChild(NumpyBackend):
    """LayerNorm forks a process that outlives the call: it writes its pid to
    $NORMSPEC_TEST_ORPHAN_FILE, sleeps 3 s, then writes "still alive" there."""

    def layer_norm(self, *args, **kwargs):
        import os
        import time as _time

        if os.fork() == 0:
            path = os.environ["NORMSPEC_TEST_ORPHAN_FILE"]
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{os.getpid()}\n")
            _time.sleep(3)
            with open(path, "a", encoding="utf-8") as f:
                f.write("still alive\n")
            os._exit(0)
        return super().layer_norm(*args, **kwargs)


# each reports under its own name (the class name), so runs of several stay apart
for _cls in (InfOutput, NanOutput, InfGradient, NanRunningStats, Slow, Segfaults):
    _cls.name = _cls.__name__
