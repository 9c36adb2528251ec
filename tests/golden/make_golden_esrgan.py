#!/usr/bin/env python3
"""Write the float64 ESRGAN (RRDBNet) and Real-ESRGAN Compact (SRVGGNetCompact) reference
fixtures used by the Rust tests (tests/golden/esrgan/ and tests/golden/compact/).

Run from anywhere:  python tests/golden/make_golden_esrgan.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's RRDBNet and SRVGGNetCompact modules in float64 and eval mode,
every parameter random (rounded to float32 so a float32 port loads exactly what the
reference used), the output cropped, not clamped. spandrel's RRDBNet builds its dense
blocks with 32 growth channels whatever the file says; the fixtures use fewer (the
released models' structure at a fraction of the size), so its RRDB block is built here
with the case's growth channels. spandrel's RRDBNet holds ESRGAN's old-arch key names;
the Real-ESRGAN and RRDB_trunk fixtures are the same weights under those names, and each
renamed file is loaded back through spandrel's own loader, which must give the same
output (the renaming and the scale and unshuffle it reads are the reference's).

spandrel's Compact loader refuses files without PReLU weights (ReLU, LeakyReLU); those
fixtures are its SRVGGNetCompact class built with act_type "relu" and "leakyrelu".
"""

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_swinir import make_input  # noqa: E402

import spandrel  # noqa: E402
from spandrel.architectures.__arch_helpers import block as B  # noqa: E402
from spandrel.architectures.Compact import Compact  # noqa: E402
from spandrel.architectures.ESRGAN import ESRGAN  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

# The RRDBNet weights are drawn at 0.8 / sqrt(fan-in). At 1.4 (as the Compact ones) the
# untrained two-block network amplifies the rounding of bf16 products to 39 dB against its
# float64 output; a float64 emulation of bf16 products (operands rounded to bf16, sums
# exact) lands on the same figure, so that is the random network, not a port, and the
# released models are not that sensitive.
ESRGAN_GAIN = 0.8

ESRGAN_CASES = [
    dict(
        name="esrgan_x4_old", layout="old", nf=8, gc=4, nb=2, scale=4, shuffle=None,
        input=dict(kind="pattern", shape=(1, 3, 13, 11)), seed=41, weights="pth-plain",
        covers="old-arch keys (model.N), plain .pth state dict; x4; two RRDBs; 13x11",
    ),
    dict(
        name="esrgan_x4_real", layout="real", nf=8, gc=6, nb=1, scale=4, shuffle=None,
        input=dict(kind="noise", shape=(2, 3, 9, 12)), seed=42, weights="pth-ema",
        covers="Real-ESRGAN keys (conv_first, body.N.rdbK, conv_up1/2) in "
               "{'params_ema': ...} as RealESRGAN_x4plus.pth; batch 2; 9x12",
    ),
    dict(
        name="esrgan_x2_unshuffle", layout="real", nf=8, gc=4, nb=1, scale=4, shuffle=2,
        input=dict(kind="pattern", shape=(1, 3, 15, 9)), seed=43, weights="safetensors",
        covers="x2 with its input pixel-unshuffled by 2 (12 input channels), odd sizes "
               "reflect-padded to 16x10 and cropped; 15x9 -> 30x18",
    ),
    dict(
        name="esrgan_x1_unshuffle", layout="real", nf=8, gc=4, nb=1, scale=4, shuffle=4,
        input=dict(kind="pattern", shape=(1, 3, 13, 18)), seed=44, weights="safetensors",
        covers="x1 with its input pixel-unshuffled by 4 (48 input channels), 13x18 "
               "reflect-padded to 16x20 and cropped",
    ),
    dict(
        name="esrgan_x8_trunk", layout="trunk", nf=6, gc=4, nb=1, scale=8, shuffle=None,
        input=dict(kind="pattern", shape=(1, 3, 7, 5)), seed=45, weights="safetensors",
        covers="RRDB_trunk keys (BSRGAN / RealSR: trunk_conv, upconv1-3, HRconv); x8; 7x5",
    ),
]

COMPACT_CASES = [
    dict(
        name="compact_x4_prelu", nf=8, nc=3, act="prelu", scale=4,
        input=dict(kind="pattern", shape=(1, 3, 13, 11)), seed=51, weights="pth-params",
        covers="PReLU, x4, 3 body convolutions, {'params': ...} as realesr-general-x4v3.pth",
    ),
    dict(
        name="compact_x2_relu", nf=6, nc=2, act="relu", scale=2,
        input=dict(kind="noise", shape=(2, 3, 9, 10)), seed=52, weights="safetensors",
        covers="ReLU (no activation weights: what such a file is read as), x2, batch 2",
    ),
    dict(
        name="compact_x1_leakyrelu", nf=6, nc=1, act="leakyrelu", scale=1,
        input=dict(kind="pattern", shape=(1, 3, 11, 14)), seed=53, weights="safetensors",
        covers="LeakyReLU 0.1, x1; the file cannot say so: the test sets the activation",
    ),
    dict(
        name="compact_x3_prelu", nf=4, nc=0, act="prelu", scale=3,
        input=dict(kind="pattern", shape=(1, 3, 10, 7)), seed=54, weights="safetensors",
        covers="PReLU, x3, no body convolution between the first and the last",
    ),
]


