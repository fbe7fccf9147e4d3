"""Data parallelism, PyTorch's side: one training step (forward, MSE loss, backward, Adam) of
the peer MLP on --ranks processes (Gloo), each rank on its own local batch:
  * ddp:   torch.nn.parallel.DistributedDataParallel (default buckets, 25 MiB / 1 MiB);
  * fsdp2: torch.distributed.fsdp.fully_shard on each Linear, then on the root (1-D mesh);
  * plain: the model alone on one rank's local batch, no communication (scale).
Mirrors `tessera_peer dp`. Per variant: step time, collectives of one step, and the peak of
CPU allocator bytes during one step (see peak_step_bytes).
    python3 bench/peer/dtensor_dp.py [--ranks 4] [--iters 20]

FSDP2 on CPU in PyTorch 2.6 needs two things (see fsdp2_cpu_shim / FSDP2_OPTIONS):
  * torch.cpu.Stream has no record_event / wait_event / wait_stream, which FSDP2 calls; on CPU
    every op is synchronous, so no-ops are exact (2.15 has its own, which are kept);
  * with reshard_after_forward=True backward fails on CPU ("modified by an inplace
    operation"), so parameters stay unsharded from forward to backward (resharded after it).
    2.15 runs it, but the option stays False on every version: Tessera's fully_shard rows
    use reshard_after_forward(false) too.
"""
import gc

import peer_common as pc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

# The peer MLP (same in dtensor_train.py and tessera_peer.cpp): 64 -> 256 -> 256 -> 16,
# global batch 128, split evenly over the ranks.
IN, HIDDEN, OUT, BATCH = 64, 256, 16, 128
FSDP2_OPTIONS = dict(reshard_after_forward=False)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, OUT))


def fsdp2_cpu_shim():
    import torch.cpu as torch_cpu

    shims = dict(record_event=lambda self, event=None: torch_cpu.Event(),
                 wait_event=lambda self, event: None,
                 wait_stream=lambda self, stream: None)
    for name, fn in shims.items():
        if not hasattr(torch_cpu.Stream, name):  # PyTorch 2.15 has all three
            setattr(torch_cpu.Stream, name, fn)


def build(variant, mesh):
    model = mlp()
    if variant == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **FSDP2_OPTIONS)
        fully_shard(model, mesh=mesh, **FSDP2_OPTIONS)
    return model


def local_batch(rank, world):
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, IN), torch.randn(BATCH, OUT)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return x[rows].clone(), y[rows].clone()  # the global batch itself is not kept


def make_step(model, x, y):
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)

    def step():
        adam.zero_grad()  # set_to_none, as LibTorch's
        (model(x) - y).pow(2).mean().backward()
        adam.step()

    return step


def peak_step_bytes(rank, world, variant, mesh):
    """(peak, start): the highest live CPU allocator bytes during one step (the third), and
    those live when it starts, counting every allocation made since this variant began
    (model, optimizer state, local batch, communication buffers). PyTorch's profiler with
    profile_memory=True reports each CPU allocation and free of this thread; live bytes are
    their running sum."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        model = build(variant, mesh)
        step = make_step(model, *local_batch(rank, world))
        step()
        step()
        with torch.profiler.record_function("measured_step"):
            step()
    events = prof.profiler.kineto_results.events()
    marker = next(e for e in events if e.name() == "measured_step")
    live, start, peak = 0, None, 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        if start is None and e.start_ns() >= marker.start_ns():
            start = peak = live
        live += e.nbytes()
        if start is not None and e.start_ns() <= marker.end_ns():
            peak = max(peak, live)
    return peak, start


def measure(rank, world, variant, mesh, iters):
    peak, start = peak_step_bytes(rank, world, variant, mesh)
    gc.collect()
    model = build(variant, mesh)
    step = make_step(model, *local_batch(rank, world))
    step()  # optimizer state outside the timing
    counter = pc.ByteCounter()
    with counter, CommDebugMode() as cdm:
        step()
    us = pc.step_us(step, iters, dist.barrier)
    extra = dict(bytes=counter.bytes, calls=cdm.get_total_counts(),
                 collectives={str(k): v for k, v in cdm.get_comm_counts().items()})
    if variant == "ddp":
        # DDP's reducer all-reduces its buckets below the dispatcher, unseen by CommDebugMode:
        # one ring all-reduce of every gradient byte (the MLP's 0.33 MiB fit one bucket).
        grad_bytes = sum(pc.element_bytes(p) for p in model.parameters())
        extra = dict(bytes=2 * (world - 1) * grad_bytes // world, calls=1,
                     collectives={"all_reduce (reducer bucket)": 1})
    if rank == 0:
        pc.emit("dp", f"MLP step, {world} ranks", variant, us, ranks=world, mem_peak=peak,
                mem_start=start, **extra)


def worker(rank, world, iters):
    fsdp2_cpu_shim()
    mesh = init_device_mesh("cpu", (world,))
    for variant in ("plain", "ddp", "fsdp2"):
        measure(rank, world, variant, mesh, iters)
        gc.collect()


if __name__ == "__main__":
    pc.multi_rank_main(worker)
