#!/usr/bin/env python3
"""Write the float64 Swin2SR reference fixtures used by the Rust tests (tests/golden/swin2sr/).

Run from anywhere:  python tests/golden/make_golden_swin2sr.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded: the weights are
random, the inputs procedural.

The reference is spandrel's Swin2SR module (the official network_swin2sr.py architecture) in
float64 and eval mode, every parameter randomised (make_golden.py's scales, with the SwinV2
parts set apart: logit scales spread on both sides of the clamp at log(100), q and v biases,
and the continuous position-bias MLP). As for SwinIR, the input is reflect-padded (reflect-101)
on the bottom and right to a window multiple before the module is called, and the output is
cropped and not clamped.

That padding matters for one upsampler. pixelshuffle_aux resizes the input bicubically to
(H*s, W*s) of the size the caller gave; called on an unpadded input of a size that is no
window multiple, the module resizes its own padded input to the unpadded size times s, a
stretch of the image's bottom and right that the upsampled features do not share. Padded
first (as the official test script pads), the resize is an exact x s. The manifest records how
far spandrel's own call on the unpadded input lands from that for the odd-sized aux case.

Every file is written as the official checkpoints are, buffers included: Swin2SR's window is
recorded only in its buffers (relative_position_index), and whether its blocks shift only in
attn_mask's presence. Each fixture is also loaded back through spandrel's own loader, which
must reproduce the reference exactly.

Swin2SR fixes num_feat = 64 for its upsamplers; the fixtures swap those layers for narrower
ones of the same kind (same forward code). The Rust loader reads num_feat from the weights.

  --bench DIR   also write a Swin2SR classical x2 model of the released shape (E 180, 6
                groups of 6 blocks, 6 heads, window 8, num_feat 64; random weights, ~50 MB)
                and a 64x64 input, for timing; not a fixture.
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
from make_golden import full_sd, randomise  # noqa: E402
from make_golden_swinir import make_input  # noqa: E402

from spandrel.architectures.Swin2SR import Swin2SR  # noqa: E402
from spandrel.architectures.Swin2SR.__arch.Swin2SR import Upsample, UpsampleOneStep  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

WINDOW = 8

CASES = [
    dict(
        name="classical_x2",
        upsampler="pixelshuffle", resi="1conv", scale=2, embed_dim=24, depths=(2, 2),
        heads=(6, 4), num_feat=16, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 21, 19)), seed=41, pth="official",
        covers="classical (pixelshuffle) x2, 1conv; two groups with different head counts "
               "(head dims 4 and 6); the official .pth layout {'params': OTHER, "
               "'params_ema': reference} with buffers; 21x19 -> 24x24",
    ),
    dict(
        name="classical_x3_3conv",
        upsampler="pixelshuffle", resi="3conv", scale=3, embed_dim=16, depths=(3,),
        heads=(2,), num_feat=12, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 13, 18)), seed=42,
        covers="classical x3 (one 3x shuffle) with the 3conv residual connections; an odd "
               "depth (plain, shifted, plain); 13x18 -> 16x24",
    ),
    dict(
        name="lightweight_x4_noqkvbias",
        upsampler="pixelshuffledirect", resi="1conv", scale=4, embed_dim=12, depths=(2,),
        heads=(3,), num_feat=None, patch_norm=True, qkv_bias=False,
        input=dict(kind="noise", shape=(2, 3, 8, 16)), seed=43,
        covers="lightweight (pixelshuffledirect) x4; no q/v biases (qkv_bias=False); batch of "
               "2; no padding (8x16)",
    ),
    dict(
        name="realworld_x4_nonorm",
        upsampler="nearest+conv", resi="1conv", scale=4, embed_dim=16, depths=(2, 2),
        heads=(4, 2), num_feat=8, patch_norm=False, pth="bare",
        input=dict(kind="pattern", shape=(1, 3, 11, 20)), seed=44,
        covers="real-world (nearest+conv) x4; patch_norm off; a bare state-dict .pth; "
               "11x20 -> 16x24",
    ),
    dict(
        name="compressed_x4_aux",
        upsampler="pixelshuffle_aux", resi="1conv", scale=4, embed_dim=16, depths=(2,),
        heads=(4,), num_feat=8, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 16, 24)), seed=45,
        covers="compressed-input SR (pixelshuffle_aux: the bicubic of the input through "
               "conv_bicubic, an auxiliary RGB output fed back) x4; 16x24, no padding",
    ),
    dict(
        name="compressed_x2_aux_odd",
        upsampler="pixelshuffle_aux", resi="1conv", scale=2, embed_dim=12, depths=(2,),
        heads=(3,), num_feat=8, patch_norm=True,
        input=dict(kind="pattern", shape=(1, 3, 13, 21)), seed=46,
        covers="pixelshuffle_aux x2 on an odd size, padded before the call (13x21 -> 16x24): "
               "the bicubic branch of the padded input at exactly x2",
    ),
    dict(
        name="jpeg_w7",
        upsampler="", resi="1conv", scale=1, embed_dim=16, depths=(2,),
        heads=(2,), num_feat=None, patch_norm=True, window=7,
        input=dict(kind="pattern", shape=(1, 3, 23, 15)), seed=47,
        covers="JPEG artefact removal as Swin2SR_Jpeg_dynamic: window 7, img_range 255, no "
               "upsampler (input plus conv_last); 23x15 -> 28x21",
    ),
    dict(
        name="unshifted_x2",
        upsampler="pixelshuffle", resi="1conv", scale=2, embed_dim=12, depths=(2,),
        heads=(3,), num_feat=8, patch_norm=True, img_size=8,
        input=dict(kind="pattern", shape=(1, 3, 16, 16)), seed=48,
        covers="trained at one window (img_size 8): no block shifts and no attn_mask in the "
               "file, as the reference loader reads it; 16x16",
    ),
]


def window_of(cfg):
    return cfg.get("window", WINDOW)


def build(cfg):
    window = window_of(cfg)
    # Twice the window: shifted blocks (the training size passes one window), and attn_mask
    # buffers a quarter of what the released training sizes give.
    img_size = cfg.get("img_size", 2 * window)
    m = Swin2SR(
        img_size=img_size, patch_size=1, in_chans=3, embed_dim=cfg["embed_dim"],
        depths=list(cfg["depths"]), num_heads=list(cfg["heads"]), window_size=window,
        mlp_ratio=2.0, qkv_bias=cfg.get("qkv_bias", True), drop_path_rate=0.0,
        upscale=cfg["scale"], img_range=255.0 if window == 7 else 1.0,
        upsampler=cfg["upsampler"], resi_connection=cfg["resi"], patch_norm=cfg["patch_norm"],
    )
    return narrow(m, cfg).double().eval()


def narrow(m, cfg):
    """The same layer kinds as the official upsampler, `num_feat` wide instead of 64."""
    f = cfg["num_feat"]
    if f is None or f == 64:
        return m
    e = cfg["embed_dim"]
    m.conv_before_upsample = nn.Sequential(nn.Conv2d(e, f, 3, 1, 1), nn.LeakyReLU(inplace=True))
    if cfg["upsampler"] in ("pixelshuffle", "pixelshuffle_aux"):
        m.upsample = Upsample(cfg["scale"], f)
    else:
        m.conv_up1 = nn.Conv2d(f, f, 3, 1, 1)
        m.conv_up2 = nn.Conv2d(f, f, 3, 1, 1)
        m.conv_hr = nn.Conv2d(f, f, 3, 1, 1)
    if cfg["upsampler"] == "pixelshuffle_aux":
        m.conv_bicubic = nn.Conv2d(3, f, 3, 1, 1)
        m.conv_aux = nn.Conv2d(f, 3, 3, 1, 1)
        m.conv_after_aux = nn.Sequential(nn.Conv2d(3, f, 3, 1, 1), nn.LeakyReLU(inplace=True))
    m.conv_last = nn.Conv2d(f, 3, 3, 1, 1)
    return m


def load_as_reference_loader(sd, cfg):
    """The model spandrel's loader builds from `sd`, its upsampler narrowed as `cfg` says
    (the loader itself assumes num_feat 64): every other hyperparameter is its own reading."""
    import spandrel.architectures.Swin2SR as entry
    from spandrel import ModelLoader

    def narrowed(**kw):
        return narrow(Swin2SR(**kw), cfg)

    entry.Swin2SR = narrowed
    try:
        return ModelLoader().load_from_state_dict(sd).model.double().eval()
    finally:
        entry.Swin2SR = Swin2SR


@torch.no_grad()
def swin_v2(model, seed):
    """The SwinV2 parameters at scales of their own: logit scales around log(10) (the
    initial value) up to past the clamp at log(100), so the clamp matters; q and v biases
    of 0.2; the position-bias MLP's first layer wide enough that 16 sigmoid(.) spreads."""
    g = torch.Generator().manual_seed(seed + 500)
    for name, p in model.named_parameters():
        if name.endswith("logit_scale"):
            r = 1.5 + torch.rand(p.shape, generator=g, dtype=torch.float64) * 4.0
        elif name.endswith("q_bias") or name.endswith("v_bias"):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
        elif ".cpb_mlp.0." in name:
            r = torch.randn(p.shape, generator=g, dtype=torch.float64) * 1.5
        elif ".cpb_mlp.2." in name:
            r = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.15
        else:
            continue
        p.copy_(r.float().double())
    return model


