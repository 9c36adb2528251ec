#!/usr/bin/env python3
"""Write the float64 DRCT reference fixtures used by the Rust tests.

Run from anywhere:  python tests/golden/make_golden.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors, scikit-image (for the photo crops, which
ship inside the scikit-image package; nothing is downloaded).

The reference is spandrel's DRCT module (numerically the official DRCT_arch) in float64 and
eval mode, called directly rather than through spandrel's ImageModelDescriptor: the
descriptor pads to a multiple of 16 (reflect, then replicate for whatever reflect cannot
reach), which is not the official test pipeline for window sizes other than 16. We pad
ourselves exactly as the official DRCTModel.pre_process does (reflect-101, bottom/right, to
the next multiple of the window, only when needed) and crop the output to (H*s, W*s).
Outputs are NOT clamped.
"""

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from spandrel import ModelLoader
from spandrel.architectures.DRCT import DRCT
from spandrel.architectures.DRCT.__arch.drct_arch import (
    Mlp,
    SwinTransformerBlock,
    WindowAttention,
)

torch.set_num_threads(min(2, torch.get_num_threads()))

# The released models' mean, a float32 tensor in spandrel/official code; note that the
# float64 reference therefore subtracts float32(0.4488) etc., not the decimal values.
RGB_MEAN = (0.4488, 0.4371, 0.4040)


# --------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------
# Each case: a model config, an input recipe, and the file formats it is written in.
# E/gc/heads were chosen so the per-block head counts h_k = h - (d_k mod h) vary and give
# odd head dims (see heads_and_dims()).
CASES = [
    dict(
        name="x4_w8_g2",
        scale=4, window=8, embed_dim=24, gc=10, heads=(6, 4), img_size=32,
        input=dict(kind="photo", image="astronaut", crops=[(60, 180, 20, 27)]),
        seed=101,
        covers="x4 (two pixel-shuffle stages); window 8; 2 residual groups with different "
               "head counts (6 and 4) -> heads 6/2/4/6/2 and 4/2/4/2/4, head dims "
               "4/17/11/9/32 and 6/17/11/27/16; H and W both padded (20x27 -> 24x32), H != W",
    ),
    dict(
        name="x3_w4",
        scale=3, window=4, embed_dim=21, gc=6, heads=(3,), img_size=16,
        input=dict(kind="photo", image="coffee", crops=[(150, 250, 13, 18)]),
        seed=202,
        covers="x3 (one 3x pixel shuffle, 576-channel conv); window 4; odd embed dim 21; all "
               "head dims odd (7/9/11/13/15); both dims padded (13x18 -> 16x20)",
    ),
    dict(
        name="x2_w8_b2",
        scale=2, window=8, embed_dim=20, gc=6, heads=(4,), img_size=32,
        input=dict(kind="photo", image="chelsea", crops=[(80, 150, 19, 30), (150, 260, 19, 30)]),
        seed=303,
        covers="x2; window 8; batch 2 (two different crops, shared shift mask); heads "
               "4/2/4/2/4, head dims 5/13/8/19/11; both dims padded (19x30 -> 24x32)",
    ),
    dict(
        name="x2_w8_official",
        scale=2, window=8, embed_dim=16, gc=10, heads=(4,), img_size=16,
        input=dict(kind="photo", image="astronaut", crops=[(300, 250, 21, 17)]),
        seed=505,
        pth="official",
        covers="official .pth layout: {'params': OTHER weights, 'params_ema': the reference "
               "weights}, with relative_position_index and attn_mask buffers (training size "
               "16x16 -> masks [4,64,64]); a loader that takes 'params' fails; heads 4/2/4/2/4, "
               "head dims 4/13/9/23/14; 21x17 -> 24x24 (H > W)",
    ),
    dict(
        name="x2_w8_module_noise",
        reuse_weights="x2_w8_official",
        input=dict(kind="noise", shape=(1, 3, 16, 13)),
        pth="module",
        covers="bare state dict wrapped as {'state_dict': ...} with a 'module.' prefix on every "
               "key (buffers included); same weights as x2_w8_official's params_ema; uniform "
               "noise input; only W padded (16x13 -> 16x16), H already a multiple",
    ),
]


