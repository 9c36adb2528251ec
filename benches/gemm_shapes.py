#!/usr/bin/env python3
"""What bounds DRCT's Swin body on a GPU: its linear layers' GEMMs timed at their real shapes,
and the memory traffic of the forward pass as `upscale` runs it.

  python benches/gemm_shapes.py [--preset drct-l] [--tokens 262144] [--json FILE]   (PyTorch, CUDA)
  python benches/gemm_shapes.py --calc-only [--preset drct-l]                        (any machine)
  python benches/gemm_shapes.py --device cpu --tokens 256 --square 256 --copy-mib 8  (checks part 2)

Part 1, a calculation (stdlib only): FLOPs and bytes moved per tile by the Swin blocks, pass by
pass, counted from the order `src/nets/drct/mod.rs` and `src/nets/swin.rs` run them on CUDA in bf16 (the ops in `src/ops/`) (qkv, proj and fc2
with the bias in cuBLASLt's epilogue, fc2 onto its residual in place; fc1 and adjust as a GEMM
and then a pass for the bias with the GELU, or the LeakyReLU and the concatenation), and for the same graph with all of those done inside
the GEMM's epilogue. Dividing by a bandwidth gives the least time
either graph can take, whatever its kernels do.

Part 2, measured (needs PyTorch and a GPU): the copy bandwidth of device memory, the bf16 matmul
rate of a large square GEMM, and every distinct linear shape of the body timed as candle runs it
(`x @ w.T`, no bias), with PyTorch's bias epilogue (`addmm`), and with K and N rounded up to a
multiple of 8. The widths of the released models (180 + 32k) are multiples of 4, not 8, so their
rows are 8-byte but not 16-byte aligned in bf16; the rounded shapes show what that costs.
"""

import argparse
import json
import sys

# The released shapes: 5 Swin blocks per group, widths E + k*gc, MLP ratio 2 in blocks 1-3
# and 1 in blocks 4-5 (the official code), window 16.
PRESETS = {
    "drct": dict(groups=6, embed=180, gc=32, window=16),
    "drct-l": dict(groups=12, embed=180, gc=32, window=16),
}
BLOCKS = 5
BYTES = 2  # bf16


def blocks(p):
    """(width, mlp hidden, adjust out) of the five blocks of a group."""
    out = []
    for k in range(BLOCKS):
        d = p["embed"] + k * p["gc"]
        hidden = 2 * d if k < 3 else d
        adjust = p["gc"] if k + 1 < BLOCKS else p["embed"]
        out.append((d, hidden, adjust))
    return out


def passes(d, h, a, n):
    """The passes of one block as run on CUDA in bf16: (name, FLOPs, elements read + written)
    per token."""
    last = a == d  # adjust5: back to the embedding width, onto the group's residual
    return [
        ("norm1 + window gather", 0, d + d),
        ("qkv GEMM + bias (cuBLASLt epilogue)", 2 * d * 3 * d, d + 3 * d),
        ("window attention", 4 * n * d, 3 * d + d),
        ("proj GEMM + bias (cuBLASLt epilogue)", 2 * d * d, d + d),
        # Reads x and the attention output; writes the sum and its norm.
        ("un-gather + residual + norm2", 0, 4 * d),
        ("fc1 GEMM", 2 * d * h, d + h),
        ("fc1 bias + GELU", 0, h + h),
        ("fc2 GEMM + bias onto the residual in place", 2 * h * d, h + d + d),
        ("adjust GEMM", 2 * d * a, d + a),
        # The dense concatenation (reads prev and y, writes both), or the group residual.
        ("adjust bias + act + concatenation", 0, 3 * a if last else 2 * (d + a)),
    ]


def fused_elements(d, h, a):
    """Elements per token of the same block with everything after a GEMM in its epilogue and
    the concatenation written in place."""
    extra = a if a == d else 0
    return (d + d) + (d + 3 * d) + (3 * d + d) + (d + d) + 4 * d + (d + h) + (h + d + d) + (
        d + a + extra)


def calc(preset, tokens):
    p = PRESETS[preset]
    n = p["window"] ** 2
    scale = p["groups"] * tokens
    per_pass, fused = {}, 0
    for d, h, a in blocks(p):
        for name, flops, elements in passes(d, h, a, n):
            entry = per_pass.setdefault(name, {"gflop": 0.0, "gb": 0.0})
            entry["gflop"] += flops * scale / 1e9
            entry["gb"] += elements * BYTES * scale / 1e9
        fused += fused_elements(d, h, a)
    return {"preset": preset, "tokens": tokens,
            "body_gflop": sum(e["gflop"] for e in per_pass.values()),
            "bytes_as_run_gb": sum(e["gb"] for e in per_pass.values()),
            "bytes_fused_gb": fused * BYTES * scale / 1e9, "passes": per_pass}


