#!/usr/bin/env python3
"""Write the float64 SwinIR reference fixtures used by the Rust tests (tests/golden/swinir/).

Run from anywhere:  python tests/golden/make_golden_swinir.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded: the weights are
random, the inputs procedural.

The reference is spandrel's SwinIR module (the official network_swinir.py architecture) in
float64 and eval mode, every parameter randomised (see make_golden.py's randomise: bias tables
and LayerNorm affine terms included). SwinIR's own forward pads the input reflect-101 on the
bottom and right to a window multiple when needed (its check_image_size) and crops the output;
we pad the same way before calling it, so its own padding is a no-op, and do not clamp.

The restoration models (denoising and JPEG artefact removal: no upsampler, scale 1, the input
plus conv_last of the body) are built the same way; those with window 7 use img_range 255, the
rule spandrel's loader applies (only the JPEG models were released with window 7). Each of
those fixtures is also loaded back through spandrel's own loader, which must reproduce the
reference exactly: so the window-7 rule is the reference's, not ours.

SwinIR hard-codes num_feat = 64 for its upsamplers; the fixtures swap those layers for
narrower ones of the same kind (same forward code) to keep each file small. The Rust loader
reads num_feat from the weights.

  --bench DIR   also write a SwinIR-M-shaped x4 model (E 180, 6 groups of 6 blocks, 6 heads,
                window 8, num_feat 64; random weights, ~48 MB), the colour JPEG model's shape
                (the same body, window 7, x1) and a 64x64 input there, for timing; not a
                fixture.
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

from spandrel.architectures.SwinIR import SwinIR  # noqa: E402
from spandrel.architectures.SwinIR.__arch.SwinIR import Upsample, UpsampleOneStep  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

WINDOW = 8

# Each case: the network, its narrower upsampler width, the input, the weights file format.
CASES = [
    dict(
        name="classical_x2",
        upsampler="pixelshuffle", resi="1conv", scale=2, embed_dim=24, depths=(2, 2),
        heads=(6, 4), num_feat=16, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 21, 19)), seed=11,
        covers="classical (pixelshuffle) x2, 1conv; two groups with different head counts "
               "(head dims 4 and 6); both dims padded (21x19 -> 24x24)",
    ),
    dict(
        name="classical_x3",
        upsampler="pixelshuffle", resi="1conv", scale=3, embed_dim=20, depths=(3,),
        heads=(5,), num_feat=12, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 13, 18)), seed=12,
        covers="classical x3 (one 3x pixel shuffle); an odd depth (3 blocks: plain, shifted, "
               "plain); 13x18 -> 16x24",
    ),
    dict(
        name="classical_x4_ema",
        upsampler="pixelshuffle", resi="1conv", scale=4, embed_dim=16, depths=(2,),
        heads=(2,), num_feat=8, patch_norm=True, img_size=16,
        input=dict(kind="pattern", shape=(1, 3, 17, 9)), seed=13, pth="official",
        covers="classical x4 (two pixel-shuffle stages); the official .pth layout "
               "{'params': OTHER, 'params_ema': reference}, buffers included (training size "
               "16x16); 17x9 -> 24x16",
    ),
    dict(
        name="lightweight_x2_b2",
        upsampler="pixelshuffledirect", resi="1conv", scale=2, embed_dim=12, depths=(2, 2),
        heads=(3, 2), num_feat=None, patch_norm=True,
        input=dict(kind="noise", shape=(2, 3, 16, 16)), seed=14,
        covers="lightweight (pixelshuffledirect) x2; batch of 2; no padding (16x16)",
    ),
    dict(
        name="lightweight_x3",
        upsampler="pixelshuffledirect", resi="1conv", scale=3, embed_dim=12, depths=(2,),
        heads=(3,), num_feat=None, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 10, 12)), seed=18,
        covers="lightweight (pixelshuffledirect) x3; 10x12 -> 16x16",
    ),
    dict(
        name="lightweight_x4",
        upsampler="pixelshuffledirect", resi="1conv", scale=4, embed_dim=12, depths=(2,),
        heads=(3,), num_feat=None, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 12, 20)), seed=15,
        covers="lightweight (pixelshuffledirect) x4 (one 4x shuffle of 48 channels); "
               "12x20 -> 16x24",
    ),
    dict(
        name="realworld_x4_3conv",
        upsampler="nearest+conv", resi="3conv", scale=4, embed_dim=16, depths=(2, 2),
        heads=(4, 2), num_feat=8, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 11, 20)), seed=16,
        covers="real-world (nearest+conv) x4 with the 3conv residual connections (as "
               "SwinIR-L); 11x20 -> 16x24",
    ),
    dict(
        name="realworld_x2_nonorm",
        upsampler="nearest+conv", resi="1conv", scale=2, embed_dim=16, depths=(2,),
        heads=(4,), num_feat=8, patch_norm=False,
        input=dict(kind="pattern", shape=(1, 3, 9, 16)), seed=23, pth="bare",
        covers="real-world (nearest+conv) x2 (conv_up1 only); patch_norm off; a bare "
               "state-dict .pth with buffers; 9x16 -> 16x16",
    ),
    dict(
        name="realworld_x8",
        upsampler="nearest+conv", resi="1conv", scale=8, embed_dim=12, depths=(2,),
        heads=(3,), num_feat=8, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 7, 9)), seed=34,
        covers="real-world (nearest+conv) x8 (conv_up1, conv_up2, conv_up3); 7x9 -> 8x16",
    ),
    dict(
        name="denoise_color",
        upsampler="", resi="1conv", scale=1, embed_dim=16, depths=(2, 2),
        heads=(4, 2), num_feat=None, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 19, 13)), seed=31, pth="params",
        covers="colour denoising (no upsampler, x1, img_range 1) as 005_colorDN; the "
               "official {'params': ...} .pth; 19x13 -> 24x16",
    ),
    dict(
        name="jpeg_color_w7",
        upsampler="", resi="1conv", scale=1, embed_dim=16, depths=(2,),
        heads=(2,), num_feat=None, patch_norm=True, window=7,
        input=dict(kind="pattern", shape=(1, 3, 23, 15)), seed=32,
        covers="colour JPEG artefact removal as 006_colorCAR: window 7, img_range 255, no "
               "upsampler; 23x15 -> 28x21",
    ),
    dict(
        name="classical_x2_w7",
        upsampler="pixelshuffle", resi="1conv", scale=2, embed_dim=12, depths=(2,),
        heads=(3,), num_feat=8, patch_norm=True, window=7,
        input=dict(kind="pattern", shape=(1, 3, 14, 10)), seed=33,
        covers="an upsampler with window 7, so img_range 255 (the reference loader's rule "
               "applies to every SwinIR); 14x10 -> 14x14",
    ),
]


def window_of(cfg):
    return cfg.get("window", WINDOW)


def build(cfg):
    window = window_of(cfg)
    img_size = cfg.get("img_size", 4 * window)
    assert img_size > window
    m = SwinIR(
        img_size=img_size, patch_size=1, in_chans=3, embed_dim=cfg["embed_dim"],
        depths=list(cfg["depths"]), num_heads=list(cfg["heads"]), window_size=window,
        mlp_ratio=2.0, qkv_bias=True, drop_path_rate=0.0, upscale=cfg["scale"],
        img_range=255.0 if window == 7 else 1.0, upsampler=cfg["upsampler"],
        resi_connection=cfg["resi"],
        patch_norm=cfg["patch_norm"],
    )
    f = cfg["num_feat"]
    if f is not None and f != 64:
        # the same layer kinds as the official upsampler, narrower
        e = cfg["embed_dim"]
        m.conv_before_upsample = nn.Sequential(nn.Conv2d(e, f, 3, 1, 1), nn.LeakyReLU(inplace=True))
        if cfg["upsampler"] == "pixelshuffle":
            m.upsample = Upsample(cfg["scale"], f)
        else:
            m.conv_up1 = nn.Conv2d(f, f, 3, 1, 1)
            if cfg["scale"] >= 4:
                m.conv_up2 = nn.Conv2d(f, f, 3, 1, 1)
            if cfg["scale"] == 8:
                m.conv_up3 = nn.Conv2d(f, f, 3, 1, 1)
            m.conv_hr = nn.Conv2d(f, f, 3, 1, 1)
        m.conv_last = nn.Conv2d(f, 3, 3, 1, 1)
    return m.double().eval()


@torch.no_grad()
def boost(model):
    """The real-world upsampler is a chain of LeakyReLU(0.2) layers that shrinks fan-in
    scaled random features at every step, until the output is little more than the mean;
    steeper weights there keep the body's contribution (and its bugs) visible."""
    if not model.patch_norm:
        # make_golden's small conv_first exists to make patch_embed.norm's eps visible;
        # without that norm it only leaves the body a feeble input
        model.conv_first.weight.copy_((model.conv_first.weight * 4).float().double())
    if model.upsampler != "nearest+conv":
        return model
    for name, p in model.named_parameters():
        if name.split(".")[0] in ("conv_before_upsample", "conv_up1", "conv_up2", "conv_up3",
                                  "conv_hr", "conv_last"):
            if name.endswith(".weight"):
                p.copy_((p * 1.4).float().double())
    return model


