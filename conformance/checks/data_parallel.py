"""Claim family DP (beyond the document): BatchNorm under data parallelism over R
replicas, on the backends' own distributed engines (`data_parallel_batch_norm`).

DP1: local BatchNorm is the oracle on each shard, and not the global batch (E4 split over
two replicas); DP2: cross-replica BatchNorm is the global-batch oracle, B3 applying to the
global count; DP3: running statistics between steps follow the declared buffer rule.

R is NORMSPEC_DP_REPLICAS (default 2; `normspec run --replicas R` sets it). The checks
run in float32 and float64 only: every call starts or drives R processes of the
framework, and what DP adds (how statistics are reduced across replicas) is the same in
every dtype; half-precision BatchNorm is F1/F4's.
"""

from __future__ import annotations

import os

import normspec.spec as spec
import numpy as np

from ..assertions import CheckFailure
from ..cases import ArraySpec, Literal
from ..context import Refused, Unsupported
from ..ops import DataParallelRun
from . import check
from .accumulation import E4_FIRST, E4_GRAD_FIRST, E4_GRAD_SECOND, E4_SECOND

REPLICAS_ENV = "NORMSPEC_DP_REPLICAS"
DP_DTYPES = ("float32", "float64")
C = 3


def parse_replicas(text: str) -> int:
    """A replica count from text: a whole number from 2 to 64."""
    try:
        r = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number of replicas") from None
    if not 2 <= r <= 64:
        raise ValueError(f"{text!r} replicas: give 2 to 64")
    return r


def replicas() -> int:
    return parse_replicas(os.environ.get(REPLICAS_ENV, "2"))


def _require(ctx, mode):
    if mode not in ctx.backend.capabilities.data_parallel:
        raise Unsupported(f"capabilities.data_parallel lists no {mode!r}")


def _shards(ctx, sizes, step=0, tail=(C, 2)):
    """Replica r's shard: its own mean and spread, so local and global statistics differ."""
    xs = [ArraySpec((n, *tail), ctx.seed + 100 * step + r, 0.5 * r - 0.25, 1.0 + 0.25 * r)
          for r, n in enumerate(sizes)]
    gs = [ArraySpec((n, *tail), ctx.seed + 100 * step + 50 + r, 0.0, 1.0)
          for r, n in enumerate(sizes)]
    return xs, gs


def _params(ctx):
    return (ArraySpec((C,), ctx.seed + 7, 1.0, 0.5), ArraySpec((C,), ctx.seed + 8, 0.0, 0.5))


def _sizes(kind, world):
    return [3] * world if kind == "equal" else [2 + r for r in range(world)]


#: eps and momentum per case, varied so that a backend ignoring either is caught
PARAMS = {"equal": dict(eps=1e-5, momentum=0.1), "unequal": dict(eps=1e-3, momentum=0.3)}


@check("DP1.local_per_shard", title="Local BatchNorm on R replicas is the oracle on each "
       "shard: outputs, dL/dx, gradients before and after the all-reduce, running statistics; "
       "one sample per replica raises (B3 per replica)", ops=("batch_norm",),
       needs=("data_parallel",), dtypes=DP_DTYPES)
def local_per_shard(ctx):
    world = replicas()
    for kind in ("equal", "unequal"):
        sizes = _sizes(kind, world)
        with ctx.case(f"R = {world}, {kind} shards {sizes}, {PARAMS[kind]}"):
            _require(ctx, "local")
            xs, gs = _shards(ctx, sizes)
            w, b = _params(ctx)
            run = DataParallelRun(ctx, sync=False, steps=[xs], grads=[gs], weight=w, bias=b,
                                  **PARAMS[kind])
            run.call()
            run.compare(0)
    with ctx.case(f"R = {world}, one sample [1, {C}] per replica"):
        _require(ctx, "local")
        xs, gs = _shards(ctx, [1] * world, tail=(C,))
        w, b = _params(ctx)
        run = DataParallelRun(ctx, sync=False, steps=[xs], grads=[gs], weight=w, bias=b)
        raised = run.raises()
        if ctx.convention("single_value_batch") == "accepts":
            ctx.holds(condition=raised is None, got=f"it raised {raised}",
                      spec_says="the backend declared single_value_batch = 'accepts'",
                      call=run.code)
            ctx.explain("got outputs and no error, but the spec says local BatchNorm on one "
                        f"value per channel raises on every replica (B3) [{run.code}]",
                        "single_value_batch")
        else:
            ctx.holds(condition=raised is not None, got="outputs and no error",
                      spec_says="each replica trains on one value per channel, which raises "
                                "(B3 per replica)", call=run.code)


@check("DP1.e4_split", title="E4 over two replicas ([0, 2] and [10, 12]): local BatchNorm "
       "is the oracle per shard and not the global batch (outputs, dL/dx, running "
       "statistics); cross-replica BatchNorm on the same shards is the global batch",
       ops=("batch_norm",), needs=("data_parallel",), dtypes=DP_DTYPES)
