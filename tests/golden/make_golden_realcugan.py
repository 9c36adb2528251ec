#!/usr/bin/env python3
"""Write the float64 Real-CUGAN reference fixtures used by the Rust tests
(tests/golden/realcugan/).

Run from anywhere:  python tests/golden/make_golden_realcugan.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

Real-CUGAN's widths are fixed (32 to 256 channels), so every model holds 1.3 to 1.4 million
parameters: 5 MB a file in float32, four times over. The fixtures therefore hold no
weights. Each tensor is drawn from a counter-based generator that the Rust tests repeat
bit for bit (`src/tests/realcugan.rs`):

    seed  = FNV-1a-64(tensor name) XOR case seed
    z_i   = splitmix64 output for the state seed + i * 0x9E3779B97F4A7C15, i = 1, 2, ...
    value = float32((2 * (z_i >> 40) / 2^24 - 1) * scale)        (the product in float64)

with one `scale` a tensor, listed in the manifest with its shape (gain * sqrt(3 / fan-in)
for weights, 0.05 for biases; the last layers' scale set so the output spreads about 0.5).
A pro model's `pro` tensor is a zero, as the reference loader writes it. The manifest's
tensor list is the reference module's state dict, names and shapes, so a port whose
layout differs fails on the list before any output is compared.

The reference is spandrel's UpCunet2x, UpCunet3x, UpCunet4x and UpCunet2x_fast in float64,
eval mode; each state dict is also loaded through spandrel's own loader, which must give
the same output.
"""

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_esrgan import deviation, write  # noqa: E402
from make_golden_swinir import make_input  # noqa: E402

import spandrel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from spandrel.architectures.RealCUGAN import (  # noqa: E402
    UpCunet2x, UpCunet2x_fast, UpCunet3x, UpCunet4x)

torch.set_num_threads(min(2, torch.get_num_threads()))

GAIN = 1.4
BIAS_SCALE = 0.05
GOLDEN = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1

CASES = [
    dict(name="realcugan_x2", cls="x2", pro=False, seed=71,
         input=dict(kind="pattern", shape=(1, 3, 21, 24)),
         covers="UpCunet2x; 21x24 (an odd height, padded to 22 and cropped)"),
    dict(name="realcugan_x3_pro", cls="x3", pro=True, seed=72,
         input=dict(kind="noise", shape=(1, 3, 18, 21)),
         covers="UpCunet3x, pro (its input range); 18x21 (padded to 20x24)"),
    dict(name="realcugan_x4_pro", cls="x4", pro=True, seed=73,
         input=dict(kind="pattern", shape=(2, 3, 20, 22)),
         covers="UpCunet4x, pro, batch 2 (the gates' means per image); 20x22"),
    dict(name="realcugan_x2_fast", cls="fast", pro=False, seed=74,
         input=dict(kind="pattern", shape=(1, 3, 40, 44)),
         covers="UpCunet2x_fast (the U-Nets on the unshuffled input); 40x44"),
]

LAST = {
    "x2": ["unet1.conv_bottom.weight", "unet2.conv_bottom.weight"],
    "x3": ["unet1.conv_bottom.weight", "unet2.conv_bottom.weight"],
    "x4": ["conv_final.weight"],
    "fast": ["conv_final.weight"],
}


def fnv1a(name):
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def draw(name, case_seed, n, scale):
    """The generator above, vectorised: n float32 values."""
    seed = np.uint64(fnv1a(name) ^ case_seed)
    i = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = seed + i * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    return ((2.0 * u - 1.0) * scale).astype(np.float32)


def build(cfg):
    if cfg["cls"] == "fast":
        return UpCunet2x_fast(in_channels=3, out_channels=3).double().eval()
    cls = {"x2": UpCunet2x, "x3": UpCunet3x, "x4": UpCunet4x}[cfg["cls"]]
    return cls(in_channels=3, out_channels=3, pro=cfg["pro"]).double().eval()


