"""Runs the peer benchmark: PyTorch's DTensor (bench/peer/dtensor_*.py) and Tessera's
matching C++ programs (bench/peer/tessera_peer.cpp) one after the other on this machine, and
prints one side-by-side table per suite (markdown) with ratios.

Normally started through bench/peer/run.sh: inside the Debian 13 root where PyTorch 2.6 and
LibTorch 2.6 are both installed, or, with PEER_PYTHON, on this host with that interpreter's
torch (e.g. pip's 2.15 in a venv). The PyTorch programs run with the interpreter that runs
this script. Directly:
    python3 bench/peer/compare.py [--build build] [--ranks 4] [--iters 20] [--only ops,train]
                                  [--json results.json]

A suite is a name, the PyTorch command(s), the Tessera command(s) and how to print its rows;
later work adds a Suite line and the programs behind it. The tp suite runs on 2 and --ranks
processes, the dp suite on 1, 2 and --ranks.
Each program prints `PEER {json}` lines: suite, case, impl, variant, us, and optionally
bytes / calls / collectives, and (dp) ranks / mem_peak / mem_start.
"""
import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, List

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Suite:
    name: str
    title: str
    pytorch: Callable[[argparse.Namespace], List[str]]
    tessera: Callable[[argparse.Namespace], List[str]]
    table: Callable[[str, list], str]


def run(cmd):
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, USE_LIBUV="0", OMP_NUM_THREADS="1")
    # Warnings (e.g. DTensor's "CPU process group does not support alltoall yet", once per
    # call) are kept out of the table; they are shown if the program fails.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"compare: {' '.join(cmd)} failed with exit code {proc.returncode}")
    out = proc.stdout
    recs = []
    for line in out.splitlines():
        if line.startswith("PEER "):
            recs.append(json.loads(line[5:]))
    return recs


def run_all(cmds):
    """One command, or a list of commands (a suite over several rank counts)."""
    if cmds and isinstance(cmds[0], list):
        return [r for cmd in cmds for r in run(cmd)]
    return run(cmds)


def fmt_us(us):
    if us is None:
        return "-"
    return f"{us:,.1f}" if us < 1000 else f"{us:,.0f}"


def fmt_bytes(b):
    if b is None:
        return "-"
    if b >= 1 << 20:
        return f"{b / (1 << 20):.2f} MiB"
    if b >= 1 << 10:
        return f"{b / (1 << 10):.1f} KiB"
    return f"{b} B"


def us_cell(r):
    """A record's time, or `failed` where the program reported an error for it."""
    if r and r.get("error"):
        return "failed"
    return fmt_us(r and r["us"])


def pick(recs, impl, case, variant):
    for r in recs:
        if r["impl"] == impl and r["case"] == case and r["variant"] == variant:
            return r
    return None


def cases_of(recs):
    seen = []
    for r in recs:
        if r["case"] not in seen:
            seen.append(r["case"])
    return seen


