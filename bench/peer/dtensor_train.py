"""One data-parallel training step (forward, MSE loss, backward, Adam) of the peer MLP on
4 ranks (processes, Gloo): PyTorch DTensor with replicated parameters and a batch-sharded
input, and PyTorch DDP on the same local batches; a plain step on one rank's local batch
for scale. Mirrors `tessera_peer train`.
    python3 bench/peer/dtensor_train.py [--ranks 4] [--iters 20]
"""
import peer_common as pc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

# The peer MLP (same in tessera_peer.cpp): 64 -> 256 -> 256 -> 16, global batch 128.
IN, HIDDEN, OUT, BATCH = 64, 256, 16, 128


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, OUT))


def timed(rank, variant, model, x, y, iters):
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)

    def step():
        adam.zero_grad()
        # PyTorch's DTensor has no sharding strategy for aten.mse_loss (2.6): both sides spell
        # the same loss out.
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        adam.step()

    step()  # optimizer state outside the timing
    counter = pc.ByteCounter()
    with counter, CommDebugMode() as cdm:
        step()
    us = pc.step_us(step, iters, dist.barrier)
    extra = dict(bytes=counter.bytes, calls=cdm.get_total_counts(),
                 collectives={str(k): v for k, v in cdm.get_comm_counts().items()})
    if variant == "ddp":
        # DDP's reducer all-reduces its gradient buckets below the dispatcher, where neither
        # CommDebugMode nor the byte counter sees them: one ring all-reduce of every gradient
        # byte (the MLP's 0.33 MiB fit one bucket).
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        world = dist.get_world_size()
        extra = dict(bytes=2 * (world - 1) * grad_bytes // world, calls=1,
                     collectives={"all_reduce (reducer bucket)": 1})
    if rank == 0:
        pc.emit("train", "MLP step, data parallel", variant, us, **extra)


def worker(rank, world, iters):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, IN), torch.randn(BATCH, OUT)
    local = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

    timed(rank, "plain", mlp(), x[local], y[local], iters)  # one rank's share, no comm

    model = distribute_module(mlp(), mesh)  # parameters replicated
    dx = distribute_tensor(x, mesh, [Shard(0)])
    dy = distribute_tensor(y, mesh, [Shard(0)])
    timed(rank, "dist", model, dx, dy, iters)

    ddp = nn.parallel.DistributedDataParallel(mlp())
    timed(rank, "ddp", ddp, x[local], y[local], iters)


if __name__ == "__main__":
    pc.multi_rank_main(worker)
