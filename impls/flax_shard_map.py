"""JAX's data-parallel BatchNorm (DP) for the `jax` adapter: Flax NNX `BatchNorm` under
`jax.shard_map` over R host devices, in a process of its own.

XLA fixes the number of host devices when JAX starts
(`XLA_FLAGS=--xla_force_host_platform_device_count=R`), and the adapter's process
started JAX long before, with one device. So the data-parallel call runs in a replica
process (impls/_replicas.py, one rank) whose environment sets that flag before JAX
starts; it is kept for the next calls with the same R.

The training step is written the way a pmap/shard_map training loop is: the global
batch and its output gradient are split along the batch axis (P("replica")), the
parameters and the running statistics are held per replica (a leading replica axis, as
replicated state is in such loops), each replica takes the VJP of its own forward, and
`jax.lax.pmean` is the gradient all-reduce. "sync" is `BatchNorm(axis_name="replica")`,
whose statistics are means over the replicas (`lax.pmean`); "local" has no axis_name.

shard_map splits the global batch evenly; unequal shards are run the way JAX code does
it: every shard padded with zero rows to the largest, and BatchNorm's `mask` argument
marking the real rows (the padding's outputs and gradients are dropped). Measured with
flax 0.12.8: with axis_name, Flax averages each replica's masked mean (and mean square)
with `lax.pmean`, weighting replicas equally rather than by their real rows, so
cross-replica statistics of unequal shards are not the global batch's (DP2 reports it).
"""

from __future__ import annotations

import numpy as np

from ._jax_executables import stable_text
from ._replicas import ReplicaError, ReplicaGroup, reraise
from .protocol import DataParallelResult

AXIS = "replica"


# ---------------------------------------------------------------- the adapter's side
class JaxReplicas:
    def __init__(self):
        self.group: ReplicaGroup | None = None

    def run(self, steps, *, sync, eps, momentum, dtype, weight, bias, grad_outputs):
        world = len(steps[0])
        if self.group is None or self.group.env["NORMSPEC_DP_DEVICES"] != str(world):
            if self.group is not None:
                self.group.close()
            import os

            flags = os.environ.get("XLA_FLAGS", "")
            self.group = ReplicaGroup(__name__, 1, env={
                "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={world}".strip(),
                "JAX_PLATFORMS": "cpu", "NORMSPEC_DP_DEVICES": str(world)})
        job = dict(sync=sync, eps=eps, momentum=momentum, dtype=str(dtype), weight=weight,
                   bias=bias, steps=steps, grads=grad_outputs)
        try:
            (answer,) = self.group.run([job])
        except ReplicaError as err:
            reraise(err)
        return DataParallelResult(**answer)  # one process answers for every replica

    def close(self):
        if self.group is not None:
            self.group.close()


# ---------------------------------------------------------------- the replica's side
def replica_setup(rank: int, world: int, port: int) -> dict:
    import warnings

    import flax
    import jax

    from ._jax_executables import Executables, default_directory, software_and_machine

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_enable_compilation_cache", False)  # as the adapter's process
    warnings.filterwarnings("ignore", message="scatter inputs have incompatible types",
                            category=FutureWarning)
    salt = software_and_machine(jax, flax, __file__)
    return {"cache": {}, "executables": Executables(jax, salt, default_directory())}


def _lead(v):
    """A replica's value as its slice of the stacked [replica, ...] result."""
    return v[None]


