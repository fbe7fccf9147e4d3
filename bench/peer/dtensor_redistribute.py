"""PyTorch DTensor redistribute on 4 ranks (processes, Gloo over loopback): S(0)->R,
S(0)->S(1), P->R, P->S(0), R->S(0), at 0.25 and 4 MiB per rank, with even shards and with
chunk-uneven ones (global rows 4k-3: the uneven layout DTensor supports). Reports rank 0's
median time and the bytes this rank sent. Mirrors `tessera_peer redistribute`.
    python3 bench/peer/dtensor_redistribute.py [--ranks 4] [--iters 20]
"""
import peer_common as pc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

COLS = 256  # float32 rows of 1 KiB
SIZES = {"0.25MiB": 256, "4MiB": 4096}  # rows per rank


def settle(t):
    """Waits for the collective behind a DTensor result (funcol results may be lazy)."""
    local = t.to_local()
    if hasattr(local, "wait"):
        local = local.wait()
    return local


def worker(rank, world, iters):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    for size, rows in SIZES.items():
        for layout, global_rows in (("even", rows * world), ("uneven", rows * world - 3)):
            full = torch.randn(global_rows, COLS)
            s0 = distribute_tensor(full, mesh, [Shard(0)])
            rep = distribute_tensor(full, mesh, [Replicate()])
            part = DTensor.from_local(full / world, mesh, [Partial()], run_check=False)
            cases = {
                "S(0)->R": (s0, [Replicate()]),
                "S(0)->S(1)": (s0, [Shard(1)]),
                "P->R": (part, [Replicate()]),
                "P->S(0)": (part, [Shard(0)]),
                "R->S(0)": (rep, [Shard(0)]),
            }
            for name, (src, dst) in cases.items():
                fn = lambda: settle(src.redistribute(mesh, dst))
                counter = pc.ByteCounter()
                with counter, CommDebugMode() as cdm:
                    fn()
                us = pc.step_us(fn, iters, dist.barrier)
                if rank == 0:
                    pc.emit("redistribute", f"{name} {size} {layout}", "dist", us,
                            bytes=counter.bytes, calls=cdm.get_total_counts(),
                            collectives={str(k): v for k, v in cdm.get_comm_counts().items()})


if __name__ == "__main__":
    pc.multi_rank_main(worker)
