#!/usr/bin/env python3
"""How PyTorch's warm forward on the CPU depends on what runs between two forwards: one
process, one model (DAT x4 as DAT_x4, or SwinIR-M x4), its forwards timed with either a run
of the `upscale` binary between them (as benches/esrgan_compact_cpu_vs_torch.py does) or a
sleep of the same length. On a quiet machine the two columns agree; a difference says the
harness, not the model, sets the baseline.

  python3 benches/torch_between_runs.py UPSCALE_BINARY WEIGHTS IMAGE [dat|swinir] [REPS]

With UPSCALE_BINARY `none` (WEIGHTS and IMAGE then unused) only PyTorch's forwards run, back
to back, so that `perf stat -e page-faults,dTLB-load-misses python3 ...` counts PyTorch's
process alone.

WEIGHTS is a file of the same architecture for `upscale` (e.g. from
tests/golden/make_golden_dat.py --bench DIR); IMAGE a 64x64 PNG. Needs torch and spandrel.
"""

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

binary, weights, image = sys.argv[1], sys.argv[2], sys.argv[3]
model = sys.argv[4] if len(sys.argv) > 4 else "dat"
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 4
torch.set_num_threads(2)
torch.manual_seed(0)
if model == "dat":
    from spandrel.architectures.DAT import DAT
    m = DAT(upscale=4, in_chans=3, img_size=64, img_range=1.0, depth=[6] * 6, embed_dim=180,
            num_heads=[6] * 6, expansion_factor=4, resi_connection="1conv",
            split_size=[8, 32], upsampler="pixelshuffle")
else:
    from spandrel.architectures.SwinIR import SwinIR
    m = SwinIR(img_size=64, patch_size=1, in_chans=3, embed_dim=180, depths=[6] * 6,
               num_heads=[6] * 6, window_size=8, mlp_ratio=2.0, upscale=4, img_range=1.0,
               upsampler="pixelshuffle", resi_connection="1conv")
m = m.eval()
x = torch.rand(1, 3, 64, 64)
with tempfile.TemporaryDirectory() as tmp:
    cmd = [binary, "-m", weights, "--device", "cpu", "--tile", "0", "--precision", "fp32", "-q",
           "--overwrite", "-o", str(Path(tmp) / "out.png"), image]
    times = {"upscale between": [], "sleep between": []}
    ours = []
    with torch.inference_mode():
        m(x)
        if binary == "none":
            alone = []
            for _ in range(reps):
                t = time.perf_counter()
                m(x)
                alone.append(time.perf_counter() - t)
            print(f"{model}: PyTorch forward alone: median {statistics.median(alone):.3f} s "
                  f"({', '.join(f'{t:.2f}' for t in alone)})")
            sys.exit(0)
        for _ in range(reps):
            for mode in times:
                t = time.perf_counter()
                m(x)
                times[mode].append(time.perf_counter() - t)
                if mode == "upscale between":
                    t = time.perf_counter()
                    subprocess.run(cmd, check=True, env={"RAYON_NUM_THREADS": "2"})
                    ours.append(time.perf_counter() - t)
                else:
                    time.sleep(statistics.median(ours))
    for mode, v in times.items():
        print(f"{model}: PyTorch forward with {mode}: median {statistics.median(v):.3f} s "
              f"({', '.join(f'{t:.2f}' for t in v)})")
    print(f"{model}: upscale whole process: median {statistics.median(ours):.3f} s")
