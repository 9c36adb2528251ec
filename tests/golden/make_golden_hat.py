#!/usr/bin/env python3
"""Write the float64 HAT reference fixtures used by the Rust tests (tests/golden/hat/).

Run from anywhere:  python tests/golden/make_golden_hat.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's HAT module (the official hat_arch.py architecture) in float64 and
eval mode, every parameter randomised as in make_golden.py, with the official test pipeline's
padding (reflect-101, bottom/right, to a window multiple, only when needed) and the output
cropped, not clamped. The CAB branch enters each block scaled by conv_scale = 0.01, so its
last convolution is drawn 20x steeper to keep that branch (and a bug in it) visible; the last
layer is scaled so the output spreads about 0.5 around the mean.

  --bench DIR   also write a HAT-shaped x4 model (E 180, 6 groups of 6 blocks, 6 heads,
                window 16, compress 3, squeeze 30, overlap 0.5; random weights) for timing.
"""

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import full_sd, params_sd, randomise  # noqa: E402
from make_golden_swinir import make_input  # noqa: E402

from spandrel.architectures.HAT import HAT  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

CASES = [
    dict(
        name="hat_x2_w8",
        scale=2, window=8, embed_dim=24, depths=(2, 2), heads=(6, 4), compress=3, squeeze=6,
        overlap=0.5, num_feat=16, patch_norm=True, resi="1conv",
        input=dict(kind="pattern", shape=(1, 3, 21, 19)), seed=31,
        covers="x2, window 8 (OCAB windows 12); two groups with 6 and 4 heads; CAB width 8, "
               "channel attention width 4; 21x19 -> 24x24",
    ),
    dict(
        name="hat_x3_w16",
        scale=3, window=16, embed_dim=16, depths=(2,), heads=(2,), compress=4, squeeze=8,
        overlap=0.5, num_feat=8, patch_norm=True, resi="1conv",
        input=dict(kind="pattern", shape=(1, 3, 20, 33)), seed=32,
        covers="x3, window 16 as released (OCAB windows 24); 20x33 -> 32x48",
    ),
    dict(
        name="hat_x4_ema",
        scale=4, window=8, embed_dim=16, depths=(3,), heads=(4,), compress=2, squeeze=4,
        overlap=0.5, num_feat=8, patch_norm=True, resi="1conv", img_size=16,
        input=dict(kind="pattern", shape=(1, 3, 13, 17)), seed=33, pth="official",
        covers="x4 (two pixel-shuffle stages); odd depth; the official .pth layout "
               "{'params': OTHER, 'params_ema': reference} with buffers; 13x17 -> 16x24",
    ),
    dict(
        name="hat_x2_b2_identity",
        scale=2, window=8, embed_dim=12, depths=(2,), heads=(3,), compress=3, squeeze=3,
        overlap=0.25, num_feat=8, patch_norm=False, resi="identity",
        input=dict(kind="noise", shape=(2, 3, 16, 16)), seed=34,
        covers="x2; batch 2; overlap ratio 0.25 (OCAB windows 10); no group convolution "
               "(identity); patch_norm off; no padding",
    ),
]


def build(cfg):
    img_size = cfg.get("img_size", 32)
    m = HAT(
        img_size=img_size, patch_size=1, in_chans=3, embed_dim=cfg["embed_dim"],
        depths=tuple(cfg["depths"]), num_heads=tuple(cfg["heads"]), window_size=cfg["window"],
        compress_ratio=cfg["compress"], squeeze_factor=cfg["squeeze"], conv_scale=0.01,
        overlap_ratio=cfg["overlap"], mlp_ratio=2.0, qkv_bias=True, drop_path_rate=0.0,
        patch_norm=cfg["patch_norm"], upscale=cfg["scale"], img_range=1.0,
        upsampler="pixelshuffle", resi_connection=cfg["resi"], num_feat=cfg["num_feat"],
    )
    return m.double().eval()


@torch.no_grad()
def steepen(model):
    for name, p in model.named_parameters():
        if ".conv_block.cab.2." in name:
            p.copy_((p * 20).float().double())
    return model


