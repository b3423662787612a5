"""`torch`: torch.nn.LayerNorm, torch.nn.RMSNorm and torch.nn.BatchNorm1d/2d/3d (by
input rank), torch.nn.TransformerEncoderLayer / TransformerEncoder for the F8 wirings,
with autograd for gradients. Conventions already match the spec's
(momentum weights the new batch, eps inside the sqrt), so nothing is translated but the
array type.

Data parallelism (DP) runs in replica processes of its own (impls/torch_ddp.py):
DistributedDataParallel over plain BatchNorm ("local") or SyncBatchNorm ("sync")."""

from __future__ import annotations

import dataclasses

from ._torch_arrays import to_numpy, to_torch, torch_dtype
from .protocol import (
    DTYPES,
    OPS,
    Backend,
    BackendUnavailable,
    BatchNormLayer,
    Capabilities,
    Conventions,
    FusedAddNormResult,
    Result,
)


def _import_torch():
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailable(f"torch is not installed: {exc}") from exc
    return torch


def _copy_param(param, value):
    if param is None or value is None:
        return
    import torch

    with torch.no_grad():
        param.copy_(to_torch(value))


def _grads(module, x_t, y, grad_output, *names):
    y.backward(to_torch(grad_output))
    out = [to_numpy(x_t.grad)]
    for n in names:  # a name None: a parameter the caller did not pass
        p = None if n is None else getattr(module, n, None)
        out.append(None if p is None else to_numpy(p.grad))
    return out