def default_scale(model, name, shape):
    if name.endswith(".bias"):
        return BIAS_SCALE
    module = model.get_submodule(name.rsplit(".", 1)[0])
    k = shape[2] * shape[3]
    if isinstance(module, torch.nn.ConvTranspose2d):
        s = module.stride[0]
        fan_in = shape[0] * k / (s * s)
    else:
        fan_in = shape[1] * k
    return GAIN * (3.0 / fan_in) ** 0.5


def fill(model, scales, seed):
    sd = model.state_dict()
    with torch.no_grad():
        for name, t in sd.items():
            if name == "pro":
                t.zero_()
                continue
            v = draw(name, seed, t.numel(), scales[name])
            t.copy_(torch.from_numpy(v.astype(np.float64)).view(t.shape))


@torch.no_grad()
def case(cfg, out_dir):
    x32 = make_input(cfg["input"], cfg["seed"])
    x = x32.double()
    model = build(cfg)
    sd = model.state_dict()
    scales = {n: default_scale(model, n, list(t.shape)) for n, t in sd.items() if n != "pro"}
    fill(model, scales, cfg["seed"])
    # The network's own part spread about 0.5: the last layers scaled once.
    y = model(x)
    if cfg["cls"] in ("x4", "fast"):
        y = y - F.interpolate(x, size=y.shape[-2:], mode="nearest")
    spread = float(y.std())
    for n in LAST[cfg["cls"]]:
        scales[n] *= 0.5 / spread
    fill(model, scales, cfg["seed"])
    ref = model(x)
    assert torch.isfinite(ref).all()
    sd32 = {k: v.float().contiguous() for k, v in model.state_dict().items()}
    desc = spandrel.ModelLoader().load_from_state_dict(copy.deepcopy(sd32))
    assert desc.architecture.id == "RealCUGAN"
    again = desc.model.double().eval()(x)
    assert float((again - ref).abs().max()) == 0.0, "spandrel reads the state dict differently"
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))

    f32 = copy.deepcopy(model).float()(x32).double()
    checks = {"float32": float((f32 - ref).abs().max())}

    def no_gates(m2, x):
        for mod in m2.modules():
            if hasattr(mod, "seblock"):
                mod.seblock = None
        return m2(x)

    def pro_flipped(m2, x):
        m2.pro = None if cfg["pro"] else torch.zeros(1, dtype=torch.float64)
        return m2(x)

    def leaky_02(m2, x):
        F_lrelu = F.leaky_relu
        try:
            F.leaky_relu = lambda t, s=0.01, inplace=False: F_lrelu(t, 0.2, inplace)
            for mod in m2.modules():
                if isinstance(mod, torch.nn.LeakyReLU):
                    mod.negative_slope = 0.2
            return m2(x)
        finally:
            F.leaky_relu = F_lrelu

    checks["no squeeze-and-excitation"] = deviation(model, x, ref, no_gates)
    if cfg["cls"] != "fast":
        checks["pro flipped"] = deviation(model, x, ref, pro_flipped)
    checks["LeakyReLU slope 0.2"] = deviation(model, x, ref, leaky_02)
    b, _, h, w = x32.shape
    return dict(
        name=cfg["name"], io=io, form=cfg["cls"], pro=cfg["pro"], batch=b, input_h=h,
        input_w=w, seed=cfg["seed"], covers=cfg["covers"],
        parameters=sum(t.numel() for n, t in sd32.items() if n != "pro"),
        tensors=[[n, list(t.shape), scales.get(n, 0.0)] for n, t in sd32.items()],
        self_check=dict(max_abs=checks, out_std=float(ref.std()), out_min=float(ref.min()),
                        out_max=float(ref.max())),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent),
                    help="the folder that gets realcugan/")
    args = ap.parse_args()
    write(CASES, case, Path(args.out) / "realcugan")


if __name__ == "__main__":
    main()
