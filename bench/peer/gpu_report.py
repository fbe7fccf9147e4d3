"""Merges one run of bench_gpu (Tessera) and bench/peer/gpu_peer.py (PyTorch) into one JSON
file and markdown tables for BENCHMARKS.md. Ratios are taken between the two files of the
same run (bench/gpu_compare.sh runs both back to back on the same GPU).
    python3 bench/peer/gpu_report.py --tessera T.json --pytorch P.json \
        --device "NVIDIA H100 80GB HBM3, driver ..." --json gpu_bench.json --md gpu_bench.md
Standard library only.
"""
import argparse
import datetime
import json
import os
import subprocess


def load(path, impl):
    if not path or not os.path.exists(path):
        return {"impl": impl, "meta": {"missing": f"no results file ({path})"}, "records": []}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"impl": impl, "meta": {"missing": f"unreadable results file {path}: {e}"}, "records": []}


def fmt(v):
    if v is None:
        return "—"
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def ratio(a, b):
    return a / b if a is not None and b and b > 0 else None


def fmt_ratio(r, bold=False):
    if r is None:
        return "—"
    s = f"{r:.2f}x"
    return f"**{s}**" if bold else s


class Index:
    """Values by (suite, case, variant, dtype, method); errors kept for the notes."""

    def __init__(self, doc):
        self.values, self.errors, self.cases = {}, {}, []
        for r in doc.get("records", []):
            key = (r["suite"], r["case"], r["variant"], r["dtype"], r.get("method"))
            if r.get("value") is not None:
                self.values[key] = r["value"]
            else:
                self.errors[key] = r.get("error", "no value")
            if (r["suite"], r["case"]) not in self.cases:
                self.cases.append((r["suite"], r["case"]))

    def get(self, suite, case, variant, dtype="float32", method=None):
        return self.values.get((suite, case, variant, dtype, method))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", required=True)
    ap.add_argument("--pytorch", required=True)
    ap.add_argument("--device", default="", help="the GPU as nvidia-smi names it")
    ap.add_argument("--command", default="bash bench/gpu_compare.sh")
    ap.add_argument("--commit", default="", help="Tessera's commit (default: git rev-parse here)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--md", required=True)
    a = ap.parse_args()

    t_doc, p_doc = load(a.tessera, "tessera"), load(a.pytorch, "pytorch")
    t, p = Index(t_doc), Index(p_doc)
    t_meta, p_meta = t_doc.get("meta", {}), p_doc.get("meta", {})
    device = a.device or p_meta.get("device_name", "unknown GPU")
    commit = a.commit
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    today = datetime.date.today().isoformat()
    cases = t.cases + [c for c in p.cases if c not in t.cases]

    md, ratios, notes = [], [], []
    md.append(f"## One GPU: Tessera vs PyTorch {p_meta.get('torch', '?')} ({device}, one run)")
    md.append("")
    md.append("```sh")
    md.append(a.command)
    md.append("```")
    md.append("")
    md.append(
        f"One run, {today}, commit {commit or '?'}: {device}; PyTorch {p_meta.get('torch', '?')} "
        f"(CUDA {p_meta.get('cuda', '?')}); Tessera's `bench_gpu` built against LibTorch "
        f"{t_meta.get('libtorch', '?')}. Both programs ran back to back on the same GPU, one process "
        "each, a 1-rank mesh over NCCL (no communication on one rank). Per-op: batches of calls, "
        "each closed by a synchronize, calibrated to >= "
        f"{t_meta.get('timing', {}).get('per_op', {}).get('batch_ms', '?')} ms, median of "
        f"{t_meta.get('timing', {}).get('per_op', {}).get('batches', '?')} batches (host cost "
        "for small ops, kernel time for large). Attention and steps: each call between two "
        "synchronizes, median of up to "
        f"{t_meta.get('timing', {}).get('per_step', {}).get('iters', '?')} after "
        f"{t_meta.get('timing', {}).get('per_step', {}).get('warmup', '?')} warm-up calls. "
        f"Run time: Tessera {t_meta.get('seconds', 0):.0f} s, PyTorch {p_meta.get('seconds', 0):.0f} s.")
    for side, meta in (("Tessera", t_meta), ("PyTorch", p_meta)):
        for k in ("skipped", "missing", "mesh_error"):
            if meta.get(k):
                md.append("")
                md.append(f"**{side}: {k}: {meta[k]}**")

    # -- per-op ------------------------------------------------------------------------
    md += ["", "#### Per-op cost on a 1-rank CUDA mesh (µs per op)", "",
           "| op | placement | PyTorch plain | DTensor | DTensor / plain | Tessera plain | Tessera "
           "| Tessera / plain | Tessera / DTensor |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for suite, case in cases:
        if suite != "ops":
            continue
        pp, tp = p.get("ops", case, "plain"), t.get("ops", case, "plain")
        for placement in ("R", "S(0)"):
            pd, td = p.get("ops", case, placement), t.get("ops", case, placement)
            r = {"suite": "ops", "case": case, "placement": placement,
                 "dtensor_over_plain": ratio(pd, pp), "tessera_over_plain": ratio(td, tp),
                 "tessera_over_dtensor": ratio(td, pd)}
            ratios.append(r)
            md.append(f"| {case} | {placement} | {fmt(pp)} | {fmt(pd)} | {fmt_ratio(r['dtensor_over_plain'])} "
                      f"| {fmt(tp)} | {fmt(td)} | {fmt_ratio(r['tessera_over_plain'])} "
                      f"| {fmt_ratio(r['tessera_over_dtensor'], bold=True)} |")

    # -- steps -------------------------------------------------------------------------
    md += ["", "#### One training step on a 1-rank CUDA mesh (ms per step)", "",
           "Zero grad, forward, `(out - y).pow(2).mean()`, backward, Adam (PyTorch: foreach=False). "
           "fully_shard: each Linear, then the root, default resharding; TP: ColwiseParallel on the "
           "first Linear, RowwiseParallel on the second.", "",
           "| step | variant | PyTorch | PyTorch / plain | Tessera | Tessera / plain | Tessera / PyTorch |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for suite, case in cases:
        if suite != "step":
            continue
        pp, tp = p.get("step", case, "plain"), t.get("step", case, "plain")
        for variant in ("plain", "fully_shard", "tp"):
            pv, tv = p.get("step", case, variant), t.get("step", case, variant)
            r = {"suite": "step", "case": case, "variant": variant, "pytorch_over_plain": ratio(pv, pp),
                 "tessera_over_plain": ratio(tv, tp), "tessera_over_pytorch": ratio(tv, pv)}
            ratios.append(r)
            md.append(f"| {case} | {variant} | {fmt(pv)} | "
                      f"{fmt_ratio(r['pytorch_over_plain']) if variant != 'plain' else ''} | {fmt(tv)} | "
                      f"{fmt_ratio(r['tessera_over_plain']) if variant != 'plain' else ''} | "
                      f"{fmt_ratio(r['tessera_over_pytorch'], bold=True)} |")

    # -- neighbourhood attention ---------------------------------------------------------
    md += ["", "#### 2-D neighbourhood attention, 7x7 window, 4 heads, head dim 32 (ms per call)", "",
           "Batch 1. Tessera: `tessera::nn::functional::na2d` on plain CUDA tensors (heads-last). "
           "PyTorch: `flex_attention` under `torch.compile` with a block mask from NATTEN's window "
           "rule, and dense `scaled_dot_product_attention` with the same mask as an additive "
           "[N, N] bias (heads-first; masks built outside the timing). fwd+bwd: forward, then "
           "`out.backward(g)`.", "",
           "| field | dtype | pass | Tessera na2d | flex_attention | dense SDPA | na2d / flex | dense / flex |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for dtype in ("float32", "bfloat16"):
        for suite, case in cases:
            if suite != "na2d":
                continue
            field = case.split()[1]
            for variant in ("fwd", "fwd+bwd"):
                tv = t.get("na2d", case, variant, dtype, "na2d")
                fv = p.get("na2d", case, variant, dtype, "flex_attention")
                dv = p.get("na2d", case, variant, dtype, "sdpa dense mask")
                r = {"suite": "na2d", "case": case, "dtype": dtype, "variant": variant,
                     "na2d_over_flex": ratio(tv, fv), "dense_over_flex": ratio(dv, fv)}
                ratios.append(r)
                md.append(f"| {field} | {dtype} | {variant} | {fmt(tv)} | {fmt(fv)} | {fmt(dv)} "
                          f"| {fmt_ratio(r['na2d_over_flex'], bold=True)} | {fmt_ratio(r['dense_over_flex'])} |")

    # -- attention block kernels (Tessera's side only: kernels compared within its run) -----
    attn = [(suite, case) for suite, case in cases if suite == "attn"]
    if attn:
        md += ["", "#### Causal scaled_dot_product_attention on distributed tensors (ms, fwd+bwd)", "",
               "Heads split on the 1-rank mesh, so the call runs the sharded rule's block kernel: "
               "matrix products (the default off the CPU) or LibTorch's memory-efficient pair "
               "(`TESSERA_ATTENTION_BLOCKS=fused`); plain: the same call on the CUDA tensors "
               "(LibTorch's own kernel choice).", "",
               "| case | dtype | plain | products | fused | products / plain | fused / plain |",
               "|---|---|---:|---:|---:|---:|---:|"]
        for dtype in ("bfloat16", "float32"):
            for _, case in attn:
                pl = t.get("attn", case, "plain", dtype)
                pr = t.get("attn", case, "S(1) products", dtype)
                fu = t.get("attn", case, "S(1) fused", dtype)
                r = {"suite": "attn", "case": case, "dtype": dtype,
                     "products_over_plain": ratio(pr, pl), "fused_over_plain": ratio(fu, pl)}
                ratios.append(r)
                md.append(f"| {case} | {dtype} | {fmt(pl)} | {fmt(pr)} | {fmt(fu)} "
                          f"| {fmt_ratio(r['products_over_plain'])} "
                          f"| {fmt_ratio(r['fused_over_plain'], bold=True)} |")

    checks = p_meta.get("checks", [])
    if checks:
        md += ["", "flex_attention against dense SDPA on the same inputs (the two masks agree), "
               "max |Δ| of the forward output: " + ", ".join(
                   f"{c['case'].split()[1]} {c['dtype']} {c['max_abs_diff_flex_vs_dense']:.1e}"
                   for c in checks) + "."]

    for side, idx in (("Tessera", t), ("PyTorch", p)):
        for (suite, case, variant, dtype, method), err in idx.errors.items():
            what = f"{method} " if method and method != "na2d" else ""
            notes.append(f"- {side} {suite} `{case}` {what}{variant} {dtype}: {err}")
    if notes:
        md += ["", "Not measured (— in the tables):", ""] + notes
    md.append("")

    with open(a.md, "w") as f:
        f.write("\n".join(md))
    with open(a.json, "w") as f:
        json.dump({"device": device, "date": today, "commit": commit, "command": a.command,
                   "tessera": t_doc, "pytorch": p_doc, "ratios": ratios}, f, indent=2)
    print("\n".join(md))


if __name__ == "__main__":
    main()