@torch.no_grad()
def boost(model):
    """As for SwinIR: steeper weights through the real-world upsampler's LeakyReLU chain, and
    a larger conv_first where no patch norm follows it."""
    if not model.patch_norm:
        model.conv_first.weight.copy_((model.conv_first.weight * 4).float().double())
    if model.upsampler != "nearest+conv":
        return model
    for name, p in model.named_parameters():
        if name.split(".")[0] in ("conv_before_upsample", "conv_up1", "conv_up2", "conv_hr",
                                  "conv_last") and name.endswith(".weight"):
            p.copy_((p * 1.4).float().double())
    return model


@torch.no_grad()
def calibrate(model, x, scale, target=0.5):
    """Scale the last layer so the output spreads about `target` around the mean, as a
    trained model's does (see make_golden_swinir.py)."""
    last = model.upsample[0] if model.upsampler == "pixelshuffledirect" else model.conv_last
    if model.upsampler == "":
        std = float((run(model, x, scale) - x).std())
        target *= 0.6
    else:
        std = float(run(model, x, scale).std())
    for p in (last.weight, last.bias):
        p.copy_((p * (target / std)).float().double())
    return model


def pad(x, win):
    _, _, h, w = x.shape
    ph = (win - h % win) % win
    pw = (win - w % win) % win
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph), mode="reflect")
    return x