class TorchBackend(Backend):
    name = "torch"
    capabilities = Capabilities(ops=OPS, dtypes=DTYPES,
                                op_dtypes={"encoder_layer": {"float32", "float64"}},
                                gradients={"layer_norm", "rms_norm", "batch_norm",
                                           "encoder_layer", "fused_add_norm"},
                                no_grad_mode=True, cumulative_momentum=True, untracked_stats=True,
                                data_parallel={"local", "sync"})
    conventions = Conventions(
        default_eps={"layer_norm": 1e-5, "rms_norm": "None: torch.finfo(x.dtype).eps",
                     "batch_norm": 1e-5},
        native_momentum="momentum=0.1 weights the new batch; None is a cumulative average",
        running_var_estimator="unbiased",
        eps_zero={"layer_norm": True, "rms_norm": True, "qk_norm_scores": True,
                  "batch_norm": False},
        half_compute_dtype="float32 (CPU kernels accumulate in float)",
        data_parallel_buffers="broadcast_rank0",
        fused_residual_sum="rounded",
        reasons={"fused_residual_sum": "torch has no fused residual add + norm op; the "
                                       "composition users write, r = x + residual, holds "
                                       "the sum as a tensor of x's dtype before the norm",
                 "data_parallel_buffers": "DistributedDataParallel(broadcast_buffers=True), "
                                          "its default, broadcasts rank 0's buffers to every "
                                          "rank at the start of each forward"},
    )

    def __init__(self):
        self.torch = _import_torch()
        self.version = self.torch.__version__
        self._replicas = None
        if not self.torch.cuda.is_available():
            reasons = dict(self.conventions.reasons, sync_batch_norm_refused=(
                "torch.nn.SyncBatchNorm needs GPU modules: DistributedDataParallel refuses a "
                "CPU one when it is built ('SyncBatchNorm layers only work with GPU modules'), "
                "and SyncBatchNorm's own forward refuses CPU tensors; this machine has no GPU"))
            self.conventions = dataclasses.replace(self.conventions, sync_batch_norm_refused=True,
                                                   reasons=reasons)

    def compile_seconds(self) -> float:
        """Eager torch runs kernels built with torch: nothing is compiled."""
        return 0.0

    def data_parallel_batch_norm(self, steps, *, sync, eps, momentum, dtype, weight, bias,
                                 grad_outputs=None):
        """DistributedDataParallel over BatchNorm (SyncBatchNorm with sync) in
        len(steps[0]) processes; see impls/torch_ddp.py."""
        from .torch_ddp import TorchReplicas

        if self._replicas is None:
            self._replicas = TorchReplicas()
        return self._replicas.run(steps, sync=sync, eps=eps, momentum=momentum, dtype=dtype,
                                  weight=weight, bias=bias, grad_outputs=grad_outputs)

    def _input(self, x):
        return to_torch(x).requires_grad_(True)

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        nn = self.torch.nn
        # nn.LayerNorm holds beta only beside gamma: beta alone is gamma = ones (its
        # initial value, which multiplies exactly), and gamma's gradient not returned
        m = nn.LayerNorm(tuple(normalized_shape), eps=eps,
                         elementwise_affine=weight is not None or bias is not None,
                         bias=bias is not None, dtype=torch_dtype(x.dtype))
        _copy_param(m.weight, weight)
        _copy_param(m.bias, bias)
        return self._run(m, x, grad_output, "weight" if weight is not None else None, "bias")

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        m = self.torch.nn.RMSNorm(tuple(normalized_shape), eps=eps,
                                  elementwise_affine=weight is not None,
                                  dtype=torch_dtype(x.dtype))
        _copy_param(m.weight, weight)
        return self._run(m, x, grad_output, "weight")

    def _run(self, module, x, grad_output, *names):
        x_t = self._input(x)
        y = module(x_t)
        if grad_output is None:
            return Result(to_numpy(y))
        return Result(to_numpy(y), *_grads(module, x_t, y, grad_output, *names))

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        torch, d = self.torch, q.shape[-1]
        dt = torch_dtype(q.dtype)
        q_norm = torch.nn.RMSNorm(d, eps=eps, elementwise_affine=q_weight is not None, dtype=dt)
        k_norm = torch.nn.RMSNorm(d, eps=eps, elementwise_affine=k_weight is not None, dtype=dt)
        _copy_param(q_norm.weight, q_weight)
        _copy_param(k_norm.weight, k_weight)
        with torch.no_grad():
            s = q_norm(to_torch(q)) @ k_norm(to_torch(k)).transpose(-1, -2) * scale
        return to_numpy(s)

    def prepare_benchmark(self, op, x, normalized_shape, weight, bias, eps, grad_output=None):
        """The op on tensors made once, for `normspec bench` (conversions not timed)."""
        torch, fn = self.torch, self.torch.nn.functional
        backward = grad_output is not None
        x_t, g = to_torch(x), to_torch(grad_output)
        w = to_torch(weight).requires_grad_(backward)
        b = to_torch(bias).requires_grad_(backward) if bias is not None else None
        if op == "layer_norm":
            def f(v):
                return fn.layer_norm(v, normalized_shape, w, b, eps)
        else:
            def f(v):
                return fn.rms_norm(v, normalized_shape, w, eps)
        if not backward:
            def run():
                with torch.no_grad():
                    f(x_t)
            return run
        x_t.requires_grad_(True)

        def run_backward():
            x_t.grad = w.grad = None
            if b is not None:  # else every call after the first adds into the last's
                b.grad = None
            f(x_t).backward(g)
        return run_backward

    def encoder_layer(self, x, params, num_heads, *, norm_first, activation, eps, num_layers=1,
                      final_norm=None, grad_output=None):
        """torch.nn.TransformerEncoderLayer(dropout=0, batch_first=True), stacked by
        torch.nn.TransformerEncoder (norm=LayerNorm when final_norm is given) for more
        layers or a final norm; weights loaded by their state_dict names. Training mode,
        so the forward is the composite one autograd differentiates."""
        nn = self.torch.nn
        dt = torch_dtype(x.dtype)
        d_model, d_ff = x.shape[-1], params["linear1.weight"].shape[0]
        layer = nn.TransformerEncoderLayer(d_model, num_heads, d_ff, dropout=0.0,
                                           activation=activation, layer_norm_eps=eps,
                                           batch_first=True, norm_first=norm_first, dtype=dt)
        layer.load_state_dict({k: to_torch(v) for k, v in params.items()})
        module = layer
        if num_layers > 1 or final_norm is not None:
            norm = None
            if final_norm is not None:
                norm = nn.LayerNorm(d_model, eps=eps, dtype=dt)
                norm.load_state_dict({k: to_torch(v) for k, v in final_norm.items()})
            module = nn.TransformerEncoder(layer, num_layers, norm=norm,
                                           enable_nested_tensor=False)
        module.train()
        x_t = to_torch(x).requires_grad_(grad_output is not None)
        y = module(x_t)
        if grad_output is None:
            return Result(to_numpy(y))
        y.backward(to_torch(grad_output))
        return Result(to_numpy(y), to_numpy(x_t.grad))

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        """The eager composition: r = x + residual; y = F.rms_norm(r, ...) or
        F.layer_norm(r, ...), autograd through both outputs."""
        fn, grads = self.torch.nn.functional, grad_outputs is not None
        x_t, r_t = to_torch(x).requires_grad_(grads), to_torch(residual).requires_grad_(grads)
        w = None if weight is None else to_torch(weight).requires_grad_(grads)
        b = None if bias is None else to_torch(bias).requires_grad_(grads)
        r = x_t + r_t
        shape = tuple(normalized_shape)
        y = fn.rms_norm(r, shape, w, eps) if norm == "rms_norm" else \
            fn.layer_norm(r, shape, w, b, eps)
        if not grads:
            return FusedAddNormResult(to_numpy(y), to_numpy(r))
        self.torch.autograd.backward([y, r], [to_torch(g) for g in grad_outputs])
        return FusedAddNormResult(to_numpy(y), to_numpy(r), to_numpy(x_t.grad),
                                  to_numpy(r_t.grad), None if w is None else to_numpy(w.grad),
                                  None if b is None else to_numpy(b.grad))

    def softcap(self, scores, cap):
        s = to_torch(scores)
        return to_numpy(cap * self.torch.tanh(s / cap))

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        return TorchBatchNorm(self.torch, num_features, dict(
            eps=eps, momentum=momentum, affine=affine, track_running_stats=track_running_stats,
            dtype=torch_dtype(dtype)), weight, bias)