def heads_and_dims(embed_dim, gc, h):
    """Per-block (width, heads, head_dim, mlp hidden) of one residual dense group."""
    out = []
    for k in range(5):
        d = embed_dim + k * gc
        hk = h if k == 0 else h - (d % h)
        if d % hk:
            raise ValueError(f"width {d} not divisible by {hk} heads")
        # blocks 4 and 5 hard-code mlp_ratio 1 in the official code
        hidden = int(d * (2.0 if k < 3 else 1.0))
        out.append(dict(width=d, heads=hk, head_dim=d // hk, mlp_hidden=hidden))
    return out


# --------------------------------------------------------------------------------------
# model + weights
# --------------------------------------------------------------------------------------
def build(cfg):
    groups = len(cfg["heads"])
    # img_size only sets the cached attn_mask and must exceed the window, or spandrel shrinks
    # the window to the input resolution.
    assert cfg["img_size"] > cfg["window"]
    m = DRCT(
        img_size=cfg["img_size"], patch_size=1, in_chans=3, embed_dim=cfg["embed_dim"],
        depths=(6,) * groups, num_heads=tuple(cfg["heads"]), window_size=cfg["window"],
        mlp_ratio=2.0, qkv_bias=True, drop_path_rate=0.0, upscale=cfg["scale"],
        img_range=1.0, upsampler="pixelshuffle", resi_connection="1conv", gc=cfg["gc"],
    )
    return m.double().eval()


def _std(name, shape):
    """Scale of each random tensor: fan-in scaled so activations stay O(1), biases and
    LayerNorm affine terms large enough that a port ignoring them fails."""
    if name.endswith("relative_position_bias_table"):
        return 1.0
    if ".norm" in name or name.startswith("norm.") or "patch_embed.norm" in name:
        return 0.3  # around 1 (weight) or 0 (bias), see randomise()
    if name.endswith(".bias"):
        if ".mlp.fc1." in name:
            return 1.0  # spreads GELU inputs over the range where erf and tanh forms differ
        return 0.1
    fan_in = int(np.prod(shape[1:]))
    gain = 1.0
    if ".attn.qkv." in name:
        gain = 1.6  # peakier attention, so positions, bias table and mask all matter
    elif ".mlp.fc1." in name:
        gain = 2.5  # same reason as the fc1 bias
    elif ".mlp.fc2." in name:
        gain = 1.5
    elif ".attn.proj." in name:
        gain = 0.8
    elif name.startswith("conv_first."):
        # small features in front of patch_embed.norm make the LayerNorm eps visible
        gain = 0.15
    elif name.startswith("conv_last."):
        gain = 0.8
    return gain / math.sqrt(fan_in)


@torch.no_grad()
def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64) * _std(name, p.shape)
        is_norm = ".norm" in name or name.startswith("norm.")
        if is_norm and name.endswith(".weight"):
            r = r + 1.0
        # round to float32 so a float32 port loads exactly what the reference used
        p.copy_(r.float().double())
    return model


def params_sd(model):
    """Parameters only (no buffers), float32, official key names."""
    names = {n for n, _ in model.named_parameters()}
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if k in names}


