#!/usr/bin/env python3
"""Turn scripts/gpu-run.sh's results.jsonl into a one-page Markdown summary (stdlib only)."""

import json
import statistics
import sys


def cell(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("# GPU run summary\n")
    for r in rows:
        if r["step"] == "probe":
            p = r["result"]
            if isinstance(p, dict):
                off = p["cuda_off"] or "nothing"
                print(f"Ran with attention `{p['attention']}`, UPSCALE_CUDA_OFF: {off} "
                      f"(the probe's first working choice of: {p['tried']}).\n")
            else:
                print(f"Probe: {p}\n")
    steps = [r for r in rows if "status" in r]
    print("| step | status | wall s |\n|---|---|---|")
    for r in steps:
        print(f"| {r['step']} | {r['status']} | {cell(r['wall_s'])} |")
    print()
    benches = [r for r in rows if isinstance(r.get("result"), dict) and "median_s" in r["result"]]
    if benches:
        print("## upscale bench\n")
        print("| step | label | median s | tiles/s | TFLOP/s | MFU | peak device MiB | lanes |")
        print("|---|---|---|---|---|---|---|---|")
        for r in benches:
            b = r["result"]
            mem = b.get("peak_device_bytes")
            print(
                f"| {r['step']} | {r.get('label', '')} | {cell(b['median_s'])} | "
                f"{cell(b.get('tiles_per_s'))} | {cell(b.get('achieved_tflops'))} | "
                f"{cell(b.get('flop_utilisation'))} | "
                f"{cell(mem / 2**20 if isinstance(mem, (int, float)) else None)} | "
                f"{cell(b.get('lanes'))} |"
            )
        print()
    switched = [r for r in benches if r["step"] in ("pad", "pinned")]
    if switched:
        # Each row with a switch on against the same model's side-by-side row of this run.
        print("## Speed switches against the defaults, same run\n")
        print("pad: UPSCALE_PAD_CHANNELS (default 16 on a GPU in bf16); pinned: UPSCALE_CUDA_PINNED.\n")
        parity = {(r["step"][:-len("_parity")], r["result"].get("value")): r["result"].get("matches_cpu")
                  for r in rows if r["step"].endswith("_parity") and isinstance(r.get("result"), dict)}
        side = {r["label"].split("-bf16-")[0]: r["result"]["median_s"] for r in benches
                if r["step"] == "side" and "-bf16-ours-" in r.get("label", "")}
        print("| model | switch | value | matches the CPU | median s | defaults s | defaults / with |")
        print("|---|---|---|---|---|---|---|")
        for r in switched:
            step = r["step"]
            model, _, value = r["label"].rpartition(f"-bf16-{step}")
            med = r["result"]["median_s"]
            base = side.get(model)
            print(f"| {model} | {step} | {value} | {parity.get((step, value), '')} | {cell(med)} | "
                  f"{cell(base)} | {cell(base / med if base else None)} |")
        print()
    ab = [r for r in benches if r["step"] == "ab"]
    if ab:
        # Median over rounds of each build's median; ratios against the first build listed.
        print("## Before/after (median of the rounds' medians)\n")
        print("| model | build | median s | first build / this |\n|---|---|---|---|")
        by_model = {}
        for r in ab:
            model, _, build = r["label"].rpartition("-")
            by_model.setdefault(model, {}).setdefault(build, []).append(r["result"]["median_s"])
        for model, builds in by_model.items():
            first = None
            for build, times in builds.items():
                med = statistics.median(times)
                first = first or med
                print(f"| {model} | {build} | {cell(med)} | {cell(first / med)} |")
        print()
    torch_rows = [r for r in rows if isinstance(r.get("result"), dict) and "median_s_per_image" in r["result"]]
    if torch_rows:
        torch_table(torch_rows, benches, rows)
    psnr = [r for r in rows if r["step"] == "psnr" and isinstance(r.get("result"), dict)]
    if psnr:
        print("## Precision against fp32 (tests/photos, 8-bit outputs)\n")
        print("| precision | attention | mean PSNR-Y dB | mean PSNR-RGB dB | lowest PSNR-RGB dB |\n|---|---|---|---|---|")
        for r in psnr:
            s = r["result"].get("summary", r["result"])
            rgb = [i["psnr_rgb"] for i in r["result"].get("images", []) if "psnr_rgb" in i]
            print(f"| {r.get('precision')} | {r.get('attention', 'fused')} | {cell(s.get('mean_psnr_y'))} | "
                  f"{cell(s.get('mean_psnr_rgb'))} | {cell(min(rgb) if rgb else None)} |")
        print()
    gemm = [r for r in rows if r["step"] == "gemm_shapes" and isinstance(r.get("result"), dict)]
    for r in gemm:
        g = r["result"]
        print(f"## What bounds the body ({g['preset']}, {g['tokens']} tokens per forward)\n")
        f = g["floors"]
        rate = f"measured {cell(g['bf16_tflops'])} TFLOP/s and {cell(g['copy_gbps'])} GB/s" \
            if "copy_gbps" in g else f"assumed {g['assumed_tflops']} TFLOP/s and {g['assumed_gbps']} GB/s"
        print(f"Body {cell(g['body_gflop'])} GFLOP; bytes moved {cell(g['bytes_as_run_gb'])} GB as run, "
              f"{cell(g['bytes_fused_gb'])} GB with every epilogue fused ({rate}).\n")
        print("| graph | compute floor s | memory floor s | MFU ceiling |\n|---|---|---|---|")
        for key in ("as_run", "fused"):
            print(f"| {key} | {cell(f['compute_s'])} | {cell(f[f'memory_{key}_s'])} | "
                  f"{cell(f[f'mfu_ceiling_{key}'])} |")
        print()
        print("| pass (all blocks) | GFLOP | GB moved | floor s |\n|---|---|---|---|")
        for name, e in g.get("passes", {}).items():
            print(f"| {name} | {cell(e['gflop'])} | {cell(e['gb'])} | {cell(f['pass_s'][name])} |")
        print()
        if "gemms" in g:
            print("| K | N | per forward | x@w.T s | TFLOP/s | GB/s | addmm s | K,N to 8 s | floor s |")
            print("|---|---|---|---|---|---|---|---|---|")
            for m in g["gemms"]:
                print(f"| {m['k']} | {m['n']} | {m['per_forward']} | {cell(m['plain_s'])} | "
                      f"{cell(m['plain_tflops'])} | {cell(m['plain_gbps'])} | {cell(m['addmm_s'])} | "
                      f"{cell(m['aligned8_s'])} | {cell(m['floor_s'])} |")
            t = g["gemm_totals"]
            print(f"| **all, per forward** | | | {cell(t['plain_s'])} | | | {cell(t['addmm_s'])} | "
                  f"{cell(t['aligned8_s'])} | {cell(t['floor_s'])} |")
            print()
    other = [r for r in rows if "status" not in r and r["step"] != "probe"
             and r not in benches + torch_rows + psnr + gemm]
    if other:
        print("## Other results\n")
        for r in other:
            print(f"- **{r['step']}** {r.get('label', '')}: `{json.dumps(r['result'])[:600]}`")


def model_of(label):
    """'drct-l-bf16-ours-fused' -> 'drct-l': the side-by-side labels start with the model."""
    return label.split("-bf16-")[0]


def torch_table(torch_rows, benches, rows):
    """PyTorch eager and torch.compile rows; their TFLOP/s and MFU count the model FLOPs as
    upscale bench does for the same model and tiles, against the bf16 matmul rate measured in
    the same run; then ours against torch.compile, model by model."""
    peak = next((r["result"]["bf16_tflops"] for r in rows if r["step"] == "peak"
                 and isinstance(r.get("result"), dict) and "bf16_tflops" in r["result"]), None)
    ours = [r for r in benches if r["step"] in ("side", "swin") and "-ours-" in r.get("label", "")]
    flop = {(model_of(r["label"]), r["result"].get("tiles")): r["result"].get("model_tflop") for r in ours}
    print("## PyTorch reference\n")
    print("| label | impl | median s | first call s | tiles/s | TFLOP/s | MFU | peak MiB | max abs vs eager | finite |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in torch_rows:
        t = r["result"]
        tflop = flop.get((model_of(r.get("label", "")), t.get("tiles")))
        rate = tflop / t["median_s_per_image"] if tflop else None
        print(f"| {r.get('label', '')} | {t.get('impl', '')} | {cell(t['median_s_per_image'])} | "
              f"{cell(t.get('first_call_s'))} | {cell(t.get('tiles_per_s'))} | {cell(rate)} | "
              f"{cell(rate / peak if rate and peak else None)} | {cell(t.get('peak_mem_mib'))} | "
              f"{cell(t.get('max_abs_vs_eager'))} | {cell(t.get('finite'))} |")
    print()
    by_label = {r.get("label"): r["result"]["median_s_per_image"] for r in torch_rows}
    lines = []
    for r in ours:
        model, ours_s = model_of(r["label"]), r["result"]["median_s"]
        compiled, eager = by_label.get(f"{model}-bf16-torch-compile"), by_label.get(f"{model}-bf16-pytorch")
        if compiled:
            eager_part = f"; against eager {cell(eager)} s: {cell(ours_s / eager)}" if eager else ""
            lines.append(f"- {model}, ours `{r['label'].split('-ours-')[1]}` {cell(ours_s)} s / "
                         f"torch.compile {cell(compiled)} s = **{cell(ours_s / compiled)}**{eager_part}")
    if lines:
        print("Ours / torch.compile, median time per image (the goal: 0.5 or less):\n")
        print("\n".join(lines))
        print()


if __name__ == "__main__":
    main(sys.argv[1])