def floors(c, tflops, gbps):
    compute = c["body_gflop"] / 1e3 / tflops
    out = {"compute_s": compute}
    # Each pass's least time: its FLOPs at the matmul rate or its bytes at the bandwidth.
    out["pass_s"] = {name: max(e["gflop"] / 1e3 / tflops, e["gb"] / gbps)
                     for name, e in c["passes"].items()}
    for key in ("as_run", "fused"):
        memory = c[f"bytes_{key}_gb"] / gbps
        out[f"memory_{key}_s"] = memory
        out[f"mfu_ceiling_{key}"] = compute / max(compute, memory)
    return out


def linear_shapes(preset):
    """Distinct (K, N) of the body's linear layers, with how often each runs per forward."""
    p = PRESETS[preset]
    count = {}
    for d, h, a in blocks(p):
        for kn in ((d, 3 * d), (d, d), (d, h), (h, d), (d, a)):
            count[kn] = count.get(kn, 0) + p["groups"]
    return count


def measured(a, c):
    import time

    import torch

    dev = a.device

    def timed(fn, reps):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if dev == "cpu":
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times.sort()
        return times[len(times) // 2]

    src = torch.empty(a.copy_mib * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), a.reps)
    gbps = 2 * src.numel() / copy_s / 1e9  # read + write
    del src, dst
    big = torch.randn((a.square, a.square), device=dev, dtype=torch.bfloat16)
    peak = 2 * a.square**3 / timed(lambda: big @ big, a.reps) / 1e12
    del big

    m = a.tokens
    rows, totals = [], {"plain_s": 0.0, "addmm_s": 0.0, "aligned8_s": 0.0}
    for (k, n), count in sorted(linear_shapes(a.preset).items()):
        x = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
        w = torch.randn((n, k), device=dev, dtype=torch.bfloat16)
        b = torch.randn((n,), device=dev, dtype=torch.bfloat16)
        k8, n8 = -(-k // 8) * 8, -(-n // 8) * 8
        x8 = torch.randn((m, k8), device=dev, dtype=torch.bfloat16)
        w8 = torch.randn((n8, k8), device=dev, dtype=torch.bfloat16)
        row = {"k": k, "n": n, "per_forward": count,
               "plain_s": timed(lambda: x @ w.t(), a.reps),
               "addmm_s": timed(lambda: torch.addmm(b, x, w.t()), a.reps),
               "aligned8_s": timed(lambda: x8 @ w8.t(), a.reps)}
        row["plain_tflops"] = 2 * m * k * n / row["plain_s"] / 1e12
        row["plain_gbps"] = (m * k + m * n + k * n) * BYTES / row["plain_s"] / 1e9
        row["floor_s"] = max(2 * m * k * n / peak / 1e12, (m * k + m * n) * BYTES / gbps / 1e9)
        for key in totals:
            totals[key] += row[key] * count
        rows.append(row)
        del x, w, b, x8, w8
    floor = sum(r["floor_s"] * r["per_forward"] for r in rows)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    return {"device": name, "copy_gbps": gbps, "bf16_tflops": peak,
            "gemms": rows, "gemm_totals": {**totals, "floor_s": floor},
            "floors": floors(c, peak, gbps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="drct-l")
    ap.add_argument("--tokens", type=int, default=4 * 256 * 256,
                    help="tokens per forward pass (default: a batch of four 256x256 tiles)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu only checks the script itself")
    ap.add_argument("--square", type=int, default=8192, help="side of the peak-rate GEMM")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth copy")
    ap.add_argument("--calc-only", action="store_true", help="part 1 only; no GPU needed")
    ap.add_argument("--tflops", type=float, default=750.0,
                    help="bf16 rate for --calc-only's floors (part 2 measures its own)")
    ap.add_argument("--gbps", type=float, default=3000.0,
                    help="memory bandwidth for --calc-only's floors (part 2 measures its own)")
    ap.add_argument("--json")
    a = ap.parse_args()
    c = calc(a.preset, a.tokens)
    if a.calc_only:
        out = {**c, "assumed_tflops": a.tflops, "assumed_gbps": a.gbps,
               "floors": floors(c, a.tflops, a.gbps)}
    else:
        out = {**c, **measured(a, c)}
    # Six decimals are plenty for seconds, GB and TFLOP/s.
    text = json.dumps(json.loads(json.dumps(out), parse_float=lambda v: round(float(v), 6)))
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