def e4_split(ctx):
    with ctx.case("E4, eps = 1e-5, gamma 1.5, beta 0.25, momentum 0.1, R = 2"):
        _require(ctx, "local")
        run = DataParallelRun(ctx, sync=False, steps=[[E4_FIRST, E4_SECOND]],
                              grads=[[E4_GRAD_FIRST, E4_GRAD_SECOND]],
                              weight=Literal(values=(1.5,)), bias=Literal(values=(0.25,)))
        res = run.call()
        run.compare(0)
        xs = [run.xs[0][0].astype(np.float64), run.xs[0][1].astype(np.float64)]
        gs = [run.gs[0][0].astype(np.float64), run.gs[0][1].astype(np.float64)]
        y, rm, _ = spec.batch_norm_train(np.concatenate(xs), np.zeros(1), np.ones(1),
                                         run.w64, run.b64, run.a, run.e)
        gx, _, _ = spec.batch_norm_train_vjp(np.concatenate(xs), np.concatenate(gs), run.w64,
                                             run.b64, run.e)
        ctx.oracle("y_global, rm_global, _ = spec.batch_norm_train(np.concatenate([x0_0, x0_1]), "
                   f"np.zeros(1), np.ones(1), weight, bias, {run.a!r}, {run.e!r})",
                   "show(np.concatenate(result.output[0]), y_global, name='local against global')")
        local_y = np.concatenate(res.output[0]).astype(np.float64)
        ctx.differs(first=y, second=local_y, scale=1.0, at_least=2.0,
                    what="local (per-replica) and global-batch outputs", call=run.code)
        ctx.differs(first=gx, second=np.concatenate(res.grad_input[0]).astype(np.float64),
                    scale=1.0, at_least=2.0, what="local and global-batch dL/dx", call=run.code)
        rms = [v.astype(np.float64) for v in res.running_mean[0]]
        ctx.differs(first=rms[0], second=rms[1], dtype=res.running_mean[0][0].dtype, scale=1.0,
                    at_least=2.0, what="the two replicas' running means",
                    call=f"{run.code}; result.running_mean[0]")
        ctx.differs(first=rm, second=rms[0], dtype=res.running_mean[0][0].dtype, scale=1.0,
                    at_least=2.0, what="replica 0's and the global batch's running mean",
                    call=f"{run.code}; result.running_mean[0][0]")
    with ctx.case("E4 with cross-replica BatchNorm: the global batch, R = 2"):
        _require(ctx, "sync")
        run = DataParallelRun(ctx, sync=True, steps=[[E4_FIRST, E4_SECOND]],
                              grads=[[E4_GRAD_FIRST, E4_GRAD_SECOND]],
                              weight=Literal(values=(1.5,)), bias=Literal(values=(0.25,)))
        _sync_call(ctx, run)
        run.compare(0)


def _sync_call(ctx, run):
    """The sync call; a declared refusal (torch's SyncBatchNorm on CPU) makes the case
    `refused` with the framework's message, and a declared refusal that does not happen
    is a fail: the convention is verified."""
    if not ctx.convention("sync_batch_norm_refused"):
        return run.call()
    message = run.raises()
    if message is not None:
        ctx.notes.append(ctx.reason("sync_batch_norm_refused"))
        raise Refused(message)
    ctx.holds(condition=False, got="a result",
              spec_says="the backend declared sync_batch_norm_refused = True", call=run.code)


@check("DP2.sync_global", title="Cross-replica BatchNorm is the global-batch oracle: outputs, "
       "dL/dx, gradients before and after the all-reduce, running mean and unbiased running "
       "variance from the global count, equal and unequal shards", ops=("batch_norm",),
       needs=("data_parallel",), dtypes=DP_DTYPES)
def sync_global(ctx):
    world = replicas()
    for kind in ("equal", "unequal"):
        sizes = _sizes(kind, world)
        with ctx.case(f"R = {world}, {kind} shards {sizes}, {PARAMS[kind]}"):
            _require(ctx, "sync")
            xs, gs = _shards(ctx, sizes)
            w, b = _params(ctx)
            run = DataParallelRun(ctx, sync=True, steps=[xs], grads=[gs], weight=w, bias=b,
                                  **PARAMS[kind])
            _sync_call(ctx, run)
            run.compare(0)


@check("DP2.global_count", title="B3 on the global count: one sample per replica trains with "
       "cross-replica statistics when the global batch has more (running variance unbiased "
       "from the global count R)", ops=("batch_norm",), needs=("data_parallel",),
       dtypes=DP_DTYPES)
def global_count(ctx):
    world = replicas()
    with ctx.case(f"R = {world}, one sample [1, {C}] per replica"):
        _require(ctx, "sync")
        xs, gs = _shards(ctx, [1] * world, tail=(C,))
        w, b = _params(ctx)
        run = DataParallelRun(ctx, sync=True, steps=[xs], grads=[gs], weight=w, bias=b)
        _sync_call(ctx, run)
        run.compare(0)


@check("DP3.buffers", title="Running statistics between steps follow the declared buffer "
       "rule (data_parallel_buffers): each replica's own, or replica 0's broadcast at every "
       "forward", ops=("batch_norm",), needs=("data_parallel",), dtypes=DP_DTYPES)
def buffers(ctx):
    world = replicas()
    rule = ctx.convention("data_parallel_buffers", "per_replica")
    other = "per_replica" if rule == "broadcast_rank0" else "broadcast_rank0"
    with ctx.case(f"R = {world}, local BatchNorm, two steps, momentum 0.5, declared {rule}"):
        _require(ctx, "local")
        sizes = [3] * world
        (x0, g0), (x1, g1) = _shards(ctx, sizes, 0), _shards(ctx, sizes, 1)
        w, b = _params(ctx)
        run = DataParallelRun(ctx, sync=False, steps=[x0, x1], grads=[g0, g1], weight=w, bias=b,
                              momentum=0.5)
        run.call()
        run.compare(0)
        try:
            run.compare(1, rule=rule)
        except CheckFailure as exc:
            if run.stats_follow(1, other):
                raise CheckFailure(f"{exc} (the running statistics follow {other!r}, but the "
                                   f"backend declared data_parallel_buffers = {rule!r})",
                                   measure=exc.measure) from None
            raise
