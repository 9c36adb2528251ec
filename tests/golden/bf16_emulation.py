#!/usr/bin/env python3
"""How far the CPU's bf16 products could take a SwinIR or Swin2SR fixture from its float64
reference: an emulation in PyTorch, not our kernels. The operands of every linear layer and
convolution are rounded to bf16 (but the narrow RGB output convolutions and Swin2SR's
position-bias MLP, which `upscale` keeps in f32), products and sums in float64; with
`bf16qk` Swin2SR's qkv layer and normalised q and k are rounded too (what `upscale` does
not do). Prints each fixture's max abs deviation and PSNR, the numbers behind the bounds of
the bf16 tests in src/tests/swinir.rs and src/tests/swin2sr.rs.

  python tests/golden/bf16_emulation.py swinir|swin2sr [f32qk|bf16qk]

Needs: torch, spandrel==0.4.2, safetensors. Run from the repository root.
"""

import json
import math
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, "tests/golden")
from make_golden_swin2sr import pad  # noqa: E402

family = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "f32qk"
if family == "swin2sr":
    from make_golden_swin2sr import CASES, build  # noqa: E402
    import spandrel.architectures.Swin2SR.__arch.Swin2SR as arch  # noqa: E402
else:
    from make_golden_swinir import CASES, build  # noqa: E402
    import spandrel.architectures.SwinIR.__arch.SwinIR as arch  # noqa: E402


def bf(t):
    return t.to(torch.bfloat16).to(torch.float64)


def load(path):
    if path.endswith(".safetensors"):
        return load_file(path)
    sd = torch.load(path, map_location="cpu")
    for k in ("params_ema", "params"):
        if k in sd:
            return sd[k]
    return sd


linear, conv, normalize, flinear = (torch.nn.Linear.forward, torch.nn.Conv2d._conv_forward,
                                    F.normalize, F.linear)


def bf16_linear(self, x):
    if "cpb_mlp" in getattr(self, "_name", ""):
        return linear(self, x)
    return F.linear(bf(x), bf(self.weight), self.bias)


def bf16_conv(self, x, w, b):
    if self.out_channels <= 4 and self.kernel_size == (3, 3):
        return conv(self, x, w, b)
    return conv(self, bf(x), bf(w), b)


torch.nn.Linear.forward = bf16_linear
torch.nn.Conv2d._conv_forward = bf16_conv
if mode == "bf16qk":
    arch.F.normalize = lambda x, dim=-1: bf(normalize(x, dim=dim))
    arch.F.linear = lambda input, weight, bias=None: flinear(bf(input), bf(weight), bias)

by_name = {c["name"]: c for c in CASES}
folder = f"tests/golden/{family}/"
for entry in json.load(open(folder + "manifest.json")):
    cfg = by_name[entry["name"]]
    model = build(cfg)
    sd = {k: v.double() if v.is_floating_point() else v
          for k, v in load(folder + entry["weights"]).items()}
    model.load_state_dict(sd, strict=False)  # SwinIR's files hold no buffers: rebuilt
    for name, module in model.named_modules():
        module._name = name
    io = load_file(folder + entry["io"])
    x, ref = io["input"].double(), io["output"].double()
    _, _, h, w = x.shape
    with torch.no_grad():
        y = model(pad(x, model.window_size))[:, :, : h * cfg["scale"], : w * cfg["scale"]]
    mse = float(((y - ref) ** 2).mean())
    print(f"{mode} {entry['name']:<26} max {float((y - ref).abs().max()):.3e} "
          f"psnr {10 * math.log10(1 / mse):.1f}")