@torch.no_grad()
def run(model, x, window, scale):
    _, _, h, w = x.shape
    ph = (window - h % window) % window
    pw = (window - w % window) % window
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph), mode="reflect")
    return model(x)[:, :, : h * scale, : w * scale]


@torch.no_grad()
def calibrate(model, x, cfg, target=0.5):
    std = float(run(model, x, cfg["window"], cfg["scale"]).std())
    for p in (model.conv_last.weight, model.conv_last.bias):
        p.copy_((p * (target / std)).float().double())
    return model


def bench_model(out_dir):
    cfg = dict(scale=4, window=16, embed_dim=180, depths=(6,) * 6, heads=(6,) * 6, compress=3,
               squeeze=30, overlap=0.5, num_feat=64, patch_norm=True, resi="1conv", img_size=64)
    m = randomise(build(cfg), 99)
    save_file(params_sd(m), str(out_dir / "hat_x4_random.safetensors"))
    print(f"bench model written to {out_dir}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "hat"))
    ap.add_argument("--bench", default=None)
    args = ap.parse_args()
    if args.bench:
        bench_model(Path(args.bench))
        return
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    manifest = []
    for cfg in CASES:
        name = cfg["name"]
        x32 = make_input(cfg["input"], cfg["seed"])
        x = x32.double()
        model = calibrate(steepen(randomise(build(cfg), cfg["seed"])), x, cfg)
        ref = run(model, x, cfg["window"], cfg["scale"])
        assert torch.isfinite(ref).all()
        if cfg.get("pth") == "official":
            other = steepen(randomise(build(cfg), cfg["seed"] + 1000))
            weights = f"{name}.pth"
            torch.save({"params": full_sd(other), "params_ema": full_sd(model)}, out_dir / weights)
            fmt = "pth: {'params': other weights, 'params_ema': reference weights}, buffers included"
        else:
            weights = f"{name}.safetensors"
            save_file(params_sd(model), str(out_dir / weights))
            fmt = "safetensors: parameters only (no buffers), float32"
        io = f"{name}.io.safetensors"
        save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))

        f32 = run(copy.deepcopy(model).float(), x32, cfg["window"], cfg["scale"]).double()
        checks = {"float32": float((f32 - ref).abs().max())}

        def dev(mutate):
            m2 = copy.deepcopy(model)
            with torch.no_grad():
                mutate(m2)
            return float((run(m2, x, cfg["window"], cfg["scale"]) - ref).abs().max())

        def tanh(m2):
            for mod in m2.modules():
                if isinstance(mod, nn.GELU):
                    mod.approximate = "tanh"

        def no_cab(m2):
            for n, p in m2.named_parameters():
                if ".conv_block.cab.2." in n:
                    p.zero_()

        def no_ocab_bias(m2):
            for n, p in m2.named_parameters():
                if "overlap_attn.relative_position_bias_table" in n:
                    p.zero_()

        def clamped_ocab_index(m2):
            # what a port that clamps the negative OCAB indices instead of wrapping them gives
            m2.relative_position_index_OCA = m2.relative_position_index_OCA.clamp(min=0)

        checks["tanh GELU"] = dev(tanh)
        checks["CAB branch removed"] = dev(no_cab)
        checks["OCAB bias removed"] = dev(no_ocab_bias)
        checks["OCAB index clamped"] = dev(clamped_ocab_index)
        b, _, h, w = x32.shape
        manifest.append(dict(
            name=name, weights=weights, weights_format=fmt, io=io, scale=cfg["scale"],
            window=cfg["window"], overlap_ratio=cfg["overlap"], embed_dim=cfg["embed_dim"],
            depths=list(cfg["depths"]), heads=list(cfg["heads"]),
            compress_ratio=cfg["compress"], squeeze_factor=cfg["squeeze"],
            num_feat=cfg["num_feat"], patch_norm=cfg["patch_norm"],
            resi_connection=cfg["resi"], batch=b, input_h=h, input_w=w, seed=cfg["seed"],
            covers=cfg["covers"],
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