def build_esrgan(cfg):
    """spandrel's RRDBNet with the case's growth channels (its own RRDB block, built with
    `gc` in place of the 32 RRDBNet passes)."""
    rrdb = B.RRDB

    def with_growth(**kw):
        return rrdb(**{**kw, "gc": cfg["gc"]})

    B.RRDB = with_growth
    try:
        m = ESRGAN(in_nc=3 * (cfg["shuffle"] or 1) ** 2, out_nc=3, num_filters=cfg["nf"],
                   num_blocks=cfg["nb"], scale=cfg["scale"], shuffle_factor=cfg["shuffle"])
    finally:
        B.RRDB = rrdb
    return m.double().eval()


def build_compact(cfg):
    m = Compact(num_in_ch=3, num_out_ch=3, num_feat=cfg["nf"], num_conv=cfg["nc"],
                upscale=cfg["scale"], act_type=cfg["act"])
    return m.double().eval()


@torch.no_grad()
def randomise(model, seed, gain):
    """Weights at `gain` / sqrt(fan-in), biases at 0.1, PReLU slopes around 0.25."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and not name.endswith(".bias"):
            # PReLU slopes: spread around the 0.25 PyTorch starts from, some negative
            r = 0.25 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)
        elif name.endswith(".bias"):
            r = 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)
        else:
            fan_in = p[0].numel()
            r = torch.randn(p.shape, generator=g, dtype=torch.float64) * (gain / math.sqrt(fan_in))
        p.copy_(r.float().double())
    return model


@torch.no_grad()
def calibrate(model, last, x, target, base=None):
    """Scale the last convolution so the output (less `base`) spreads about `target`."""
    y = model(x)
    std = float((y - base(x)).std() if base else y.std())
    for p in (last.weight, last.bias):
        p.copy_((p * (target / std)).float().double())
    return model


def sd32(model):
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}


def rename(sd, layout, nb):
    """Old-arch keys under the Real-ESRGAN or RRDB_trunk names."""
    if layout == "old":
        return dict(sd)
    real = layout == "real"
    out = {}
    ups = sorted({int(k.split(".")[1]) for k in sd if k.startswith("model.")} - {0, 1})
    # model.0, [model.1], the upsampling convs at 3, 6, ..., then HR conv, then last
    *upconvs, hr, last = ups
    for k, v in sd.items():
        parts = k.split(".")
        kind = parts[-1]
        i = int(parts[1])
        if i == 0:
            new = f"conv_first.{kind}"
        elif i == 1 and parts[3] == str(nb):
            new = f"{'conv_body' if real else 'trunk_conv'}.{kind}"
        elif i == 1:
            # model.1.sub.N.RDBk.convj.0.kind
            n, rdb, conv = parts[3], parts[4][3:], parts[5]
            new = (f"body.{n}.rdb{rdb}.{conv}.{kind}" if real
                   else f"RRDB_trunk.{n}.RDB{rdb}.{conv}.{kind}")
        elif i in upconvs:
            new = f"{'conv_up' if real else 'upconv'}{upconvs.index(i) + 1}.{kind}"
        elif i == hr:
            new = f"{'conv_hr' if real else 'HRconv'}.{kind}"
        elif i == last:
            new = f"conv_last.{kind}"
        else:
            raise ValueError(k)
        out[new] = v
    return out


@torch.no_grad()
def save(model, cfg, out_dir, renamed):
    name = cfg["name"]
    kind = cfg["weights"]
    if kind == "safetensors":
        weights = f"{name}.safetensors"
        save_file(renamed, str(out_dir / weights))
    else:
        weights = f"{name}.pth"
        wrap = {"pth-plain": None, "pth-ema": "params_ema", "pth-params": "params"}[kind]
        torch.save(renamed if wrap is None else {wrap: renamed}, out_dir / weights)
    return weights


def deviation(model, x, ref, mutate):
    m2 = copy.deepcopy(model)
    with torch.no_grad():
        y = mutate(m2, x)
    return float((y - ref).abs().max())


@torch.no_grad()
def esrgan_case(cfg, out_dir):
    x32 = make_input(cfg["input"], cfg["seed"])
    x = x32.double()
    model = randomise(build_esrgan(cfg), cfg["seed"], ESRGAN_GAIN)
    calibrate(model, model.model[-1], x, 0.5)
    ref = model(x)
    assert torch.isfinite(ref).all()
    renamed = rename(sd32(model), cfg["layout"], cfg["nb"])
    # spandrel's own loader reads the renamed file as the same network
    rrdb = B.RRDB
    B.RRDB = lambda **kw: rrdb(**{**kw, "gc": cfg["gc"]})
    try:
        desc = spandrel.ModelLoader().load_from_state_dict(renamed)
    finally:
        B.RRDB = rrdb
    again = desc.model.double().eval()(x)
    assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = save(model, cfg, out_dir, renamed)
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))

    f32 = copy.deepcopy(model).float()(x32).double()
    checks = {"float32": float((f32 - ref).abs().max())}

    def slope(m2, x):
        for mod in m2.modules():
            if isinstance(mod, torch.nn.LeakyReLU):
                mod.negative_slope = 0.1
        return m2(x)

    def replicate_pad(m2, x):
        if not m2.shuffle_factor:
            return m2(x)
        _, _, h, w = x.shape
        f = m2.shuffle_factor
        x = F.pad(x, (0, (f - w % f) % f, 0, (f - h % f) % f), mode="replicate")
        y = m2.model(torch.pixel_unshuffle(x, f))
        return y[:, :, : h * m2.scale // f, : w * m2.scale // f]

    def bilinear(m2, x):
        for mod in m2.modules():
            if isinstance(mod, torch.nn.Upsample):
                mod.mode = "bilinear"
        return m2(x)

    checks["LeakyReLU slope 0.1"] = deviation(model, x, ref, slope)
    checks["bilinear upsampling"] = deviation(model, x, ref, bilinear)
    if cfg["shuffle"]:
        checks["replicate padding"] = deviation(model, x, ref, replicate_pad)
    b, _, h, w = x32.shape
    scale = cfg["scale"] // (cfg["shuffle"] or 1)
    return dict(
        name=cfg["name"], weights=weights, io=cfg["name"] + ".io.safetensors",
        weights_format=cfg["weights"], scale=scale, layout=cfg["layout"],
        filters=cfg["nf"], growth=cfg["gc"], blocks=cfg["nb"],
        unshuffle=cfg["shuffle"] or 1, batch=b, input_h=h, input_w=w, seed=cfg["seed"],
        covers=cfg["covers"],
        self_check=dict(max_abs=checks, out_std=float(ref.std()), out_min=float(ref.min()),
                        out_max=float(ref.max())),
    )


@torch.no_grad()
def compact_case(cfg, out_dir):
    x32 = make_input(cfg["input"], cfg["seed"])
    x = x32.double()
    model = randomise(build_compact(cfg), cfg["seed"], 1.4)
    s = cfg["scale"]

    def base(x):
        return F.interpolate(x, scale_factor=s, mode="nearest")

    calibrate(model, model.body[-1], x, 0.3, base)
    ref = model(x)
    assert torch.isfinite(ref).all()
    sd = sd32(model)
    if cfg["act"] == "prelu":
        desc = spandrel.ModelLoader().load_from_state_dict(sd)
        again = desc.model.double().eval()(x)
        assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = save(model, cfg, out_dir, sd)
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))

    f32 = copy.deepcopy(model).float()(x32).double()
    checks = {"float32": float((f32 - ref).abs().max())}

    def relu(m2, x):
        for i, mod in enumerate(m2.body):
            if isinstance(mod, (torch.nn.PReLU, torch.nn.LeakyReLU)):
                m2.body[i] = torch.nn.ReLU()
        return m2(x)

    def leaky(m2, x):
        for i, mod in enumerate(m2.body):
            if isinstance(mod, (torch.nn.PReLU, torch.nn.ReLU)):
                m2.body[i] = torch.nn.LeakyReLU(0.1)
        return m2(x)

    def no_base(m2, x):
        return m2(x) - base(x)

    if cfg["act"] != "relu":
        checks["read as ReLU"] = deviation(model, x, ref, relu)
    if cfg["act"] != "leakyrelu":
        checks["read as LeakyReLU"] = deviation(model, x, ref, leaky)
    checks["no nearest base"] = deviation(model, x, ref, no_base)
    b, _, h, w = x32.shape
    return dict(
        name=cfg["name"], weights=weights, io=io, weights_format=cfg["weights"],
        scale=s, features=cfg["nf"], convs=cfg["nc"], activation=cfg["act"], batch=b,
        input_h=h, input_w=w, seed=cfg["seed"], covers=cfg["covers"],
        self_check=dict(max_abs=checks, out_std=float(ref.std()), out_min=float(ref.min()),
                        out_max=float(ref.max())),
    )


def write(cases, make, out_dir):
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = []
    for cfg in cases:
        entry = make(cfg, out_dir)
        manifest.append(entry)
        checks = entry["self_check"]["max_abs"]
        print(f"{entry['name']}: out std {entry['self_check']['out_std']:.3f}; "
              + ", ".join(f"{k} {v:.2e}" for k, v in checks.items()), flush=True)
    with open(out_dir / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent),
                    help="the folder that gets esrgan/ and compact/")
    args = ap.parse_args()
    out = Path(args.out)
    write(ESRGAN_CASES, esrgan_case, out / "esrgan")
    write(COMPACT_CASES, compact_case, out / "compact")


if __name__ == "__main__":
    main()