def ops_table(title, recs):
    rows = [f"### {title}", "",
            "| op | PyTorch plain µs | PyTorch DTensor µs | DTensor / plain | "
            "Tessera plain µs | Tessera µs | Tessera / plain | Tessera / DTensor |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case in cases_of(recs):
        pp, pd = pick(recs, "pytorch", case, "plain"), pick(recs, "pytorch", case, "dist")
        tp, td = pick(recs, "tessera", case, "plain"), pick(recs, "tessera", case, "dist")
        ratio = lambda a, b: f"{a['us'] / b['us']:.2f}x" if a and b else "-"
        rows.append(f"| {case} | {fmt_us(pp and pp['us'])} | {fmt_us(pd and pd['us'])} | "
                    f"{ratio(pd, pp)} | {fmt_us(tp and tp['us'])} | {fmt_us(td and td['us'])} | "
                    f"{ratio(td, tp)} | {ratio(td, pd)} |")
    return "\n".join(rows)


def comm_table(title, recs, variants=("dist",)):
    rows = [f"### {title}", "",
            "| case | variant | PyTorch µs | Tessera µs | Tessera / PyTorch | PyTorch sent | "
            "Tessera sent | PyTorch collectives | Tessera collectives |",
            "|---|---|---:|---:|---:|---:|---:|---|---|"]
    colls = lambda r: (", ".join(f"{k.split('.')[-1]} {v}" for k, v in
                                 sorted(r.get("collectives", {}).items())) or "none") if r else "-"
    for case in cases_of(recs):
        for variant in variants:
            p, t = pick(recs, "pytorch", case, variant), pick(recs, "tessera", case, variant)
            if not p and not t:
                continue
            ratio = f"{t['us'] / p['us']:.2f}x" if p and t and p["us"] and t["us"] else "-"
            rows.append(f"| {case} | {variant} | {us_cell(p)} | {us_cell(t)} | {ratio} | "
                        f"{fmt_bytes(p.get('bytes') if p else None)} | "
                        f"{fmt_bytes(t.get('bytes') if t else None)} | {colls(p)} | {colls(t)} |")
    return "\n".join(rows)


# The dp suite's rows per rank count: (impl, variant, label, the PyTorch row it is compared
# with). A row nobody reported (a side that failed or was not run) is printed as "missing".
DP_ROWS = [
    ("pytorch", "plain", "PyTorch plain (local batch, no comm)", None),
    ("pytorch", "ddp", "PyTorch DDP", None),
    ("pytorch", "fsdp2", "PyTorch FSDP2 (fully_shard)", None),
    ("tessera", "plain", "Tessera plain (local batch, no comm)", "plain"),
    ("tessera", "replicate", "Tessera replicate, distributed inputs", "ddp"),
    ("tessera", "replicate local", "Tessera replicate, local_batches(true)", "ddp"),
    ("tessera", "fully_shard", "Tessera fully_shard, distributed inputs", "fsdp2"),
]


def dp_table(title, recs):
    rows = [f"### {title}", "",
            "| ranks | implementation | step µs | vs PyTorch | peak MiB / rank | vs PyTorch | "
            "live at step start MiB | sent / step | collectives / step |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    mib = lambda b: "-" if b is None else f"{b / (1 << 20):.3f}"
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
    colls = lambda r: ", ".join(f"{k.split('.')[-1]} {v}" for k, v in
                                sorted(r.get("collectives", {}).items())) or "none"
    for ranks in sorted({r["ranks"] for r in recs if "ranks" in r}):
        case = f"MLP step, {ranks} ranks"
        for impl, variant, label, against in DP_ROWS:
            r = pick(recs, impl, case, variant)
            if not r:
                rows.append(f"| {ranks} | {label} | missing | - | missing | - | - | - | - |")
                continue
            p = pick(recs, "pytorch", case, against) if against else None
            rows.append(
                f"| {ranks} | {label} | {us_cell(r)} | {ratio(r['us'], p and p['us'])} | "
                f"{mib(r.get('mem_peak'))} | {ratio(r.get('mem_peak'), p and p.get('mem_peak'))} | "
                f"{mib(r.get('mem_start'))} | {fmt_bytes(r.get('bytes'))} | {colls(r)} |")
    rows += ["", "vs PyTorch: Tessera / PyTorch in this run; plain against PyTorch plain, "
             "replicate against DDP, fully_shard against FSDP2. Memory: rank 0's CPU allocator "
             "bytes, counted from before the model was built (dtensor_dp.py, tessera_peer dp)."]
    return "\n".join(rows)


def py(script, extra):
    return lambda a: [sys.executable, os.path.join(HERE, script), *extra(a)]


def multi(a):
    return ["--ranks", str(a.ranks), "--iters", str(a.iters)]


def tessera_multi(sub, ranks=None):
    return lambda a: [os.path.join(a.build, "tessera-run"), "-n", str(ranks or a.ranks),
                      "--no-prefix", os.path.join(a.build, "bench", "tessera_peer"), sub,
                      "--iters", str(a.iters)]


def over_dp_sizes(command):
    """`command(a, ranks)` once per data-parallel size: 1, 2 and --ranks."""
    return lambda a: [command(a, n) for n in sorted({1, 2, a.ranks})]


def over_tp_sizes(command):
    """`command(a, ranks)` once per tensor-parallel size: 2 and --ranks."""
    return lambda a: [command(a, n) for n in sorted({2, a.ranks})]


SUITES = [
    Suite("ops", "Per-op cost on a 1-rank mesh (no communication)",
          py("dtensor_ops.py", lambda a: []),
          lambda a: [os.path.join(a.build, "bench", "tessera_peer"), "ops"],
          ops_table),
    Suite("redistribute", "Redistribute on 4 ranks (processes, Gloo over loopback)",
          py("dtensor_redistribute.py", multi), tessera_multi("redistribute"),
          comm_table),
    Suite("train", "One data-parallel MLP training step on 4 ranks (processes, Gloo)",
          py("dtensor_train.py", multi), tessera_multi("train"),
          lambda t, r: comm_table(t, r, variants=("plain", "dist", "ddp"))),
    Suite("tp", "One tensor-parallel Llama training step, torchtitan's plan (2 and --ranks "
          "processes, Gloo)",
          over_tp_sizes(lambda a, n: py("dtensor_tp.py", lambda a: ["--ranks", str(n),
                                                                  "--iters", str(a.iters)])(a)),
          over_tp_sizes(lambda a, n: tessera_multi("tp", n)(a)),
          lambda t, r: comm_table(t, r, variants=("plain", "tp", "tp+sp"))),
    Suite("dp", "Data-parallel MLP step, DDP / FSDP2 vs Tessera replicate / fully_shard (1, 2 and --ranks "
          "processes, Gloo)",
          over_dp_sizes(lambda a, n: py("dtensor_dp.py", lambda a: ["--ranks", str(n),
                                                                  "--iters", str(a.iters)])(a)),
          over_dp_sizes(lambda a, n: tessera_multi("dp", n)(a)),
          dp_table),
]


def libtorch_version(build):
    """The version of the LibTorch the Tessera build folder was configured against."""
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            torch_dir = next(l.split("=", 1)[1].strip() for l in f if l.startswith("Torch_DIR:"))
        with open(os.path.join(torch_dir, "TorchConfigVersion.cmake")) as f:
            return next(l.split('"')[1] for l in f if "PACKAGE_VERSION \"" in l)
    except (OSError, StopIteration, IndexError):
        return "unknown"


def load():
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", default="build", help="Tessera build folder")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated suite names")
    ap.add_argument("--json", default="", help="also write every record here")
    a = ap.parse_args()
    only = [s for s in a.only.split(",") if s]
    import torch

    header = (f"PyTorch {torch.__version__} ({sys.executable}), Tessera against LibTorch "
              f"{libtorch_version(a.build)} ({a.build}); {os.cpu_count()} cores; "
              f"1 intra-op thread per process; load average (1/5/15 min) at start {load()}")
    every, out = [], [header, ""]
    for s in SUITES:
        if only and s.name not in only:
            continue
        before = load()
        recs = run_all(s.pytorch(a)) + run_all(s.tessera(a))
        every += recs
        out += [s.table(s.title, recs), "",
                f"Load average (1/5/15 min) before / after this suite: {before} / {load()}", ""]
    errors = [f"- {r['impl']} {r['case']} {r['variant']}: {r['error']}" for r in every
              if r.get("error")]
    if errors:
        out += ["Failed cases:", *errors, ""]
    out.append(f"Load average (1/5/15 min) at the end: {load()}")
    print("\n".join(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(every, f, indent=1)


if __name__ == "__main__":
    main()
