#!/usr/bin/env python3
"""The machine's f32 GEMM rate as PyTorch's BLAS (MKL on x86) reaches it, at the linear shapes
of the Swin family's 64x64 forward (4096 tokens, 180 channels) and at 2048^3, to set our
products' rate (`cargo test --release --lib swinir_layer_throughput -- --ignored --nocapture`)
against. Hold both to AVX2 as PERFORMANCE.md says (UPSCALE_CPU_ISA=avx2 for ours;
ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 for this).

  python3 benches/sgemm_rate.py [threads]      (needs torch)
"""

import sys
import time

import torch

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
print(f"capability {torch.backends.cpu.get_cpu_capability()}, {threads} threads")
for m, k, n in [(4096, 180, 540), (4096, 180, 180), (4096, 180, 360), (4096, 360, 180), (2048, 2048, 2048)]:
    a = torch.randn(m, k)
    w = torch.randn(k, n)
    for _ in range(3):
        torch.mm(a, w)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        torch.mm(a, w)
        times.append(time.perf_counter() - t)
    times.sort()
    flop = 2.0 * m * k * n
    print(f"{m}x{k}x{n}: median {flop / times[5] / 1e9:.0f} GFLOP/s, best {flop / times[0] / 1e9:.0f}")
