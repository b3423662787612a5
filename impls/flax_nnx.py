"""`jax`: Flax NNX LayerNorm, RMSNorm and BatchNorm, with jax.vjp for gradients.

Translations, and nothing else:
- momentum: the spec's a weights the new batch; Flax's momentum weights the old value,
  so Flax gets 1 - a.
- dtype: Flax's `dtype` (its output dtype) is set to the input dtype, as the protocol asks.
- layout: BatchNorm's channel axis is 1 (axis=1); several normalized axes become Flax
  reduction_axes/feature_axes with a flat scale of prod(normalized_shape) entries.
- modes: train()/eval() map to use_running_average; track_running_stats=False keeps
  batch statistics in eval (Flax has no such switch, so the adapter never asks for the
  running average) and reports no running statistics.
Flax's own defaults stay as they are (use_fast_variance=True among them): what they do
to the numbers is what normspec reports.

Data parallelism (DP): BatchNorm under shard_map over R host devices, in a process of
its own that sets XLA's device count before JAX starts (impls/flax_shard_map.py).
"""

from __future__ import annotations

import math

import numpy as np

from ._jax_executables import Executables, default_directory, software_and_machine, stable_text
from .protocol import (
    DTYPES,
    NORM_OPS,
    Backend,
    BackendUnavailable,
    BatchNormLayer,
    Capabilities,
    Conventions,
    FusedAddNormResult,
    Result,
)


def _import():
    try:
        import flax
        import jax
        import jax.numpy as jnp
        from flax import nnx
    except ImportError as exc:
        raise BackendUnavailable(f"jax/flax is not installed: {exc}") from exc
    jax.config.update("jax_enable_x64", True)  # float64 is one of the dtypes under test
    # the adapter keeps its compiled executables itself (impls/_jax_executables.py); an
    # executable from JAX's own cache would not serialize into a runnable one
    jax.config.update("jax_enable_compilation_cache", False)
    return flax, jax, jnp, nnx


def _exact(v):
    """A number as a template key: its type, its exact value and its text (repr alone
    depends on NumPy's print options: under legacy="1.25" np.float32(1e-5) prints as the
    float 1e-5 does)."""
    return type(v), float(v).hex(), repr(v)


def _np(a):
    return None if a is None else np.asarray(a).copy()


