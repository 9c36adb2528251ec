#!/usr/bin/env python3
"""ESRGAN x4 (64 filters, 23 blocks, 64x64 input), Real-ESRGAN Compact x4 (64 features,
32 convolutions, 128x128 input), SPAN x4 (48 features, 128x128 input) and DAT x4 (embed 180,
6 groups of 6 blocks, 6 heads, split 8x32, 64x64 input) and RealPLKSR x4 (64 features, 28
blocks, 17x17 on 16 channels, GroupNorm; PixelShuffle or DySample, 128x128 input), the
original PLKSR x4 (the same widths, DCCM mixer, attention, 128x128 input) and OmniSR x4
(64 features, 5 groups of 1 block, window 8, 128x128 input), Real-CUGAN x2 and x4
(128x128 input), RCAN x4 and x2 (the release's 64 features, 10 groups of 20 blocks,
64x64 input), MoSR x4 (64 features, 24 blocks, 7x7 depthwise, 64x64 input) and FDAT x4 (the
"medium" shape: embed 120, 4 groups of 3 pairs of blocks, 4 heads, window 8; its default
transpose+conv upsampler, and pixelshuffle; 64x64 input) and SAFMN x4 (the release's dim 36,
8 blocks; 128x128 input) on the CPU: the
`upscale` binary's whole process (`--device cpu --tile 0`, fp32) against PyTorch's warm
forward of spandrel's module (fp32, the same threads), interleaved run by run so both see
the same machine.

  python3 benches/esrgan_compact_cpu_vs_torch.py UPSCALE_BINARY [RUNS] [THREADS] [ONLY]

ONLY, if given, keeps the cases whose name starts with it (`SPAN`, `ESRGAN`, `Compact`,
`DAT`, `RealPLKSR`, `PLKSR`, `OmniSR`, `Real-CUGAN`, `RCAN`, `MoSR`, `FDAT`, `SAFMN`). To compare on AVX2 alone: UPSCALE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2.

Needs torch, spandrel, safetensors, numpy, Pillow. The models are random weights written to a
temporary folder; the inputs are crops of tests/photos/coffee.png.
"""

import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from spandrel.architectures.Compact import Compact
from spandrel.architectures.DAT import DAT
from spandrel.architectures.ESRGAN import ESRGAN
from spandrel.architectures.FDAT import FDAT
from spandrel.architectures.MoSR import MoSR
from spandrel.architectures.OmniSR import OmniSR
from spandrel.architectures.PLKSR import PLKSR, RealPLKSR
from spandrel.architectures.RCAN import RCAN
from spandrel.architectures.RealCUGAN import UpCunet2x, UpCunet4x
from spandrel.architectures.SAFMN import SAFMN
from spandrel.architectures.SPAN import SPAN
from torch_swin_reference import fold_once  # benches/, beside this script

binary = sys.argv[1]
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
only = sys.argv[4] if len(sys.argv) > 4 else ""
torch.set_num_threads(threads)
photo = np.asarray(Image.open(Path(__file__).resolve().parents[1] / "tests/photos/coffee.png")
                   .convert("RGB"))
