"""Per-op cost of PyTorch's DTensor on a 1-rank mesh (all of its wrapper, propagation and
cache work, no communication) next to the same plain op. Mirrors `tessera_peer ops`.
    python3 bench/peer/dtensor_ops.py
"""
import peer_common as pc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    a, b, m = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Shard(0)])
    dm = distribute_tensor(m, mesh, [Replicate()])
    v, w = torch.randn(16), torch.randn(16)
    dv = distribute_tensor(v, mesh, [Shard(0)])
    dw = distribute_tensor(w, mesh, [Shard(0)])

    cases = {
        "add 8x8": (lambda: torch.add(a, b), lambda: torch.add(da, db)),
        "add 16": (lambda: torch.add(v, w), lambda: torch.add(dv, dw)),
        "mul scalar 8x8": (lambda: a * 2.0, lambda: da * 2.0),
        "sum 8x8": (lambda: a.sum(), lambda: da.sum()),
        "mm 8x8": (lambda: torch.mm(a, m), lambda: torch.mm(da, dm)),
        "view 8x8": (lambda: a.view(64), lambda: da.view(64)),
        "detach 8x8": (lambda: a.detach(), lambda: da.detach()),
        "add_ 8x8": (lambda: a.add_(b, alpha=0.0), lambda: da.add_(db, alpha=0.0)),
    }
    with torch.no_grad():
        for name, (plain, distributed) in cases.items():
            pc.emit("ops", name, "plain", pc.per_call_us(plain))
            pc.emit("ops", name, "dist", pc.per_call_us(distributed))

    for variant in ("plain", "dist"):
        params = []
        for _ in range(50):
            p = torch.randn(16, 16)
            g = torch.randn(16, 16)
            if variant == "dist":
                p = distribute_tensor(p, mesh, [Replicate()])
                g = distribute_tensor(g, mesh, [Replicate()])
            p = torch.nn.Parameter(p)
            p.grad = g
            params.append(p)
        # foreach=False: LibTorch's Adam is the per-parameter loop; compare like with like.
        adam = torch.optim.Adam(params, lr=1e-3, foreach=False)
        adam.step()  # state allocation outside the timing
        pc.emit("ops", "adam step 50x16x16", variant, pc.per_call_us(adam.step, batches=5))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
