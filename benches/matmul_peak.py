#!/usr/bin/env python3
"""The GPU's measured dense matmul rate (TFLOP/s) in bf16, fp16 and fp32 with TF32, through
PyTorch: the denominator of model FLOP utilisation, measured in the same run as the model.

  python benches/matmul_peak.py [--size 8192] [--reps 10] [--json FILE]
"""

import argparse
import json

import torch


def rate(dtype, n, reps, tf32=False):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn((n, n), device="cuda", dtype=dtype, generator=g)
    b = torch.randn((n, n), device="cuda", dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {
        "device": torch.cuda.get_device_name(),
        "size": a.size,
        "bf16_tflops": rate(torch.bfloat16, a.size, a.reps),
        "fp16_tflops": rate(torch.float16, a.size, a.reps),
        "tf32_tflops": rate(torch.float32, a.size, a.reps, tf32=True),
        "fp32_tflops": rate(torch.float32, a.size // 2, a.reps),
    }
    text = json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()})
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
