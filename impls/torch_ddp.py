"""torch's data-parallel BatchNorm (DP) for the `torch` adapter: R processes joined by
`torch.distributed` (gloo on 127.0.0.1, NCCL when every rank has a GPU), each training
`torch.nn.BatchNorm1d/2d/3d` (or its `SyncBatchNorm` conversion) wrapped in
`DistributedDataParallel` with its defaults (broadcast_buffers=True: rank 0's buffers
are broadcast to every rank at the start of each forward).

The gradients before the all-reduce are read where DDP hands them to the collective: a
communication hook records each bucket's gradients and then runs torch's own default
hook (`allreduce_hook`: divide by the world size, all-reduce). Nothing is recomputed
outside DDP.

The parent side (`run`) uses impls/_replicas.py; the child side (`replica_setup`,
`replica_run`) runs in the replica processes.
"""

from __future__ import annotations

import datetime

from ._replicas import ReplicaError, ReplicaGroup, data_parallel_result, reraise
from ._torch_arrays import to_numpy, to_torch, torch_dtype

FIELDS = ("output", "grad_input", "replica_grad_weight", "replica_grad_bias", "grad_weight",
          "grad_bias", "running_mean", "running_var")


# ---------------------------------------------------------------- the adapter's side
class TorchReplicas:
    """The torch adapter's replica group, started at the first DP call and kept for the
    next ones with the same replica count."""

    def __init__(self):
        self.group: ReplicaGroup | None = None

    def run(self, steps, *, sync, eps, momentum, dtype, weight, bias, grad_outputs):
        world = len(steps[0])
        if self.group is None or self.group.world != world:
            if self.group is not None:
                self.group.close()
            self.group = ReplicaGroup(__name__, world, env={"OMP_NUM_THREADS": "1"})
        jobs = [dict(sync=sync, eps=eps, momentum=momentum, dtype=str(dtype), weight=weight,
                     bias=bias, shards=[step[r] for step in steps],
                     grads=None if grad_outputs is None else [g[r] for g in grad_outputs])
                for r in range(world)]
        try:
            answers = self.group.run(jobs)
        except ReplicaError as err:
            reraise(err)
        return data_parallel_result(answers, len(steps))

    def close(self):
        if self.group is not None:
            self.group.close()


# ---------------------------------------------------------------- the replicas' side
def replica_setup(rank: int, world: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if gpu:
        torch.cuda.set_device(rank)  # one GPU per rank, as NCCL expects
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    return {"device": f"cuda:{rank}" if gpu else "cpu", "gpu": gpu, "rank": rank}


def _module(job, device):
    import torch

    nn = torch.nn
    ndim = job["shards"][0].ndim
    cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}.get(ndim, nn.BatchNorm3d)
    c = job["weight"].shape[0]
    module = cls(c, eps=job["eps"], momentum=job["momentum"], dtype=torch_dtype(job["dtype"]))
    with torch.no_grad():
        module.weight.copy_(to_torch(job["weight"]))
        module.bias.copy_(to_torch(job["bias"]))
    if job["sync"]:
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return module.to(device)


def replica_run(state: dict, job: dict) -> dict:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    device = state["device"]
    module = _module(job, device)
    ddp = DistributedDataParallel(module, device_ids=[state["rank"]] if state["gpu"] else None)
    before: dict = {}

    def record_then_allreduce(process_group, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            before[id(p)] = to_numpy(g)
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, record_then_allreduce)
    out: dict = {f: [] for f in FIELDS}
    grads = job["grads"]
    for t, x in enumerate(job["shards"]):
        module.zero_grad(set_to_none=True)
        before.clear()
        x_t = to_torch(x, device).requires_grad_(grads is not None)
        if grads is None:
            with torch.no_grad():  # no backward, so no reduction for DDP to wait for
                y = ddp(x_t)
        else:
            y = ddp(x_t)
            y.backward(to_torch(grads[t], device))
            out["grad_input"].append(to_numpy(x_t.grad))
            out["replica_grad_weight"].append(before.get(id(module.weight)))
            out["replica_grad_bias"].append(before.get(id(module.bias)))
            out["grad_weight"].append(to_numpy(module.weight.grad))
            out["grad_bias"].append(to_numpy(module.bias.grad))
        out["output"].append(to_numpy(y))
        out["running_mean"].append(to_numpy(module.running_mean))
        out["running_var"].append(to_numpy(module.running_var))
    if grads is None:
        for f in FIELDS[1:6]:
            out[f] = None
    return out