class TorchBatchNorm(BatchNormLayer):
    """One torch module whose class follows the input rank (1d for [N,C] and [N,C,L],
    2d for [N,C,H,W], 3d beyond); state carries over when the rank changes."""

    def __init__(self, torch, c, kwargs, weight, bias):
        self.torch, self.c, self.kwargs = torch, c, kwargs
        self.module = torch.nn.BatchNorm1d(c, **kwargs)
        _copy_param(self.module.weight, weight)
        _copy_param(self.module.bias, bias)
        self.training = True

    def _module_for(self, x):
        nn = self.torch.nn
        cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}.get(x.ndim, nn.BatchNorm3d)
        if type(self.module) is not cls:
            new = cls(self.c, **self.kwargs)
            new.load_state_dict(self.module.state_dict())
            self.module = new
        self.module.train(self.training)
        return self.module

    def forward(self, x, grad_output=None):
        m = self._module_for(x)
        x_t = to_torch(x).requires_grad_(grad_output is not None)
        # the protocol returns this forward's gradients; torch would add them to the last
        m.zero_grad(set_to_none=True)
        y = m(x_t)
        if grad_output is None:
            return Result(to_numpy(y))
        return Result(to_numpy(y), *_grads(m, x_t, y, grad_output, "weight", "bias"))

    def forward_no_grad(self, x):
        m = self._module_for(x)
        with self.torch.no_grad():
            return to_numpy(m(to_torch(x)))

    @property
    def running_mean(self):
        return to_numpy(self.module.running_mean)

    @property
    def running_var(self):
        return to_numpy(self.module.running_var)

    @property
    def num_batches_tracked(self):
        count = self.module.num_batches_tracked
        return None if count is None else int(count)


def make_backend() -> TorchBackend:
    return TorchBackend()


__all__ = ["TorchBackend", "make_backend"]
