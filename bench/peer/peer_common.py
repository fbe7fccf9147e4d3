"""Shared by the PyTorch side of the peer benchmark: timing, result records, rank launch.

Every program prints its results as lines `PEER {json}`; bench/peer/compare.py collects
them from both libraries and prints one table. The timing method is the same one the C++
side (bench/peer/tessera_peer.cpp) uses, so the two columns are comparable:
  * per-op cost: calibrate a batch of calls to >= 20 ms, then the median over 9 batches;
  * multi-rank steps: barrier, time one call, repeat; rank 0's median.
"""
import json
import os
import socket
import statistics
import sys
import time

# Debian's PyTorch 2.6 is built without libuv: its TCPStore needs the classic backend (kept
# for pip's 2.15 too, which has libuv; it only carries the rendezvous).
os.environ.setdefault("USE_LIBUV", "0")


def emit(suite, case, variant, us, **extra):
    rec = {"suite": suite, "case": case, "impl": "pytorch", "variant": variant, "us": us}
    rec.update(extra)
    print("PEER " + json.dumps(rec), flush=True)


def per_call_us(fn, batches=9, min_batch_s=0.02):
    """Median cost of one call, in microseconds."""
    deadline = time.perf_counter() + 0.05
    calls = 0
    while calls < 20 or time.perf_counter() < deadline:
        fn()
        calls += 1
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_batch_s:
            break
        n *= 2
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def step_us(fn, iters, barrier):
    """Median over `iters` of one call started together on every rank (after a barrier)."""
    for _ in range(2):
        barrier()
        fn()
    samples = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, world, *args):
    """Runs worker(rank, world, *args) on `world` processes with a Gloo default group."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_entry, args=(worker, world, port, args), nprocs=world, join=True)


def multi_rank_main(worker):
    """Command line of the multi-rank programs: --ranks (processes) and --iters."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    launch(worker, a.ranks, a.iters)


def _entry(rank, worker, world, port, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    worker(rank, world, *args)
    # Every rank is done; leave without tearing down (a rank could stay blocked in Gloo's
    # and DDP's teardown after its peers had gone).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def element_bytes(t):
    return t.numel() * t.element_size()


class ByteCounter:
    """Bytes this rank sends in the collectives PyTorch issues, by the formulas Tessera's
    accounting uses (src/comm/collectives.cpp): all-gather (n-1)*in, ring all-reduce
    2(n-1)/n*in, reduce-scatter (n-1)/n*in, all-to-all everything but the own block.
    PyTorch's CommDebugMode counts calls only; this mode sees the same functional
    collectives and their tensors."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter._see(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()
        self.bytes = 0
        self.calls = {}

    def _see(self, func, args, kwargs):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        ns = func.namespace
        if ns not in ("_c10d_functional", "c10d_functional", "c10d"):
            return
        name = func.__name__.split(".")[0]
        if name in ("wait_tensor", "barrier", "monitored_barrier"):
            return
        self.calls[name] = self.calls.get(name, 0) + 1
        # c10d's tensor-to-tensor forms (FSDP2's) take the output first, the input second.
        t = args[1] if name in ("_allgather_base_", "_reduce_scatter_base_") else args[0]
        if isinstance(t, (list, tuple)):
            t = t[0]
        b = element_bytes(t)
        group = args[-1] if isinstance(args[-1], str) else None
        n = dist.get_world_size(_resolve_process_group(group)) if group else dist.get_world_size()
        # c10d spells them _allgather_base_, allreduce_, ...
        kind = name.lstrip("_").replace("allgather", "all_gather").replace("allreduce", "all_reduce")
        if kind.startswith("all_gather"):
            self.bytes += (n - 1) * b
        elif kind.startswith("all_reduce"):
            self.bytes += 2 * (n - 1) * b // n
        elif kind.startswith("reduce_scatter"):
            self.bytes += (n - 1) * b // n
        elif kind.startswith("all_to_all"):
            splits = args[2] if len(args) > 2 else None
            if splits:
                row = b // max(t.shape[0], 1)
                me = dist.get_rank(_resolve_process_group(group)) if group else dist.get_rank()
                self.bytes += (t.shape[0] - splits[me]) * row
            else:
                self.bytes += (n - 1) * b // n
        elif kind.startswith("broadcast"):
            self.bytes += (n - 1) * b if dist.get_rank() == 0 else 0

    def __enter__(self):
        self.bytes = 0
        self.calls = {}
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
