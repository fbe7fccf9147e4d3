"""PyTorch's side of bench_gpu (bench/bench_gpu.cpp) on the same GPU: the same cases, timing
method and JSON records. bench/gpu_compare.sh runs both and merges them
(bench/peer/gpu_report.py).
    python3 bench/peer/gpu_peer.py [--out pytorch_gpu.json] [--only ops,na2d,steps]

  * ops: DTensor per-op cost on a 1-rank mesh (NCCL, a process group of one, set up inside
    this script), Replicate and Shard(0), next to the plain CUDA tensor.
  * steps: one training step of the same MLP: plain, FSDP2 (fully_shard on each Linear, then
    the root) and tensor parallel (ColwiseParallel / RowwiseParallel).
  * na2d: 2-D neighbourhood attention (NATTEN's window: k x k, shifted inward at the borders,
    dilation 1, stride 1) by flex_attention (torch.compile'd, as its documentation asks) with
    a block mask from the window rule, and by dense scaled_dot_product_attention with the same
    mask as an additive bias (memory-efficient kernel); forward and forward+backward, float32
    and bfloat16. Last, as its compiles take the longest.

Timing, as bench_gpu: per-op, batches of back-to-back calls closed by a synchronize,
calibrated to >= --batch-ms, median over --batches of time / calls; na2d and steps, --warmup
untimed calls, then each call between two synchronizes, median of --iters (fewer once a case
passes --case-budget-s). Compilation happens in the warm-up and is not timed. Without a CUDA
device it prints "no CUDA device: skipped" and exits 0; --device cpu runs the same cases on
CPU over Gloo to check the program (not a benchmark).
"""
import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time


