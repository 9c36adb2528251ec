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
        print("## PyTorch reference\n")
        print("| label | median s | tiles/s | peak MiB |\n|---|---|---|---|")
        for r in torch_rows:
            t = r["result"]
            print(f"| {r.get('label', '')} | {cell(t['median_s_per_image'])} | "
                  f"{cell(t.get('tiles_per_s'))} | {cell(t.get('peak_mem_mib'))} |")
        print()
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
    other = [r for r in rows if "status" not in r and r not in benches + torch_rows + psnr]
    if other:
        print("## Other results\n")
        for r in other:
            print(f"- **{r['step']}** {r.get('label', '')}: `{json.dumps(r['result'])[:600]}`")


if __name__ == "__main__":
    main(sys.argv[1])