@torch.no_grad()
def calibrate(model, x, scale, target=0.5):
    """Scale the last layer so the output's spread around the mean is about `target`, as a
    trained model's is: random weights otherwise give outputs of a few units, and an error
    measured in dB over [0, 1] would then say more about that scale than about the port."""
    last = model.upsample[0] if model.upsampler == "pixelshuffledirect" else model.conv_last
    if model.upsampler == "":
        # a restoration model's output is its input plus this layer's correction: scale that
        std = float((run(model, x, scale) - x).std())
        target *= 0.6
    else:
        std = float(run(model, x, scale).std())
    for p in (last.weight, last.bias):
        p.copy_((p * (target / std)).float().double())
    return model


def make_input(spec, seed):
    g = torch.Generator().manual_seed(seed + 7)
    shape = spec["shape"]
    if spec["kind"] == "noise":
        return torch.rand(shape, generator=g, dtype=torch.float64).float()
    # a smooth colour pattern with edges and a little noise: image-like, in [0, 1]
    b, c, h, w = shape
    yy = torch.arange(h, dtype=torch.float64).view(1, 1, h, 1)
    xx = torch.arange(w, dtype=torch.float64).view(1, 1, 1, w)
    phase = torch.rand((b, c, 1, 1), generator=g, dtype=torch.float64) * 6.28
    base = 0.5 + 0.3 * torch.sin(0.37 * xx + 0.23 * yy + phase)
    edge = ((xx + 0.6 * yy) > (w * 0.55)).double() * 0.15
    noise = torch.rand(shape, generator=g, dtype=torch.float64) * 0.1
    return (base + edge + noise).clamp(0, 1).float()