class FlaxBackend(Backend):
    name = "jax"
    capabilities = Capabilities(ops=NORM_OPS + ("fused_add_norm",), dtypes=DTYPES,
                                gradients={"layer_norm", "rms_norm", "batch_norm",
                                           "fused_add_norm"},
                                untracked_stats=True, data_parallel={"local", "sync"})
    conventions = Conventions(
        default_eps={"layer_norm": 1e-6, "rms_norm": 1e-6, "batch_norm": 1e-5},
        native_momentum="momentum=0.99 weights the old running value (1 - PyTorch's)",
        running_var_estimator="biased",
        momentum_held_as="old",
        half_compute_dtype="float32 (statistics promoted to at least float32)",
        single_value_batch="accepts",
        data_parallel_buffers="per_replica",
        fused_residual_sum="rounded",
        reasons={
            "fused_residual_sum": "Flax has no fused residual add + norm; the composition a "
                                  "model writes, r = x + residual, is an array of x's dtype "
                                  "before the norm module reads it",
            "data_parallel_buffers": "a shard_map/pmap training loop holds BatchNorm's "
                                     "statistics per replica and nothing synchronizes them "
                                     "unless the loop does (Flax's examples average them "
                                     "only before evaluation)",
            "running_var_estimator": "Flax NNX BatchNorm stores the biased batch variance "
                                     "(sum (x - mu)^2 / m) in its running variance; F4's "
                                     "update uses the unbiased m - 1 estimate.",
            "single_value_batch": "Flax BatchNorm trains on one value per channel without "
                                  "raising (the variance is 0, so the output is 0, or NaN "
                                  "with eps = 0); B3 describes PyTorch's refusal.",
        },
    )

    def __init__(self):
        self.flax, self.jax, self.jnp, self.nnx = _import()
        self.version = f"flax {self.flax.__version__}, jax {self.jax.__version__}"
        self._cache = {}
        self._templates = {}
        self._executables = Executables(self.jax, software_and_machine(self.jax, self.flax),
                                        default_directory())
        self._replicas = None

    def compile_seconds(self) -> float:
        """Tracing, lowering and compiling, or loading a stored executable instead."""
        return self._executables.seconds

    def data_parallel_batch_norm(self, steps, *, sync, eps, momentum, dtype, weight, bias,
                                 grad_outputs=None):
        """Flax BatchNorm under shard_map over len(steps[0]) host devices, momentum
        translated to Flax's 1 - a; see impls/flax_shard_map.py."""
        from .flax_shard_map import JaxReplicas

        if self._replicas is None:
            self._replicas = JaxReplicas()
        return self._replicas.run(steps, sync=sync, eps=eps, momentum=momentum, dtype=dtype,
                                  weight=weight, bias=bias, grad_outputs=grad_outputs)

    def _dev(self, a):
        """A NumPy array on JAX's CPU device, same dtype and values: a transfer.
        (jnp.asarray stages the array through a primitive that XLA compiles once per
        shape and dtype, ~30 ms each, paid for every new input shape.)"""
        return self.jax.device_put(np.asarray(a))

    def _rngs(self):
        return self.nnx.Rngs(0)

    def _fresh(self, key, make, *, abstract=False):
        """A new module as make() builds it, cloned from one built once per `key`, which
        names every argument make() passes (Flax's constructor costs ~1.5 ms a call and
        compiles its initializers for every new shape and dtype, ~30 ms each; a clone
        costs ~0.1 ms). With `abstract` the template is built by nnx.eval_shape, running
        no initializer at all: for modules whose every parameter the caller then sets,
        so no initial value is ever read (LayerNorm and RMSNorm here, whose gains are
        created only when given). Otherwise the clone holds Flax's own initial values
        (BatchNorm's running statistics)."""
        template = self._templates.get(key)
        if template is None:
            nnx = self.nnx
            template = self._templates[key] = nnx.eval_shape(make) if abstract else make()
        return self.nnx.clone(template)

    def _set(self, param, value, shape):
        """Set a Flax parameter from a NumPy array; None (an absent parameter) sets nothing."""
        if value is not None:
            param.set_value(self._dev(np.asarray(value).reshape(shape)))

    def _apply(self, module, x, grad_output, names, shape):
        """Run a stateless module; with grad_output, the VJP w.r.t. x and named params.

        The computation is jax.jit-compiled once per module configuration and input
        shape (XLA would otherwise compile every primitive separately for each new shape),
        which changes nothing about what Flax computes."""
        nnx = self.nnx
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        fn = self._compiled(graphdef, grad_output is not None)
        if grad_output is None:
            return Result(_np(fn(self._dev(x), params, rest)))
        y, (gx, gp) = fn(self._dev(x), params, rest, self._dev(grad_output))
        grads = [None if n is None else _np(gp[n].get_value()).reshape(shape) for n in names]
        return Result(_np(y), _np(gx), *grads)

    def _compiled(self, graphdef, with_grad):
        """The jitted forward of (x, params, rest) (and VJP of x and params given g);
        `rest`, the module's other state, is an argument, never a closed-over constant."""
        key = (graphdef, with_grad)
        fn = self._cache.get(key)
        if fn is None:
            jax, nnx = self.jax, self.nnx

            def forward(xv, pv, ov):
                return nnx.merge(graphdef, pv, ov)(xv)

            def forward_and_vjp(xv, pv, ov, g):
                y, vjp = jax.vjp(lambda a, b: forward(a, b, ov), xv, pv)
                return y, vjp(g)

            fn = self._cache[key] = self._jit(
                forward_and_vjp if with_grad else forward, "norm", with_grad, graphdef)
        return fn

    def _jit(self, f, *static):
        """jax.jit(f), its executables kept on disk under `static`: every value f's trace
        depends on besides its arguments (GraphDefs, Python numbers and flags). Arrays
        and module state are never closed over: they are arguments, so the key holds
        their shapes and dtypes and the executable takes their values."""
        return self._executables.function("\n".join(map(stable_text, static)), lambda: f)

    def _axes_kwargs(self, normalized_shape):
        axes = tuple(range(-len(normalized_shape), 0))
        return dict(reduction_axes=axes, feature_axes=axes), math.prod(normalized_shape)

    def _norm_module(self, op, dtype, shape, weight, bias, eps):
        """The Flax module for `op` over the trailing `shape` axes, gains set; and the
        names of its parameters whose gradients the protocol returns."""
        kw, n = self._axes_kwargs(shape)
        has_w, has_b = weight is not None, bias is not None
        if op == "layer_norm":
            def make():
                return self.nnx.LayerNorm(n, epsilon=eps, use_scale=has_w, use_bias=has_b,
                                          param_dtype=dtype, rngs=self._rngs(), **kw)
        else:
            def make():
                return self.nnx.RMSNorm(n, epsilon=eps, use_scale=has_w, param_dtype=dtype,
                                        rngs=self._rngs(), **kw)
        m = self._fresh((op, np.dtype(dtype), shape, has_w, has_b, _exact(eps)), make,
                        abstract=True)
        self._set(m.scale, weight, (n,))
        if has_b:  # (RMSNorm has no bias attribute: one given to it raises here)
            self._set(m.bias, bias, (n,))
        return m, ["scale" if has_w else None, "bias" if has_b else None]

    def layer_norm(self, x, normalized_shape, weight, bias, eps, grad_output=None):
        shape = tuple(normalized_shape)
        m, names = self._norm_module("layer_norm", x.dtype, shape, weight, bias, eps)
        return self._apply(m, x, grad_output, names, shape)

    def rms_norm(self, x, normalized_shape, weight, eps, grad_output=None):
        shape = tuple(normalized_shape)
        m, names = self._norm_module("rms_norm", x.dtype, shape, weight, None, eps)
        return self._apply(m, x, grad_output, names[:1], shape)

    def fused_add_norm(self, x, residual, norm, normalized_shape, weight, bias, eps,
                       grad_outputs=None):
        """The composition a Flax model writes: r = x + residual, y = nnx.RMSNorm or
        nnx.LayerNorm of r (jitted), jax.vjp through both outputs."""
        jax, nnx = self.jax, self.nnx
        shape = tuple(normalized_shape)
        m, names = self._norm_module(norm, x.dtype, shape, weight, bias, eps)
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        grads = grad_outputs is not None
        key = ("fused", graphdef, grads)
        fn = self._cache.get(key)
        if fn is None:
            def forward(xv, rv, pv, ov):
                r = xv + rv
                return nnx.merge(graphdef, pv, ov)(r), r

            def forward_and_vjp(xv, rv, pv, ov, gy, gr):
                out, vjp = jax.vjp(lambda a, b, c: forward(a, b, c, ov), xv, rv, pv)
                return out, vjp((gy, gr))

            fn = self._cache[key] = self._jit(forward_and_vjp if grads else forward,
                                              "fused", grads, graphdef)
        if not grads:
            y, r = fn(self._dev(x), self._dev(residual), params, rest)
            return FusedAddNormResult(_np(y), _np(r))
        (y, r), (gx, gres, gp) = fn(self._dev(x), self._dev(residual), params, rest,
                                    *(self._dev(g) for g in grad_outputs))
        gw, gb = (None if n is None else _np(gp[n].get_value()).reshape(shape)
                  for n in (names + [None])[:2])
        return FusedAddNormResult(_np(y), _np(r), _np(gx), _np(gres), gw, gb)

    def prepare_benchmark(self, op, x, normalized_shape, weight, bias, eps, grad_output=None):
        """The jitted op on device arrays made once, for `normspec bench`; it waits for
        the result (block_until_ready), so the time is the work, not its dispatch."""
        jax, jnp, nnx = self.jax, self.jnp, self.nnx
        m, _ = self._norm_module(op, x.dtype, tuple(normalized_shape), weight, bias, eps)
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        fn = self._compiled(graphdef, grad_output is not None)
        x_j = jnp.asarray(x)
        args = (x_j, params, rest) if grad_output is None else (
            x_j, params, rest, jnp.asarray(grad_output))
        return lambda: jax.block_until_ready(fn(*args))

    def qk_norm_scores(self, q, k, q_weight, k_weight, eps, scale):
        jnp, nnx, d = self.jnp, self.nnx, q.shape[-1]
        norms = []
        for w in (q_weight, k_weight):
            def make(has_w=w is not None):
                return nnx.RMSNorm(d, epsilon=eps, use_scale=has_w, param_dtype=q.dtype,
                                   rngs=self._rngs())
            m = self._fresh(("qk", np.dtype(q.dtype), d, w is not None, _exact(eps)), make,
                            abstract=True)
            self._set(m.scale, w, (d,))
            norms.append(nnx.split(m, nnx.Param, ...))
        key = ("qk", norms[0][0], norms[1][0], float(scale))
        fn = self._cache.get(key)
        if fn is None:
            gq, gk = norms[0][0], norms[1][0]

            def scores(qv, kv, pq, pk, oq, ok):
                q_hat = nnx.merge(gq, pq, oq)(qv)
                k_hat = nnx.merge(gk, pk, ok)(kv)
                s = jnp.matmul(q_hat, jnp.swapaxes(k_hat, -1, -2)) * jnp.asarray(scale, q_hat.dtype)
                return s.astype(qv.dtype)

            fn = self._cache[key] = self._jit(scores, "qk", float(scale), gq, gk)
        return _np(fn(self._dev(q), self._dev(k), norms[0][1], norms[1][1], norms[0][2],
                      norms[1][2]))

    def softcap(self, scores, cap):
        s = self.jnp.asarray(scores)
        return _np((cap * self.jnp.tanh(s / cap)).astype(s.dtype))

    def batch_norm(self, num_features, *, eps, momentum, affine, track_running_stats, dtype,
                   weight=None, bias=None):
        if momentum is None:
            raise NotImplementedError("Flax BatchNorm has no cumulative-average momentum")
        def make():
            return self.nnx.BatchNorm(num_features, axis=1, momentum=1.0 - momentum,
                                      epsilon=eps, use_bias=affine, use_scale=affine,
                                      dtype=np.dtype(dtype), param_dtype=np.dtype(dtype),
                                      rngs=self._rngs())
        m = self._fresh(("batch_norm", num_features, _exact(momentum), _exact(eps),
                         bool(affine), np.dtype(dtype)), make)
        if affine:
            self._set(m.scale, weight, (num_features,))
            self._set(m.bias, bias, (num_features,))
        if np.dtype(dtype) == np.float64:
            # Flax creates its running statistics in float32; a float64 layer's update
            # would cast float64 batch statistics into them, a cast JAX deprecates (a
            # FutureWarning now, an error in a future JAX). Holding them in the layer's
            # dtype, as a float64 user must, is configuration, not a change of formula.
            m.mean.set_value(self.jnp.zeros((num_features,), np.float64))
            m.var.set_value(self.jnp.ones((num_features,), np.float64))
        return FlaxBatchNorm(self, m, track_running_stats)