@torch.no_grad()
def run(model, x, scale):
    _, _, h, w = x.shape
    return model(pad(x, model.window_size))[:, :, : h * scale, : w * scale]


def save_io(path, x, y):
    save_file({"input": x.float().contiguous(), "output": y.double().contiguous()}, str(path))


def state_dict_file(model, cfg, out_dir, name):
    kind = cfg.get("pth")
    if kind == "official":
        other = swin_v2(boost(randomise(build(cfg), cfg["seed"] + 1000)), cfg["seed"] + 1000)
        weights = f"{name}.pth"
        torch.save({"params": full_sd(other), "params_ema": full_sd(model)}, out_dir / weights)
        return weights, "pth: {'params': other weights, 'params_ema': reference weights}, buffers included"
    if kind == "bare":
        weights = f"{name}.pth"
        torch.save(full_sd(model), out_dir / weights)
        return weights, "pth: a bare state dict, buffers included"
    weights = f"{name}.safetensors"
    save_file(full_sd(model), str(out_dir / weights))
    return weights, "safetensors: parameters float32 and buffers (int64 index, float32 mask and coordinates)"


def bench_model(out_dir):
    cfg = dict(upsampler="pixelshuffle", resi="1conv", scale=2, embed_dim=180, depths=(6,) * 6,
               heads=(6,) * 6, num_feat=64, patch_norm=True, img_size=64)
    m = swin_v2(randomise(build(cfg), 97), 97)
    save_file(full_sd(m), str(out_dir / "swin2sr_classical_x2_random.safetensors"))
    x = make_input(dict(kind="pattern", shape=(1, 3, 64, 64)), 99)
    save_file({"input": x.contiguous()}, str(out_dir / "input_64.safetensors"))
    print(f"bench model written to {out_dir}")


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "swin2sr"))
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
        x = x32.double()
        model = swin_v2(boost(randomise(build(cfg), cfg["seed"])), cfg["seed"])
        model = calibrate(model, x, cfg["scale"])
        ref = run(model, x, cfg["scale"])
        assert torch.isfinite(ref).all()
        weights, fmt = state_dict_file(model, cfg, out_dir, name)
        io = f"{name}.io.safetensors"
        save_io(out_dir / io, x32, ref)

        # the reference loader reads the same file the same way: window, shift, range, scale
        loaded = load_as_reference_loader(full_sd(model), cfg)
        assert loaded.upsampler == model.upsampler and loaded.img_range == model.img_range
        assert loaded.upscale == model.upscale and loaded.window_size == model.window_size
        same = float((run(loaded, x, cfg["scale"]) - ref).abs().max())
        assert same == 0.0, (name, same)

        f32 = run(copy.deepcopy(model).float(), x32, cfg["scale"]).double()
        f32_dev = float((f32 - ref).abs().max())
        # how far the commonest mistakes land, so the test bound is known to catch them
        bugs = {}

        def dev(m2):
            return float((run(m2, x, cfg["scale"]) - ref).abs().max())

        m2 = copy.deepcopy(model)
        for mod in m2.modules():
            if isinstance(mod, nn.GELU):
                mod.approximate = "tanh"
        bugs["tanh GELU"] = dev(m2)
        # the clamp of the logit scales at log(100) left out (torch.clamp is only called there)
        clamp = torch.clamp
        torch.clamp = lambda t, min=None, max=None: t
        try:
            bugs["logit scale not clamped"] = dev(model)
        finally:
            torch.clamp = clamp
        m2 = copy.deepcopy(model)
        for mod in m2.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.eps = 1e-6
        bugs["LayerNorm eps 1e-6"] = dev(m2)
        m2 = copy.deepcopy(model)
        for mod in m2.modules():
            if hasattr(mod, "cpb_mlp"):
                mod.cpb_mlp[2].weight.zero_()
        bugs["no position bias (cpb_mlp output 0: 8 everywhere)"] = dev(m2)
        if cfg["upsampler"] == "pixelshuffle_aux":
            m2 = copy.deepcopy(model)
            m2.conv_bicubic.weight.zero_()
            m2.conv_bicubic.bias.zero_()
            bugs["bicubic branch left out"] = dev(m2)
            _, _, h, w = x.shape
            if h % model.window_size or w % model.window_size:
                # spandrel's own call on the unpadded input (see the docstring)
                with torch.no_grad():
                    own = model(x)[:, :, : h * cfg["scale"], : w * cfg["scale"]]
                bugs["the module called on the unpadded input (its stretched bicubic)"] = float(
                    (own - ref).abs().max())
        if window_of(cfg) == 7:
            m2 = copy.deepcopy(model)
            m2.img_range = 1.0
            bugs["img_range 1"] = dev(m2)
        b, _, h, w = x32.shape
        shifted = any(k.endswith("attn_mask") for k in model.state_dict())
        entry = dict(
            name=name, weights=weights, weights_format=fmt, io=io, scale=cfg["scale"],
            window=window_of(cfg), shifted=shifted, upsampler=cfg["upsampler"] or "none",
            resi_connection=cfg["resi"], embed_dim=cfg["embed_dim"], depths=list(cfg["depths"]),
            heads=list(cfg["heads"]), num_feat=cfg["num_feat"], patch_norm=cfg["patch_norm"],
            qkv_bias=cfg.get("qkv_bias", True), batch=b, input_h=h, input_w=w,
            seed=cfg["seed"], covers=cfg["covers"],
            parameters=sum(p.numel() for p in model.parameters()),
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