def free_port():
    # Not peer_common's: importing it sets USE_LIBUV=0, which Debian's torch 2.6 needs and a
    # pip torch (with libuv) does not.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg):
    print(f"gpu_peer: {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, args, device, meta):
        import torch

        self.torch = torch
        self.a = args
        self.device = device
        self.meta = meta
        self.records = []
        self.started = time.perf_counter()

    def doc(self):
        return {"impl": "pytorch", "meta": dict(self.meta, seconds=time.perf_counter() - self.started),
                "records": self.records}

    def save(self):
        """Every row rewrites --out: a run cut short by a time limit leaves what it measured."""
        if self.a.out:
            with open(self.a.out, "w") as f:
                json.dump(self.doc(), f, indent=2)

    # -- timing -------------------------------------------------------------------------
    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def per_call_us(self, fn):
        a = self.a
        self.sync()
        t0 = time.perf_counter()
        calls = 0
        while calls < 20 or time.perf_counter() - t0 < 0.02:
            fn()
            calls += 1
        self.sync()
        n = 1
        while True:
            t = time.perf_counter()
            for _ in range(n):
                fn()
            self.sync()
            if (time.perf_counter() - t) * 1e3 >= a.batch_ms or n >= a.max_batch:
                break
            n *= 2
        samples = []
        for _ in range(a.batches):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            self.sync()
            samples.append((time.perf_counter() - t) / n * 1e6)
        return statistics.median(samples)

    def per_step_ms(self, fn):
        a = self.a
        for _ in range(a.warmup):
            fn()
        self.sync()
        samples = []
        start = time.perf_counter()
        for _ in range(a.iters):
            t = time.perf_counter()
            fn()
            self.sync()
            samples.append((time.perf_counter() - t) * 1e3)
            if len(samples) >= 3 and time.perf_counter() - start > a.case_budget_s:
                break
        return statistics.median(samples)

    # -- records ------------------------------------------------------------------------
    def add(self, suite, case, variant, dtype, unit, value=None, error=None, method=None):
        rec = {"suite": suite, "case": case, "impl": "pytorch", "variant": variant,
               "dtype": dtype, "unit": unit, "value": value}
        if method:
            rec["method"] = method
        if error:
            rec["error"] = error
        self.records.append(rec)
        self.save()
        what = f"{value:12.3f} {unit}" if value is not None else error
        log(f"{suite:6} {case:34} {(method or '') + ' ' + variant:28} {dtype:9} {what}")

    def run(self, suite, case, variant, dtype, unit, timed, method=None):
        """Runs timed(); a failing case is a row with its error, not the end of the run."""
        if time.perf_counter() - self.started > self.a.budget_s:
            self.add(suite, case, variant, dtype, unit, None,
                     f"skipped: past the run's budget of {self.a.budget_s:.0f} s", method)
            return
        try:
            value = timed()
        except Exception as e:  # noqa: BLE001 (reported in the table)
            msg = str(e).strip().splitlines()
            msg = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
            self.add(suite, case, variant, dtype, unit, None, msg, method)
            if self.device == "cuda":
                self.torch.cuda.empty_cache()
            return
        self.add(suite, case, variant, dtype, unit, value, None, method)

    def table(self):
        lines = [f"{'suite':6} {'case':34} {'method':18} {'variant':12} {'dtype':9} {'value':>14} {'vs plain':>9}"]
        plain = {(r["suite"], r["case"], r["dtype"], r.get("method")): r["value"]
                 for r in self.records if r["variant"] == "plain" and r["value"] is not None}
        for r in self.records:
            if r["value"] is None:
                lines.append(f"{r['suite']:6} {r['case']:34} {r.get('method') or '':18} {r['variant']:12} "
                             f"{r['dtype']:9} {'-':>14}  ({r.get('error')})")
                continue
            p = plain.get((r["suite"], r["case"], r["dtype"], r.get("method")))
            ratio = f"{r['value'] / p:.2f}x" if p and r["variant"] != "plain" else ""
            lines.append(f"{r['suite']:6} {r['case']:34} {r.get('method') or '':18} {r['variant']:12} "
                         f"{r['dtype']:9} {r['value']:11.3f} {r['unit']:2} {ratio:>9}")
        return "\n".join(lines)


# -- per-op cost -------------------------------------------------------------------------
def per_op_costs(b, mesh):
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    dev = b.device
    torch.manual_seed(0)
    cases = [  # name, make(a, b) -> callable, rows, cols, mm's right-hand side replicated
        ("add 64x64", lambda x, y: (lambda: torch.add(x, y)), 64, 64, False),
        ("add 1024x1024", lambda x, y: (lambda: torch.add(x, y)), 1024, 1024, False),
        ("mul 64x64", lambda x, y: (lambda: torch.mul(x, y)), 64, 64, False),
        ("matmul 64x64", lambda x, y: (lambda: torch.matmul(x, y)), 64, 64, True),
        ("matmul 1024x1024", lambda x, y: (lambda: torch.matmul(x, y)), 1024, 1024, True),
        ("view 64x64 -> 4096", lambda x, y: (lambda: x.view(4096)), 64, 64, False),
        ("reshape 64x64 -> 32x128", lambda x, y: (lambda: x.reshape(32, 128)), 64, 64, False),
        ("sum 64x64", lambda x, y: (lambda: x.sum()), 64, 64, False),
        ("sum 1024x1024", lambda x, y: (lambda: x.sum()), 1024, 1024, False),
    ]
    placements = {"R": [Replicate()], "S(0)": [Shard(0)]}
    for name, make, rows, cols, rhs_replicated in cases:
        x = torch.randn(rows, cols, device=dev)
        y = torch.randn(rows, cols, device=dev)
        b.run("ops", name, "plain", "float32", "us", lambda: b.per_call_us(make(x, y)))
        for variant, p in placements.items():
            def timed(p=p):
                dx = distribute_tensor(x, mesh, p)
                dy = distribute_tensor(y, mesh, [Replicate()] if rhs_replicated else p)
                return b.per_call_us(make(dx, dy))
            b.run("ops", name, variant, "float32", "us", timed)

    # Linear 1024 -> 1024, batch 64: forward, then backward of the output with a given
    # gradient (parameter gradients accumulate, the same on every variant).
    for variant in ("plain", "R", "S(0)"):
        def timed(variant=variant):
            torch.manual_seed(1)
            lin = torch.nn.Linear(1024, 1024).to(dev)
            x = torch.randn(64, 1024, device=dev)
            g = torch.randn(64, 1024, device=dev)
            if variant != "plain":
                distribute_module(lin, mesh)  # parameters Replicate
                x = distribute_tensor(x, mesh, placements[variant])
                g = distribute_tensor(g, mesh, placements[variant])
            return b.per_call_us(lambda: lin(x).backward(g))
        b.run("ops", "Linear 1024 fwd+bwd, batch 64", variant, "float32", "us", timed)

    # Adam over 16 parameters of 256x256; foreach=False: LibTorch's Adam is the
    # per-parameter loop, compare like with like.
    for variant in ("plain", "R", "S(0)"):
        def timed(variant=variant):
            torch.manual_seed(2)
            params = []
            for _ in range(16):
                p = torch.randn(256, 256, device=dev)
                g = torch.randn(256, 256, device=dev)
                if variant != "plain":
                    p = distribute_tensor(p, mesh, placements[variant])
                    g = distribute_tensor(g, mesh, placements[variant])
                p = torch.nn.Parameter(p)
                p.grad = g
                params.append(p)
            adam = torch.optim.Adam(params, lr=1e-3, foreach=False)
            adam.step()  # state allocation outside the timing
            return b.per_call_us(adam.step)
        b.run("ops", "Adam step, 16 x 256x256", variant, "float32", "us", timed)


# -- neighbourhood attention -------------------------------------------------------------
def axis_window_start(i, length, k):
    """NATTEN's window along one axis (dilation 1, stride 1, not causal): query i sees keys
    [start, start + k), start = clamp(i - k // 2, 0, length - k): shifted inward at borders."""
    import torch

    return torch.clamp(i - k // 2, 0, length - k)


def na_mask_mod(size, k):
    """flex_attention mask_mod over row-major tokens of a size x size field."""
    def mask(b, h, q_idx, kv_idx):
        qr, qc = q_idx // size, q_idx % size
        kr, kc = kv_idx // size, kv_idx % size
        r0 = axis_window_start(qr, size, k)
        c0 = axis_window_start(qc, size, k)
        return (kr >= r0) & (kr < r0 + k) & (kc >= c0) & (kc < c0 + k)
    return mask


def na_dense_bias(size, k, dtype, device):
    """0 inside each query's neighbourhood, -inf outside: [N, N], N = size^2 (the dense
    comparison's additive mask; a constant of the layer, built outside the timing)."""
    import torch

    i = torch.arange(size, device=device)
    start = axis_window_start(i, size, k).view(size, 1)
    axis = (i.view(1, size) >= start) & (i.view(1, size) < start + k)  # [L, L]
    n = size * size
    allowed = (axis.view(size, 1, size, 1) & axis.view(1, size, 1, size)).reshape(n, n)
    bias = torch.zeros(n, n, dtype=dtype, device=device)
    return bias.masked_fill_(allowed.logical_not(), float("-inf"))


def na2d_cases(b):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    a, dev = b.a, b.device
    for name in ("recompile_limit", "cache_size_limit"):  # every size and dtype compiles once
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
            break
    flex = torch.compile(flex_attention, dynamic=False) if a.compile else flex_attention
    k, heads, hd = a.na_kernel, a.na_heads, a.na_head_dim
    for size in a.na_sizes:
        for dtype, dname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            case = f"na2d {size}x{size} k{k} h{heads} d{hd}"
            n = size * size
            torch.manual_seed(3)
            # Heads-first [B, H, N, D], each library's native layout (na2d's is heads-last).
            q, kk, v, g = (torch.randn(1, heads, n, hd, device=dev).to(dtype) for _ in range(4))
            block_mask = None
            try:
                block_mask = create_block_mask(na_mask_mod(size, k), None, None, n, n, device=dev)
            except Exception as e:  # noqa: BLE001
                for variant in ("fwd", "fwd+bwd"):
                    b.add("na2d", case, variant, dname, "ms", None,
                          f"create_block_mask: {type(e).__name__}: {e}"[:300], "flex_attention")
            methods = []
            if block_mask is not None:
                methods.append(("flex_attention", lambda q, kk, v: flex(q, kk, v, block_mask=block_mask)))
            bias = None
            if size <= a.dense_max_size:
                methods.append(("sdpa dense mask",
                                lambda q, kk, v: F.scaled_dot_product_attention(q, kk, v, attn_mask=bias)))
            else:
                for variant in ("fwd", "fwd+bwd"):
                    b.add("na2d", case, variant, dname, "ms", None,
                          f"not run: field over --dense-max-size {a.dense_max_size}", "sdpa dense mask")
            for method, attn in methods:
                if method == "sdpa dense mask":
                    try:
                        bias = na_dense_bias(size, k, dtype, dev)
                    except Exception as e:  # noqa: BLE001 (out of memory, say)
                        for variant in ("fwd", "fwd+bwd"):
                            b.add("na2d", case, variant, dname, "ms", None,
                                  f"mask: {type(e).__name__}: {e}"[:300], method)
                        continue

                def backend(method=method):
                    # Dense on CUDA: the memory-efficient kernel (it takes an arbitrary mask);
                    # never the math path, which would hold the [H, N, N] scores.
                    if method == "sdpa dense mask" and dev == "cuda":
                        return sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)
                    return contextlib.nullcontext()

                def fwd(attn=attn, backend=backend):
                    with torch.no_grad(), backend():
                        return b.per_step_ms(lambda: attn(q, kk, v))

                def both(attn=attn, backend=backend):
                    ql, kl, vl = (t.detach().requires_grad_() for t in (q, kk, v))

                    def step():
                        ql.grad = kl.grad = vl.grad = None
                        attn(ql, kl, vl).backward(g)
                    with backend():
                        return b.per_step_ms(step)
                b.run("na2d", case, "fwd", dname, "ms", fwd, method)
                b.run("na2d", case, "fwd+bwd", dname, "ms", both, method)
                if method == "sdpa dense mask" and block_mask is not None:
                    # The two masks agree: flex_attention's output against dense SDPA's.
                    try:
                        with torch.no_grad(), backend():
                            diff = (flex(q, kk, v, block_mask=block_mask).float()
                                    - attn(q, kk, v).float()).abs().max().item()
                        b.meta.setdefault("checks", []).append(
                            {"case": case, "dtype": dname, "max_abs_diff_flex_vs_dense": diff})
                        log(f"check {case} {dname}: max |flex - dense| = {diff:.2e}")
                    except Exception as e:  # noqa: BLE001
                        log(f"check {case} {dname}: {type(e).__name__}: {e}")
                bias = None
            del block_mask
            if dev == "cuda":
                torch.cuda.empty_cache()


# -- training steps ------------------------------------------------------------------------
def step_cases(b, mesh):
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    a, dev = b.a, b.device
    case = f"MLP {a.mlp_in}-{a.mlp_hidden}-{a.mlp_out} step, batch {a.mlp_batch}"

    def mlp():
        torch.manual_seed(4)
        return torch.nn.Sequential(torch.nn.Linear(a.mlp_in, a.mlp_hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(a.mlp_hidden, a.mlp_out)).to(dev)

    torch.manual_seed(5)
    x = torch.randn(a.mlp_batch, a.mlp_in, device=dev)
    y = torch.randn(a.mlp_batch, a.mlp_out, device=dev)

    def timed(model):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)

        def step():
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
        return b.per_step_ms(step)

    b.run("step", case, "plain", "float32", "ms", lambda: timed(mlp()))

    def fsdp():
        model = mlp()
        for child in model:
            if isinstance(child, torch.nn.Linear):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return timed(model)
    b.run("step", case, "fully_shard", "float32", "ms", fsdp)

    def tp():
        model = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return timed(model)
    b.run("step", case, "tp", "float32", "ms", tp)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the results as JSON to this file")
    ap.add_argument("--format", choices=("table", "json"), default="table", help="stdout")
    ap.add_argument("--only", default="ops,na2d,steps", help="suites, comma-separated")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu only checks the program where there is no GPU (Gloo, not a benchmark)")
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--batch-ms", type=float, default=10)
    ap.add_argument("--max-batch", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--case-budget-s", type=float, default=3)
    ap.add_argument("--budget-s", type=float, default=95,
                    help="cases that start after this many seconds are reported as skipped")
    ap.add_argument("--na-sizes", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--na-kernel", type=int, default=7)
    ap.add_argument("--na-heads", type=int, default=4)
    ap.add_argument("--na-head-dim", type=int, default=32)
    ap.add_argument("--dense-max-size", type=int, default=256,
                    help="largest field for dense SDPA (its [N, N] mask: 16 GiB at 256 float32)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="flex_attention eager (slow; for checking the program)")
    ap.add_argument("--mlp-in", type=int, default=1024)
    ap.add_argument("--mlp-hidden", type=int, default=4096)
    ap.add_argument("--mlp-out", type=int, default=1024)
    ap.add_argument("--mlp-batch", type=int, default=256)
    a = ap.parse_args()
    suites = set(a.only.split(","))

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    meta = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_peer: no CUDA device: skipped", flush=True)
        if a.out:
            meta["skipped"] = "no CUDA device"
            with open(a.out, "w") as f:
                json.dump({"impl": "pytorch", "meta": meta, "records": []}, f, indent=2)
        return 0
    if a.device == "cuda":
        torch.cuda.set_device(0)
        meta["device_name"] = torch.cuda.get_device_name(0)
        meta["cuda_devices"] = torch.cuda.device_count()
    meta["device"] = a.device
    meta["timing"] = {"per_op": {"batches": a.batches, "batch_ms": a.batch_ms, "max_batch": a.max_batch},
                      "per_step": {"warmup": a.warmup, "iters": a.iters, "case_budget_s": a.case_budget_s},
                      "flex_attention": "torch.compile(dynamic=False)" if a.compile else "eager"}

    # A process group of one: NCCL on the GPU (Gloo for --device cpu).
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ["RANK"] = "0"
    os.environ["WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    meta["budget_s"] = a.budget_s
    b = Bench(a, a.device, meta)
    mesh = None
    try:
        if a.device == "cuda":
            dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group("gloo")
        mesh = init_device_mesh(a.device, (1,))
    except Exception as e:  # noqa: BLE001
        log(f"no 1-rank mesh: {e}")
        b.meta["mesh_error"] = str(e)[:300]
    if "ops" in suites:
        per_op_costs(b, mesh)  # without a mesh the distributed rows carry the error
    if "steps" in suites:
        step_cases(b, mesh)
    if "na2d" in suites:  # last: its compiles take the longest
        na2d_cases(b)
    b.sync()
    b.save()
    print(json.dumps(b.doc(), indent=2) if a.format == "json" else b.table(), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
