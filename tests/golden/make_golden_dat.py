#!/usr/bin/env python3
"""Write the float64 DAT (Dual Aggregation Transformer) reference fixtures used by the Rust
tests (tests/golden/dat/).

Run from anywhere:  python tests/golden/make_golden_dat.py [--out DIR] [--bench DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's DAT module in float64 and eval mode, called on the input as
spandrel calls it (no padding outside the network: its spatial attention zero-pads q, k and v
to a multiple of the larger split size itself), the output not clamped. Every parameter is
random (rounded to float32 so a float32 port loads exactly what the reference used), and so are
the BatchNorm running statistics, so that folding them at load is tested. spandrel's DAT builds
its classical upsampler with 64 features whatever the file says; the pixel-shuffle fixtures use
16 (the released structure at a fraction of the size), so that upsampler is rebuilt here with
16 features.

  --bench DIR   also write a DAT-shaped x4 model (E 180, 6 groups of 6 blocks, 6 heads, split
                8x32, expansion 4; random weights) for timing.
"""

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_swinir import make_input  # noqa: E402

from spandrel.architectures.DAT import DAT  # noqa: E402
from spandrel.architectures.DAT.__arch.DAT import Upsample  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

CASES = [
    dict(
        name="dat_x2_two_groups",
        scale=2, embed_dim=32, depths=(2, 2), heads=(4, 2), split=(8, 16), expansion=2.0,
        upsampler="pixelshuffle", resi="1conv", num_feat=16,
        input=dict(kind="pattern", shape=(1, 3, 13, 21)), seed=61,
        covers="x2 pixel shuffle; two groups (the second's first spatial block shifted); "
               "8x16 windows (DAT-S's); 4 and 2 heads; 13x21 padded to 16x32 inside",
    ),
    dict(
        name="dat_x4_3conv",
        scale=4, embed_dim=64, depths=(2,), heads=(4,), split=(2, 4), expansion=1.5,
        upsampler="pixelshuffle", resi="3conv", num_feat=16,
        input=dict(kind="pattern", shape=(1, 3, 11, 17)), seed=62,
        covers="x4 (two pixel-shuffle stages); 3conv connections; width 64, so that the "
               "position MLP is 2 wide (at width 32 and DAT-light's 60 it is 1 wide and its "
               "bias a constant that the softmax ignores); 2x4 windows; expansion 1.5; 11x17",
    ),
    dict(
        name="dat_x3_light",
        scale=3, embed_dim=32, depths=(1, 2), heads=(4, 4), split=(4, 4), expansion=4.0,
        upsampler="pixelshuffledirect", resi="3conv",
        input=dict(kind="noise", shape=(2, 3, 16, 16)), seed=63,
        covers="x3 one-step pixel shuffle (DAT-light's upsampler); square 4x4 windows; a "
               "group of one block (heads read from the position MLP); expansion 4; batch 2; "
               "no padding",
    ),
    dict(
        name="dat_x2_light_ema",
        scale=2, embed_dim=32, depths=(3,), heads=(2,), split=(4, 8), expansion=2.0,
        upsampler="pixelshuffledirect", resi="1conv", img_size=8,
        input=dict(kind="pattern", shape=(1, 3, 19, 9)), seed=64, pth="official",
        covers="x2 one-step pixel shuffle; 4x8 windows; block 2 shifted; the "
               "official .pth layout {'params': OTHER, 'params_ema': reference} with every "
               "buffer (masks, indices, BatchNorm counters); 19x9 padded to 24x16 inside",
    ),
]


def build(cfg):
    m = DAT(
        img_size=cfg.get("img_size", 16), in_chans=3, embed_dim=cfg["embed_dim"],
        split_size=list(cfg["split"]), depth=list(cfg["depths"]), num_heads=list(cfg["heads"]),
        expansion_factor=cfg["expansion"], qkv_bias=True, upscale=cfg["scale"], img_range=1.0,
        resi_connection=cfg["resi"], upsampler=cfg["upsampler"], drop_path_rate=0.0,
    )
    if cfg["upsampler"] == "pixelshuffle" and cfg.get("num_feat", 64) != 64:
        f = cfg["num_feat"]
        m.conv_before_upsample = nn.Sequential(
            nn.Conv2d(cfg["embed_dim"], f, 3, 1, 1), nn.LeakyReLU(inplace=True))
        m.upsample = Upsample(cfg["scale"], f)
        m.conv_last = nn.Conv2d(f, 3, 3, 1, 1)
    return m.double().eval()