def _step_fn(graphdef, world, with_grad, masked):
    """The shard_map'ed training step of (x, g, mask, params, stats); `mask` (the
    real rows of padded shards) is None when the shards are equal."""
    import jax
    from flax import nnx
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:world]), (AXIS,))
    tree = jax.tree_util.tree_map

    def one_replica(x, g, mask, p, s):
        p, s = tree(lambda v: v[0], p), tree(lambda v: v[0], s)  # this replica's copy

        def forward(xv, pv, sv):  # the statistics go in as an argument, to come out updated
            m = nnx.merge(graphdef, pv, sv)
            return m(xv, use_running_average=False, mask=mask), nnx.state(m, nnx.BatchStat)

        if not with_grad:
            y, new_s = forward(x, p, s)
            return y, tree(_lead, new_s)
        y, vjp, new_s = jax.vjp(forward, x, p, s, has_aux=True)
        gx, gp, _ = vjp(g)
        gp_mean = jax.lax.pmean(gp, AXIS)  # the gradient all-reduce
        return y, tree(_lead, new_s), gx, tree(_lead, gp), tree(_lead, gp_mean)

    spec = P(AXIS)

    def step(x, g, mask, p, s):
        args = [x] + ([g] if with_grad else []) + ([mask] if masked else []) + [p, s]

        def body(*a):
            a = list(a)
            xv, gv = a.pop(0), (a.pop(0) if with_grad else None)
            mv = a.pop(0) if masked else None
            return one_replica(xv, gv, mv, *a)

        outs = (spec,) * (5 if with_grad else 2)
        return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=outs)(*args)

    return step


def replica_run(state: dict, job: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    steps, grads, world = job["steps"], job["grads"], len(job["steps"][0])
    dtype = np.dtype(job["dtype"]) if job["dtype"] != "bfloat16" else jnp.bfloat16
    c = job["weight"].shape[0]
    module = nnx.BatchNorm(c, axis=1, momentum=1.0 - job["momentum"], epsilon=job["eps"],
                           dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0),
                           axis_name=AXIS if job["sync"] else None)
    module.scale.set_value(jnp.asarray(job["weight"]))
    module.bias.set_value(jnp.asarray(job["bias"]))
    graphdef, params, stats = nnx.split(module, nnx.Param, nnx.BatchStat)
    sizes = [[x.shape[0] for x in step] for step in steps]
    n = max(max(row) for row in sizes)
    masked = any(size != n for row in sizes for size in row)
    # one cached function per configuration; it keeps an executable per input shape
    static = stable_text((graphdef, world, grads is not None, masked))
    fn = state["cache"].get(static)
    if fn is None:
        fn = state["cache"][static] = state["executables"].function(
            static, lambda: _step_fn(graphdef, world, grads is not None, masked))
    # replicated state, as a data-parallel loop holds it: one copy per replica
    params, stats = (jax.tree_util.tree_map(lambda v: jnp.stack([v] * world), tree)
                     for tree in (params, stats))
    out: dict = {k: [] for k in ("output", "grad_input", "replica_grad_weight",
                                 "replica_grad_bias", "grad_weight", "grad_bias",
                                 "running_mean", "running_var")}
    def pad(shards):  # every shard to n rows (zeros), as one global batch
        return jnp.asarray(np.concatenate([
            np.concatenate([a, np.zeros((n - a.shape[0], *a.shape[1:]), a.dtype)]) for a in shards]))

    def split(a, t):  # the global batch's rows, back into the replicas' (real) rows
        return [np.asarray(a[r * n:r * n + sizes[t][r]]).copy() for r in range(world)]

    def per(a):  # the stacked per-replica values, one array each
        return [np.asarray(a[r]).copy() for r in range(world)]
    for t, shards in enumerate(steps):
        mask = None
        if masked:
            rows = np.concatenate([np.arange(n) < size for size in sizes[t]])
            mask = jnp.asarray(np.broadcast_to(rows.reshape((-1,) + (1,) * (shards[0].ndim - 1)),
                                               (n * world, *shards[0].shape[1:])))
        x = pad(shards)
        if grads is None:
            y, stats = fn(x, None, mask, params, stats)
        else:
            y, stats, gx, gp, gp_mean = fn(x, pad(grads[t]), mask, params, stats)
            out["grad_input"].append(split(gx, t))
            out["replica_grad_weight"].append(per(gp["scale"].get_value()))
            out["replica_grad_bias"].append(per(gp["bias"].get_value()))
            out["grad_weight"].append(per(gp_mean["scale"].get_value()))
            out["grad_bias"].append(per(gp_mean["bias"].get_value()))
        out["output"].append(split(y, t))
        out["running_mean"].append(per(stats["mean"].get_value()))
        out["running_var"].append(per(stats["var"].get_value()))
    if grads is None:
        for k in ("grad_input", "replica_grad_weight", "replica_grad_bias", "grad_weight",
                  "grad_bias"):
            out[k] = None
    return out  # every field [step][replica]
