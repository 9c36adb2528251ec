#!/usr/bin/env python3
"""The GPU's measured dense matmul rate (TFLOP/s) in bf16, fp16 and fp32 with TF32, through
PyTorch: the denominator of model FLOP utilisation, measured in the same run as the model.
Also the copy rates between host and device (GB/s) for a buffer the size of a 1080p x4
image's output canvas, from pageable memory (what `upscale` copies through today) and from
page-locked memory: what pinned buffers for the canvas's download would gain.

  python benches/matmul_peak.py [--size N] [--reps 10] [--copy-mib 512] [--json FILE]

With --cpu THREADS, the CPU's f32 matmul rate (GFLOP/s, MKL through PyTorch) on that many
threads instead: the denominator of a CPU run's efficiency. MKL picks its kernels itself;
`MKL_ENABLE_INSTRUCTIONS=AVX2` (with `ATEN_CPU_CAPABILITY=avx2`) holds it to AVX2, and
`MKL_VERBOSE=1` shows which it ran.

  python benches/matmul_peak.py --cpu 2 [--size 2048] [--reps 10]
"""

import argparse
import json
import time

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


def cpu_rate(n, reps, threads):
    """GFLOP/s of an n x n f32 matmul on the CPU, median of `reps` after a warm-up."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a = torch.randn((n, n), generator=g)
    b = torch.randn((n, n), generator=g)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e9


def copy_rate(mib, reps, pinned, to_host):
    """GB/s of one host<->device copy of `mib` MiB of f32, median of `reps`."""
    n = mib * (1 << 20) // 4
    dev = torch.ones(n, device="cuda")
    host = torch.ones(n, pin_memory=pinned)
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        if to_host:
            host.copy_(dev)
        else:
            dev.copy_(host)
        torch.cuda.synchronize()
        if i > 0:  # the first copy pays for faulting the pages in
            times.append(time.perf_counter() - t)
    times.sort()
    return n * 4 / times[len(times) // 2] / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, help="matrix side (8192 on a GPU, 2048 on the CPU)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--copy-mib", type=int, default=512)
    ap.add_argument("--json")
    ap.add_argument("--cpu", type=int, metavar="THREADS", help="time the CPU's f32 matmul")
    a = ap.parse_args()
    if a.cpu:
        a.size = a.size or 2048
        out = {"device": "cpu", "threads": a.cpu, "size": a.size,
               "fp32_gflops": cpu_rate(a.size, a.reps, a.cpu)}
    else:
        a.size = a.size or 8192
        out = gpu_rates(a)
    text = json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()})
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


def gpu_rates(a):
    return {
        "device": torch.cuda.get_device_name(),
        "size": a.size,
        "bf16_tflops": rate(torch.bfloat16, a.size, a.reps),
        "fp16_tflops": rate(torch.float16, a.size, a.reps),
        "tf32_tflops": rate(torch.float32, a.size, a.reps, tf32=True),
        "fp32_tflops": rate(torch.float32, a.size // 2, a.reps),
        "copy_mib": a.copy_mib,
        "dtoh_pageable_gbs": copy_rate(a.copy_mib, 5, pinned=False, to_host=True),
        "dtoh_pinned_gbs": copy_rate(a.copy_mib, 5, pinned=True, to_host=True),
        "htod_pageable_gbs": copy_rate(a.copy_mib, 5, pinned=False, to_host=False),
        "htod_pinned_gbs": copy_rate(a.copy_mib, 5, pinned=True, to_host=False),
    }


if __name__ == "__main__":
    main()
