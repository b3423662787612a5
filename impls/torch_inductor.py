"""`inductor`: the `torch` backend's modules (torch.nn.LayerNorm, RMSNorm, BatchNorm1d/2d/3d)
run through `torch.compile(module, dynamic=True)` with the Inductor backend, forward and
(through AOTAutograd) backward. Nothing is translated: torch's conventions are the spec's.

What Inductor compiles is torch's decomposition of each op into primitive reductions and
pointwise code, generated as C++ for the CPU: that, not the eager ATen kernels, is what
normspec checks here.

Compiling, and what it costs. Dynamo caches a compiled graph per code object (the
module class's forward) behind guards, so new module instances reuse it, and dynamic=True
keeps sizes symbolic, so new sizes of the same rank do not recompile. A new graph is
compiled for each new combination of dtype, input rank, normalized rank, affine
parameters present or not, gradient or not, training or eval, no-grad or not, and eps
and momentum (module attributes Dynamo guards on as constants): every check in float32
compiles 345 small Inductor graphs (forward and backward counted apart), about 1 s each
cold (15 s for the very first, which pays for importing and warming Inductor) and about
0.1 s when Inductor's on-disk caches already hold it. Measured here for all four dtypes,
two processes: 33 min with caches partly cold on a loaded machine, 7 min once Inductor's
on-disk caches hold the graphs. Hence `registry.OPT_IN`. `compile_stats()` counts them. The recompile
limit is raised, and hitting it raises instead of falling back to eager execution, and
every module is compiled with fullgraph=True, so a graph break raises too: every result
reported here is Inductor's. (Measured without fullgraph: BatchNorm with momentum=None
breaks the graph at `float(self.num_batches_tracked)`, and from then on every BatchNorm
configuration in the process, momentum 0.3 included, returned eager ATen's bits, not
Inductor's.) Hence no cumulative average: with fullgraph=True Dynamo refuses it (with
`capture_scalar_outputs` it cannot guard on 1 / float(num_batches_tracked) either), and
the capabilities say so.
"""

from __future__ import annotations

import time

from .protocol import DTYPES, Capabilities, Conventions
from .torch_nn import TorchBackend, TorchBatchNorm

#: one compiled entry per guard set; the suite needs a few hundred for each module class
RECOMPILE_LIMIT = 4096


class InductorBackend(TorchBackend):
    name = "inductor"
    capabilities = Capabilities(ops={"layer_norm", "rms_norm", "batch_norm"}, dtypes=DTYPES,
                                gradients={"layer_norm", "rms_norm", "batch_norm"},
                                no_grad_mode=True, cumulative_momentum=False,
                                untracked_stats=True)
    conventions = Conventions(
        default_eps=TorchBackend.conventions.default_eps,
        native_momentum=TorchBackend.conventions.native_momentum,
        running_var_estimator="unbiased",
        eps_zero={"layer_norm": True, "rms_norm": True, "qk_norm_scores": True,
                  "batch_norm": False},
        half_compute_dtype="float32 (Inductor upcasts float16/bfloat16 loads to float32 on CPU)",
        reasons={"eps_zero": "torch.nn.functional.batch_norm checks eps > 0 in training "
                             "before any kernel runs, compiled or not."},
    )

    def __init__(self):
        super().__init__()
        import torch._dynamo

        config = torch._dynamo.config
        config.recompile_limit = config.accumulated_recompile_limit = RECOMPILE_LIMIT
        config.fail_on_recompile_limit_hit = True  # never run eagerly under our name
        self.version = f"torch {self.torch.__version__} (torch.compile, inductor)"
        self.calls = 0
        self.call_seconds = 0.0

    def compiled(self, module):
        """The module compiled by Inductor; the wrapper forwards attribute access
        (weight, running_mean, ...) to the module itself."""
        return self.torch.compile(module, backend="inductor", dynamic=True, fullgraph=True)

    def _run(self, module, x, grad_output, *names):
        start = time.perf_counter()
        try:
            return super()._run(self.compiled(module), x, grad_output, *names)
        finally:
            self.calls += 1
            self.call_seconds += time.perf_counter() - start

    def qk_norm_scores(self, *args, **kwargs):
        raise NotImplementedError("the inductor backend compiles LayerNorm, RMSNorm and BatchNorm")

    def softcap(self, *args, **kwargs):
        raise NotImplementedError("the inductor backend compiles LayerNorm, RMSNorm and BatchNorm")

    #: `normspec bench` times the protocol call (the compiled module), not torch's eager op
    prepare_benchmark = None

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        from ._torch_arrays import torch_dtype

        if momentum is None:
            raise NotImplementedError(
                "torch.compile(fullgraph=True) refuses BatchNorm's cumulative average: "
                "float(num_batches_tracked) breaks the graph (see the module docstring)")
        return InductorBatchNorm(self, num_features, dict(
            eps=eps, momentum=momentum, affine=affine, track_running_stats=track_running_stats,
            dtype=torch_dtype(dtype)), weight, bias)

    def compile_seconds(self) -> float:
        """Time Dynamo and Inductor spent compiling in this process (their own timers:
        a frame's compilation, and a backward compiled on its first call)."""
        from torch._dynamo.utils import compilation_time_metrics

        return sum(sum(v) for k, v in compilation_time_metrics.items()
                   if k.endswith(("compile_inner", "bw_compiler")))

    def compile_stats(self) -> dict:
        """Graphs Dynamo compiled in this process (a backward counts with its forward),
        and the time Dynamo and Inductor spent compiling, in seconds."""
        from torch._dynamo.utils import counters

        return {"graphs": counters["stats"]["unique_graphs"],
                "compile_s": round(self.compile_seconds(), 1), "calls": self.calls}


class InductorBatchNorm(TorchBatchNorm):
    """torch's BatchNorm layer whose forward runs the compiled module; state (running
    statistics, num_batches_tracked) stays on the module, updated by the compiled graph."""

    def __init__(self, backend, c, kwargs, weight, bias):
        self.backend = backend
        super().__init__(backend.torch, c, kwargs, weight, bias)

    def _module_for(self, x):
        return self.backend.compiled(super()._module_for(x))


def make_backend() -> InductorBackend:
    return InductorBackend()


__all__ = ["InductorBackend", "make_backend"]