class FlaxBatchNorm(BatchNormLayer):
    def __init__(self, backend, module, track):
        self.b, self.module, self.track = backend, module, track
        self.training = True

    def _use_running_average(self):
        return (not self.training) and self.track

    def forward(self, x, grad_output=None):
        nnx = self.b.nnx
        graphdef, params, stats, rest = nnx.split(self.module, nnx.Param, nnx.BatchStat, ...)
        fn = self._compiled(graphdef, self._use_running_average(), grad_output is not None)
        if grad_output is None:
            y, new_stats = fn(self.b._dev(x), params, stats, rest)
            nnx.update(self.module, new_stats)
            return Result(_np(y))
        y, new_stats, (gx, gp, _) = fn(self.b._dev(x), params, stats, rest,
                                       self.b._dev(grad_output))
        nnx.update(self.module, new_stats)
        gw = _np(gp["scale"].get_value()) if "scale" in gp else None
        gb = _np(gp["bias"].get_value()) if "bias" in gp else None
        return Result(_np(y), _np(gx), gw, gb)

    def _compiled(self, graphdef, ura, with_grad):
        """The forward (and VJP) as one jitted function of (x, params, stats, rest);
        statistics go in as arguments so the forward may update them, and come back out."""
        key = ("bn", graphdef, ura, with_grad)
        fn = self.b._cache.get(key)
        if fn is None:
            jax, nnx = self.b.jax, self.b.nnx

            def forward(xv, pv, sv, ov):
                m = nnx.merge(graphdef, pv, sv, ov)
                return m(xv, use_running_average=ura), nnx.state(m, nnx.BatchStat)

            def forward_and_vjp(xv, pv, sv, ov, g):
                y, vjp, new_stats = jax.vjp(lambda a, b, c: forward(a, b, c, ov), xv, pv, sv,
                                            has_aux=True)
                return y, new_stats, vjp(g)

            fn = self.b._cache[key] = self.b._jit(forward_and_vjp if with_grad else forward,
                                                  "bn", ura, with_grad, graphdef)
        return fn

    @property
    def running_mean(self):
        return _np(self.module.mean.get_value()) if self.track else None

    @property
    def running_var(self):
        return _np(self.module.var.get_value()) if self.track else None


def make_backend() -> FlaxBackend:
    return FlaxBackend()