@torch.no_grad()
def run(model, x, scale):
    _, _, h, w = x.shape
    win = model.window_size
    ph = (win - h % win) % win
    pw = (win - w % win) % win
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph), mode="reflect")
    return model(x)[:, :, : h * scale, : w * scale]


def save_io(path, x, y):
    save_file({"input": x.float().contiguous(), "output": y.double().contiguous()}, str(path))


def bench_model(out_dir):
    cfg = dict(upsampler="pixelshuffle", resi="1conv", scale=4, embed_dim=180, depths=(6,) * 6,
               heads=(6,) * 6, num_feat=64, patch_norm=True, img_size=64)
    m = randomise(build(cfg), 99)
    save_file(params_sd(m), str(out_dir / "swinir_m_x4_random.safetensors"))
    jpeg = dict(upsampler="", resi="1conv", scale=1, embed_dim=180, depths=(6,) * 6,
                heads=(6,) * 6, num_feat=None, patch_norm=True, window=7, img_size=126)
    m = randomise(build(jpeg), 98)
    save_file(params_sd(m), str(out_dir / "swinir_m_jpeg_random.safetensors"))
    x = make_input(dict(kind="pattern", shape=(1, 3, 64, 64)), 99)
    save_file({"input": x.contiguous()}, str(out_dir / "input_64.safetensors"))
    print(f"bench model written to {out_dir}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "swinir"))
    ap.add_argument("--bench", default=None)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.bench:
        bench_model(Path(args.bench))
        return
    torch.manual_seed(0)
    manifest = []
    for cfg in CASES:
        name = cfg["name"]
        x32 = make_input(cfg["input"], cfg["seed"])
        model = calibrate(boost(randomise(build(cfg), cfg["seed"])), x32.double(), cfg["scale"])
        ref = run(model, x32.double(), cfg["scale"])
        assert torch.isfinite(ref).all()
        kind = cfg.get("pth")
        if kind == "official":
            other = boost(randomise(build(cfg), cfg["seed"] + 1000))
            weights = f"{name}.pth"
            torch.save({"params": full_sd(other), "params_ema": full_sd(model)}, out_dir / weights)
            fmt = "pth: {'params': other weights, 'params_ema': reference weights}, buffers included"
        elif kind == "params":
            weights = f"{name}.pth"
            torch.save({"params": full_sd(model)}, out_dir / weights)
            fmt = "pth: {'params': reference weights}, buffers included"
        elif kind == "bare":
            weights = f"{name}.pth"
            torch.save(full_sd(model), out_dir / weights)
            fmt = "pth: a bare state dict, buffers included"
        else:
            weights = f"{name}.safetensors"
            save_file(params_sd(model), str(out_dir / weights))
            fmt = "safetensors: parameters only (no buffers), float32"
        io = f"{name}.io.safetensors"
        save_io(out_dir / io, x32, ref)

        f32 = run(copy.deepcopy(model).float(), x32, cfg["scale"]).double()
        f32_dev = float((f32 - ref).abs().max())
        # how far the commonest mistakes land, so the test bound is known to catch them
        bugs = {}
        m2 = copy.deepcopy(model)
        for mod in m2.modules():
            if isinstance(mod, nn.GELU):
                mod.approximate = "tanh"
        bugs["tanh GELU"] = float((run(m2, x32.double(), cfg["scale"]) - ref).abs().max())
        m2 = copy.deepcopy(model)
        for mod in m2.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.eps = 1e-6
        bugs["LayerNorm eps 1e-6"] = float((run(m2, x32.double(), cfg["scale"]) - ref).abs().max())
        if window_of(cfg) == 7:
            m2 = copy.deepcopy(model)
            m2.img_range = 1.0
            bugs["img_range 1"] = float((run(m2, x32.double(), cfg["scale"]) - ref).abs().max())
        if cfg["upsampler"] == "":
            # the reference loader reads the same file the same way (window 7: img_range 255)
            from spandrel import ModelLoader
            loaded = ModelLoader().load_from_state_dict(full_sd(model)).model.double().eval()
            assert loaded.upsampler == model.upsampler and loaded.img_range == model.img_range
            assert loaded.upscale == model.upscale
            same = float((run(loaded, x32.double(), cfg["scale"]) - ref).abs().max())
            assert same == 0.0, same
            bugs["input not added"] = float((ref - x32.double()).abs().max())
        b, _, h, w = x32.shape
        entry = dict(
            name=name, weights=weights, weights_format=fmt, io=io, scale=cfg["scale"],
            window=window_of(cfg), upsampler=cfg["upsampler"] or "none", resi_connection=cfg["resi"],
            embed_dim=cfg["embed_dim"], depths=list(cfg["depths"]), heads=list(cfg["heads"]),
            num_feat=cfg["num_feat"], patch_norm=cfg["patch_norm"], batch=b, input_h=h,
            input_w=w, seed=cfg["seed"], covers=cfg["covers"],
            self_check=dict(float32_vs_float64_max_abs=f32_dev, bug_max_abs=bugs,
                            out_std=float(ref.std()), out_min=float(ref.min()),
                            out_max=float(ref.max())),
        )
        manifest.append(entry)
        print(f"{name}: out std {ref.std():.3f} range [{ref.min():.3f}, {ref.max():.3f}] "
              f"f32-vs-f64 {f32_dev:.2e}; " + ", ".join(f"{k} {v:.2e}" for k, v in bugs.items()),
              flush=True)
    with open(out_dir / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