torch.manual_seed(0)
cases = [
    ("ESRGAN x4, 64 filters, 23 blocks", ESRGAN(in_nc=3, out_nc=3, num_filters=64,
                                               num_blocks=23, scale=4), 64),
    ("Compact x4, 64 features, 32 convs", Compact(num_in_ch=3, num_out_ch=3, num_feat=64,
                                                  num_conv=32, upscale=4), 128),
    ("SPAN x4, 48 features", SPAN(num_in_ch=3, num_out_ch=3, feature_channels=48, upscale=4),
     128),
    ("DAT x4 (DAT_x4's shape: embed 180, 6x6 blocks, split 8x32, expansion 4)",
     DAT(upscale=4, in_chans=3, img_size=64, img_range=1.0, depth=[6] * 6, embed_dim=180,
         num_heads=[6] * 6, expansion_factor=4, resi_connection="1conv", split_size=[8, 32],
         upsampler="pixelshuffle"), 64),
    ("RealPLKSR x4, 64 features, 28 blocks, 17x17 on 16 channels", RealPLKSR(), 128),
    ("RealPLKSR x4 with DySample", RealPLKSR(dysample=True), 128),
    ("PLKSR x4 (the original), DCCM, 64 features, 28 blocks, 17x17 on 16 channels",
     PLKSR(ccm_type="DCCM"), 128),
    ("OmniSR x4, 64 features, 5 groups, window 8",
     OmniSR(num_feat=64, res_num=5, block_num=1, window_size=8, pe=True, up_scale=4), 128),
    ("Real-CUGAN x2", UpCunet2x(in_channels=3, out_channels=3), 128),
    ("Real-CUGAN x4", UpCunet4x(in_channels=3, out_channels=3), 128),
    ("RCAN x4 (the release's shape: 64 features, 10 groups of 20 blocks)", RCAN(scale=4), 64),
    ("RCAN x2 (the same shape)", RCAN(scale=2), 64),
    ("MoSR x4 (64 features, 24 blocks, 7x7 depthwise)", MoSR(upscale=4), 64),
    ("FDAT x4 medium (embed 120, 4 groups of 3 pairs, window 8), transpose+conv",
     FDAT(embed_dim=120, num_groups=4, depth_per_group=3, num_heads=4, window_size=8,
          scale=4), 64),
    ("FDAT x4 medium, pixelshuffle",
     FDAT(embed_dim=120, num_groups=4, depth_per_group=3, num_heads=4, window_size=8,
          scale=4, upsampler_type="pixelshuffle"), 64),
    ("SAFMN x4 (the release's dim 36, 8 blocks)", SAFMN(dim=36, n_blocks=8), 128),
]
cases = [c for c in cases if c[0].startswith(only)]
with tempfile.TemporaryDirectory() as tmp:
    for name, model, n in cases:
        model = model.eval()
        weights = Path(tmp) / "model.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
        crop = photo[40:40 + n, 100:100 + n]
        image = Path(tmp) / "in.png"
        Image.fromarray(crop).save(image)
        x = torch.from_numpy(crop.astype(np.float32) / 255).permute(2, 0, 1)[None].contiguous()
        cmd = [binary, "-m", str(weights), "--device", "cpu", "--tile", "0", "--precision",
               "fp32", "-q", "--overwrite", "-o", str(Path(tmp) / "out.png"), str(image)]
        env = {"RAYON_NUM_THREADS": str(threads)}
        # Held to AVX2 when asked (PyTorch then with ATEN_CPU_CAPABILITY=avx2).
        env.update({k: os.environ[k] for k in ("UPSCALE_CPU_ISA",) if k in os.environ})
        ours, theirs, frozen_times = [], [], []
        # Every forward gets its own copy: RCAN's scales its input in place.
        with torch.inference_mode():
            model(x.clone())
            # SPAN's module folds its three-branch convolutions again on every forward (its
            # eval mode): also time a copy whose folds, made once, are kept.
            frozen = None
            if any(hasattr(m, "update_params") for m in model.modules()):
                frozen = copy.deepcopy(model)
                fold_once(frozen)
                frozen(x.clone())
            for _ in range(runs):
                xc = x.clone()
                t = time.perf_counter()
                model(xc)
                theirs.append(time.perf_counter() - t)
                if frozen is not None:
                    xc = x.clone()
                    t = time.perf_counter()
                    frozen(xc)
                    frozen_times.append(time.perf_counter() - t)
                t = time.perf_counter()
                subprocess.run(cmd, check=True, env=env)
                ours.append(time.perf_counter() - t)
        a, b = statistics.median(ours), statistics.median(theirs)
        line = (f"{name}, {n}x{n}: upscale {a:.3f} s (whole process), PyTorch "
                f"{torch.__version__} {b:.3f} s (warm forward), {threads} threads: {b / a:.2f}x")
        if frozen_times:
            c = statistics.median(frozen_times)
            line += f"; PyTorch with the folds kept {c:.3f} s: {c / a:.2f}x"
        print(line, flush=True)