def full_sd(model):
    """Everything state_dict() has, as the official checkpoints do: parameters in float32,
    relative_position_index int64, attn_mask float32."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().clone()
        out[k] = v.float().contiguous() if v.is_floating_point() else v.contiguous()
    return out


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------
def make_input(spec, seed):
    if spec["kind"] == "noise":
        g = torch.Generator().manual_seed(seed + 7)
        return torch.rand(spec["shape"], generator=g, dtype=torch.float64).float()
    import skimage.data

    img = getattr(skimage.data, spec["image"])()
    crops = []
    for (top, left, h, w) in spec["crops"]:
        c = img[top : top + h, left : left + w, :3].astype(np.float32) / np.float32(255.0)
        crops.append(torch.from_numpy(np.ascontiguousarray(c.transpose(2, 0, 1))))
    return torch.stack(crops).float()


# --------------------------------------------------------------------------------------
# pipeline (official test convention) and bug variants
# --------------------------------------------------------------------------------------
@torch.no_grad()
def run(model, x, window, scale, pad_mode="reflect"):
    _, _, h, w = x.shape
    ph = (window - h % window) % window
    pw = (window - w % window) % window
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph), mode=pad_mode)
    y = model(x)
    return y[:, :, : h * scale, : w * scale]


def _bug_tanh_gelu(m):
    for mod in m.modules():
        if isinstance(mod, Mlp):
            mod.act = nn.GELU(approximate="tanh")


def _bug_ln_eps(m):
    for mod in m.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.eps = 1e-6


def _bug_no_mask(m):
    for mod in m.modules():
        if isinstance(mod, SwinTransformerBlock) and mod.shift_size > 0:
            fwd = mod.attn.forward
            mod.attn.forward = lambda x, mask=None, _f=fwd: _f(x, None)


def _bug_bias_transposed(m):
    for mod in m.modules():
        if isinstance(mod, WindowAttention):
            mod.relative_position_index = mod.relative_position_index.t().contiguous()


# (label, model mutation, pad mode)
BUGS = [
    ("tanh GELU", _bug_tanh_gelu, "reflect"),
    ("LayerNorm eps 1e-6", _bug_ln_eps, "reflect"),
    ("no shift mask", _bug_no_mask, "reflect"),
    ("replicate pad", None, "replicate"),
    ("bias index transposed", _bug_bias_transposed, "reflect"),
]


@torch.no_grad()
def diagnostics(model, x, cfg, ref):
    """How much each path contributes, so no path is numerically invisible."""
    rms = lambda t: float(t.pow(2).mean().sqrt())
    out = {"out_std": float(ref.std()), "out_min": float(ref.min()), "out_max": float(ref.max())}
    groups = []
    for i, layer in enumerate(model.layers):
        m2 = copy.deepcopy(model)
        # zeroing adjust5 makes group i the identity (x5 = 0 -> out = x)
        m2.layers[i].adjust5.weight.zero_()
        m2.layers[i].adjust5.bias.zero_()
        groups.append(rms(run(m2, x, cfg["window"], cfg["scale"]) - ref) / rms(ref - ref.mean()))
    out["group_knockout_rel"] = groups
    m2 = copy.deepcopy(model)
    m2.conv_after_body.weight.zero_()
    m2.conv_after_body.bias.zero_()
    out["body_knockout_rel"] = rms(run(m2, x, cfg["window"], cfg["scale"]) - ref) / rms(ref - ref.mean())
    return out


def save_io(path, x, y):
    save_file({"input": x.float().contiguous(), "output": y.double().contiguous()}, str(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent),
                    help="output folder (default: this script's folder)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    models = {}
    manifest = []
    report = []
    for case in CASES:
        name = case["name"]
        if "reuse_weights" in case:
            base = next(c for c in CASES if c["name"] == case["reuse_weights"])
            cfg = {**base, **{k: v for k, v in case.items() if k not in ("seed",)}}
            cfg["seed"] = base["seed"]
            model = models[base["name"]]
        else:
            cfg = case
            model = randomise(build(cfg), cfg["seed"])
            models[name] = model
        x32 = make_input(cfg["input"], cfg["seed"])
        x = x32.double()
        ref = run(model, x, cfg["window"], cfg["scale"])
        assert torch.isfinite(ref).all()

        # --- weights files
        if cfg.get("pth") == "official":
            other = randomise(build(cfg), cfg["seed"] + 1000)
            weights_file = f"{name}.pth"
            torch.save({"params": full_sd(other), "params_ema": full_sd(model)}, out_dir / weights_file)
            weights_format = "pth: {'params': other weights, 'params_ema': reference weights}, buffers included"
        elif cfg.get("pth") == "module":
            weights_file = f"{name}.pth"
            sd = {"module." + k: v for k, v in full_sd(model).items()}
            torch.save({"state_dict": sd}, out_dir / weights_file)
            weights_format = "pth: {'state_dict': ...} with 'module.' key prefix, buffers included"
        else:
            weights_file = f"{name}.safetensors"
            save_file(params_sd(model), str(out_dir / weights_file))
            weights_format = "safetensors: parameters only (no buffers), float32"
        io_file = f"{name}.io.safetensors"
        save_io(out_dir / io_file, x32, ref)

        # --- self-checks
        m32 = copy.deepcopy(model).float()
        f32 = run(m32, x32, cfg["window"], cfg["scale"]).double()
        f32_dev = float((f32 - ref).abs().max())
        bugs = {}
        for label, mutate, pad in BUGS:
            mb = copy.deepcopy(model)
            if mutate:
                mutate(mb)
            bugs[label] = float((run(mb, x, cfg["window"], cfg["scale"], pad) - ref).abs().max())
        diag = diagnostics(model, x, cfg, ref)
        # what spandrel's own call API gives (pads to a multiple of 16, clamps): shows why the
        # reference bypasses it; compared with the clamped reference
        desc = ModelLoader().load_from_state_dict(full_sd(model)).to(torch.float64)
        with torch.no_grad():
            api_dev = float((desc(x.clone()) - ref.clamp(0, 1)).abs().max())
        diag["spandrel_call_api_vs_clamped_ref"] = api_dev

        b, _, h, w = x32.shape
        win = cfg["window"]
        entry = dict(
            name=name,
            weights=weights_file,
            weights_format=weights_format,
            io=io_file,
            scale=cfg["scale"],
            window=win,
            embed_dim=cfg["embed_dim"],
            gc=cfg["gc"],
            groups=len(cfg["heads"]),
            heads_per_group=list(cfg["heads"]),
            heads_per_block=[[b["heads"] for b in heads_and_dims(cfg["embed_dim"], cfg["gc"], hh)]
                             for hh in cfg["heads"]],
            blocks_per_group=[heads_and_dims(cfg["embed_dim"], cfg["gc"], hh) for hh in cfg["heads"]],
            img_size_buffers=cfg["img_size"] if cfg.get("pth") else None,
            batch=b,
            input_h=h,
            input_w=w,
            padded_h=h + (win - h % win) % win,
            padded_w=w + (win - w % win) % win,
            output_h=h * cfg["scale"],
            output_w=w * cfg["scale"],
            input_source=(f"skimage.data.{cfg['input']['image']} crops (top,left,h,w) {cfg['input']['crops']}"
                          if cfg["input"]["kind"] == "photo" else "uniform noise in [0,1)"),
            seed=cfg["seed"],
            covers=case["covers"],
            output_note="unclamped float64 reference (no clamp to [0,1]); input padded reflect-101 "
                        "bottom/right to a multiple of the window, output cropped to (H*s, W*s)",
            self_check=dict(float32_vs_float64_max_abs=f32_dev, bug_max_abs=bugs, **diag),
        )
        if "reuse_weights" in case:
            entry["same_weights_as"] = case["reuse_weights"]
        manifest.append(entry)
        report.append((name, f32_dev, bugs, diag))
        print(f"{name}: out std {diag['out_std']:.3f} range [{diag['out_min']:.3f}, {diag['out_max']:.3f}] "
              f"f32-vs-f64 {f32_dev:.2e}", flush=True)
        print("   bugs: " + ", ".join(f"{k} {v:.2e}" for k, v in bugs.items()))
        print("   group knockout (rms change / output std): "
              + ", ".join(f"{v:.2f}" for v in diag["group_knockout_rel"])
              + f"; body knockout {diag['body_knockout_rel']:.2f}"
              + f"; spandrel call API vs clamped ref {api_dev:.2e}", flush=True)

    with open(out_dir / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")

    # table for the README
    labels = [b[0] for b in BUGS]
    print()
    print("| case | f32 vs f64 | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for name, f32_dev, bugs, _ in report:
        print(f"| {name} | {f32_dev:.1e} | " + " | ".join(f"{bugs[l]:.1e}" for l in labels) + " |")

    # a bug must land well clear of the 2e-5 test tolerance (and of float32 noise, ~1e-6)
    weak = [(n, l, f"{bugs[l]:.1e}") for n, _, bugs, _ in report for l in labels if bugs[l] < 1e-4]
    if weak:
        print("\nnote: bug deviations below 1e-4 (5x the 2e-5 tolerance):", weak)

if __name__ == "__main__":
    main()