@torch.no_grad()
def randomise(model, seed):
    """Every parameter and BatchNorm statistic random: norms around 1 (weights) and 0,
    weights fan-in scaled, biases large enough that a port ignoring them fails."""
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float64)

    def rand(shape):
        return torch.rand(shape, generator=g, dtype=torch.float64)

    def put(p, v):
        p.copy_(v.float().double())

    for mod in model.modules():
        if isinstance(mod, (nn.LayerNorm, nn.BatchNorm2d)):
            put(mod.weight, 1.0 + 0.3 * randn(mod.weight.shape))
            put(mod.bias, 0.3 * randn(mod.bias.shape))
        if isinstance(mod, nn.BatchNorm2d):
            put(mod.running_mean, 0.3 * randn(mod.running_mean.shape))
            put(mod.running_var, 0.5 + rand(mod.running_var.shape))
            mod.num_batches_tracked.fill_(1000)
    norms = {id(p) for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d))
             for p in m.parameters()}
    for name, p in model.named_parameters():
        if id(p) in norms:
            continue
        if name.endswith("temperature"):
            put(p, 0.5 + 2.0 * rand(p.shape))
        elif name.endswith(".bias"):
            put(p, (0.5 if ".ffn.fc1." in name else 0.1) * randn(p.shape))
        else:
            fan_in = int(math.prod(p.shape[1:]))
            gain = 1.6 if ".qkv." in name else 1.0
            if ".pos.pos3.2." in name:
                gain = 4.0  # a position bias strong enough to matter in the softmax
            if name.startswith("conv_first."):
                gain = 0.3
            put(p, randn(p.shape) * gain / math.sqrt(fan_in))
    return model


def last_layer(model):
    return model.conv_last if hasattr(model, "conv_last") else model.upsample[0]


@torch.no_grad()
def calibrate(model, x, target=0.5):
    """The last layer scaled so that the output spreads about `target` around the mean."""
    std = float(model(x).std())
    layer = last_layer(model)
    for p in (layer.weight, layer.bias):
        p.copy_((p * (target / std)).float().double())
    return model


KEPT_BUFFERS = ("running_mean", "running_var", "rpe_biases")


def params_sd(model):
    """Parameters, BatchNorm statistics and the position MLP's input grids (no masks, indices
    or counters), float32, official key names."""
    names = {n for n, _ in model.named_parameters()}
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
            if k in names or k.endswith(KEPT_BUFFERS)}


def full_sd(model):
    """Everything state_dict() has, as the official checkpoints do."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().clone()
        out[k] = v.float().contiguous() if v.is_floating_point() else v.contiguous()
    return out


def bench_model(out_dir):
    cfg = dict(scale=4, embed_dim=180, depths=(6,) * 6, heads=(6,) * 6, split=(8, 32),
               expansion=4.0, upsampler="pixelshuffle", resi="1conv", img_size=64)
    m = randomise(build(cfg), 99)
    save_file(params_sd(m), str(out_dir / "dat_x4_random.safetensors"))
    print(f"bench model written to {out_dir}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "dat"))
    ap.add_argument("--bench", default=None)
    args = ap.parse_args()
    if args.bench:
        bench_model(Path(args.bench))
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = []
    for cfg in CASES:
        name = cfg["name"]
        x32 = make_input(cfg["input"], cfg["seed"])
        x = x32.double()
        model = calibrate(randomise(build(cfg), cfg["seed"]), x)
        with torch.no_grad():
            ref = model(x)
        assert torch.isfinite(ref).all()
        if cfg.get("pth") == "official":
            other = randomise(build(cfg), cfg["seed"] + 1000)
            weights = f"{name}.pth"
            torch.save({"params": full_sd(other), "params_ema": full_sd(model)}, out_dir / weights)
            fmt = "pth: {'params': other weights, 'params_ema': reference weights}, buffers included"
        else:
            weights = f"{name}.safetensors"
            save_file(params_sd(model), str(out_dir / weights))
            fmt = "safetensors: parameters, BatchNorm statistics, rpe_biases; float32"
        io = f"{name}.io.safetensors"
        save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))

        with torch.no_grad():
            f32 = copy.deepcopy(model).float()(x32).double()
        checks = {"float32": float((f32 - ref).abs().max())}

        def dev(mutate):
            m2 = copy.deepcopy(model)
            with torch.no_grad():
                mutate(m2)
                return float((m2(x) - ref).abs().max())

        def tanh(m2):
            for mod in m2.modules():
                if isinstance(mod, nn.GELU):
                    mod.approximate = "tanh"

        def batch_stats_ignored(m2):
            for mod in m2.modules():
                if isinstance(mod, nn.BatchNorm2d):
                    mod.running_mean.zero_()
                    mod.running_var.fill_(1.0)

        def no_position_bias(m2):
            for n, p in m2.named_parameters():
                if ".pos.pos3.2.weight" in n:
                    p.zero_()

        checks["tanh GELU"] = dev(tanh)
        checks["BatchNorm statistics ignored"] = dev(batch_stats_ignored)
        checks["position bias removed"] = dev(no_position_bias)
        b, _, h, w = x32.shape
        manifest.append(dict(
            name=name, weights=weights, weights_format=fmt, io=io, scale=cfg["scale"],
            embed_dim=cfg["embed_dim"], depths=list(cfg["depths"]), heads=list(cfg["heads"]),
            split=list(cfg["split"]), expansion=cfg["expansion"], upsampler=cfg["upsampler"],
            resi_connection=cfg["resi"], num_feat=cfg.get("num_feat"), batch=b, input_h=h,
            input_w=w, seed=cfg["seed"], covers=cfg["covers"],
            self_check=dict(max_abs=checks, out_std=float(ref.std()), out_min=float(ref.min()),
                            out_max=float(ref.max())),
        ))
        print(f"{name}: out std {ref.std():.3f} range [{ref.min():.3f}, {ref.max():.3f}]; "
              + ", ".join(f"{k} {v:.2e}" for k, v in checks.items()), flush=True)
    with open(out_dir / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
