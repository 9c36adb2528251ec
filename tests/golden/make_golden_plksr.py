#!/usr/bin/env python3
"""Write the float64 PLKSR and RealPLKSR reference fixtures used by the Rust tests
(tests/golden/plksr/).

Run from anywhere:  python tests/golden/make_golden_plksr.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's RealPLKSR module in float64 and eval mode (its large kernel then
overwrites the first channels in place), every parameter random and rounded to float32 so a
float32 port loads exactly what the reference used; the norms' weights spread around 1. The
last convolution is scaled so the output, less the nearest-neighbour upscale of the input
the network adds, spreads about 0.3. Each file is loaded back through spandrel's own loader,
which must give the same output. Two cases end in DySample instead of PixelShuffle: at x2
(4 groups) and x3 (3 groups), offsets large enough that some points leave the map. The
`plksr_orig_*` cases are the original PLKSR (spandrel's PLKSR class: no norms, a CCM, ICCM or
DCCM channel mixer with GELU, the plain partial large kernel), one of each mixer.
"""

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_esrgan import calibrate, deviation, save, sd32, write  # noqa: E402
from make_golden_swinir import make_input  # noqa: E402

import spandrel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from spandrel.architectures.PLKSR import PLKSR, RealPLKSR  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

GAIN = 1.2

CASES = [
    dict(
        name="plksr_x4_group", dim=8, blocks=2, scale=4, kernel=17, split=0.25, ea=True,
        layer_norm=False, input=dict(kind="pattern", shape=(1, 3, 13, 11)), seed=71,
        weights="pth-ema",
        covers="GroupNorm, attention, 17x17 on 2 of 8 channels, x4, {'params_ema': ...}; 13x11",
    ),
    dict(
        name="plksr_x2_layer", dim=12, blocks=3, scale=2, kernel=9, split=0.5, ea=False,
        layer_norm=True, input=dict(kind="noise", shape=(2, 3, 9, 10)), seed=72,
        weights="safetensors",
        covers="LayerNorm, no attention, 9x9 on 6 of 12 channels, x2, batch 2; 9x10",
    ),
    dict(
        name="plksr_x3_group", dim=8, blocks=2, scale=3, kernel=7, split=0.25, ea=True,
        layer_norm=False, input=dict(kind="pattern", shape=(1, 3, 10, 7)), seed=73,
        weights="pth-params",
        covers="GroupNorm, attention, 7x7, x3, {'params': ...}; 10x7",
    ),
    dict(
        name="plksr_x1_layer", dim=8, blocks=1, scale=1, kernel=5, split=1.0, ea=True,
        layer_norm=True, input=dict(kind="pattern", shape=(1, 3, 11, 14)), seed=74,
        weights="pth-plain",
        covers="LayerNorm, attention, 5x5 on every channel, x1, plain .pth; 11x14",
    ),
]

CASES += [
    dict(
        name="plksr_x2_dysample", dim=8, blocks=1, scale=2, kernel=7, split=0.25, ea=True,
        layer_norm=False, dysample=True, input=dict(kind="pattern", shape=(1, 3, 9, 12)),
        seed=75, weights="safetensors",
        covers="DySample at x2 (4 groups), GroupNorm; 9x12",
    ),
    dict(
        name="plksr_x3_dysample", dim=8, blocks=1, scale=3, kernel=5, split=0.5, ea=False,
        layer_norm=True, dysample=True, input=dict(kind="noise", shape=(2, 3, 7, 6)),
        seed=76, weights="pth-ema",
        covers="DySample at x3 (3 groups), LayerNorm, batch 2; 7x6",
    ),
]

CASES += [
    dict(
        name="plksr_orig_x4_dccm", mixer="DCCM", dim=8, blocks=2, scale=4, kernel=17,
        split=0.25, ea=True, layer_norm=False, input=dict(kind="pattern", shape=(1, 3, 13, 11)),
        seed=81, weights="safetensors",
        covers="original PLKSR, DCCM (3x3, GELU, 3x3), attention, 17x17 on 2 of 8 channels, x4",
    ),
    dict(
        name="plksr_orig_x2_ccm", mixer="CCM", dim=12, blocks=2, scale=2, kernel=9, split=0.5,
        ea=False, layer_norm=False, input=dict(kind="noise", shape=(2, 3, 9, 10)), seed=82,
        weights="pth-params",
        covers="original PLKSR, CCM (3x3, GELU, 1x1), no attention, x2, batch 2, {'params': ...}",
    ),
    dict(
        name="plksr_orig_x3_iccm", mixer="ICCM", dim=8, blocks=1, scale=3, kernel=7, split=1.0,
        ea=True, layer_norm=False, input=dict(kind="pattern", shape=(1, 3, 10, 7)), seed=83,
        weights="pth-ema",
        covers="original PLKSR, ICCM (1x1, GELU, 3x3), 7x7 on every channel, x3, {'params_ema': ...}",
    ),
    dict(
        name="plksr_orig_x1_dccm", mixer="DCCM", dim=8, blocks=1, scale=1, kernel=5, split=0.25,
        ea=False, layer_norm=False, input=dict(kind="pattern", shape=(1, 3, 11, 14)), seed=84,
        weights="pth-plain",
        covers="original PLKSR, DCCM, x1, plain .pth; 11x14",
    ),
]


def mixer_of(mod):
    """A block's channel mixer under either form's name."""
    return getattr(mod, "channel_mixer", None) or getattr(mod, "channe_mixer", None)


def build(cfg):
    if cfg.get("mixer"):
        m = PLKSR(dim=cfg["dim"], n_blocks=cfg["blocks"], upscaling_factor=cfg["scale"],
                  ccm_type=cfg["mixer"], kernel_size=cfg["kernel"], split_ratio=cfg["split"],
                  lk_type="PLK", use_ea=cfg["ea"])
        return m.double().eval()
    m = RealPLKSR(dim=cfg["dim"], n_blocks=cfg["blocks"], upscaling_factor=cfg["scale"],
                  kernel_size=cfg["kernel"], split_ratio=cfg["split"], use_ea=cfg["ea"],
                  layer_norm=cfg["layer_norm"], dysample=cfg.get("dysample", False))
    return m.double().eval()


@torch.no_grad()
def randomise(model, seed):
    """Weights at GAIN / sqrt(fan-in), biases at 0.1, norm weights around 1."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if name.endswith(".bias"):
            r = 0.1 * r
        elif p.dim() == 1:
            r = 1.0 + 0.2 * r
        else:
            r = r * (GAIN / math.sqrt(p[0].numel()))
        p.copy_(r.float().double())
    return model


def last_conv(model):
    return model.feats[-1]


@torch.no_grad()
def plksr_case(cfg, out_dir):
    x32 = make_input(cfg["input"], cfg["seed"])
    x = x32.double()
    s = cfg["scale"]
    model = randomise(build(cfg), cfg["seed"])

    def base(x):
        return F.interpolate(x, scale_factor=s, mode="nearest")

    calibrate(model, last_conv(model), x, 0.3, base)
    ref = model(x)
    assert torch.isfinite(ref).all()
    sd = sd32(model)
    desc = spandrel.ModelLoader().load_from_state_dict(copy.deepcopy(sd))
    assert desc.architecture.id == "PLKSR" and desc.scale == s
    again = desc.model.double().eval()(x)
    assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = save(model, cfg, out_dir, sd)
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))
    f32 = copy.deepcopy(model).float()(x32).double()
    checks = {"float32": float((f32 - ref).abs().max())}

    def silu(m2, x):
        for mod in m2.modules():
            if hasattr(mod, "channel_mixer"):
                mod.channel_mixer[1] = torch.nn.SiLU()
        return m2(x)

    def tanh_gelu(m2, x):
        for mod in m2.modules():
            if isinstance(mod, torch.nn.GELU):
                mod.approximate = "tanh"
        return m2(x)

    def mish(m2, x):
        for mod in m2.modules():
            if hasattr(mod, "channe_mixer"):
                mod.channe_mixer[1] = torch.nn.Mish()
        return m2(x)

    def two_groups(m2, x):
        for mod in m2.modules():
            if isinstance(mod, torch.nn.GroupNorm):
                mod.num_groups = 2
        return m2(x)

    def no_input_added(m2, x):
        return m2.to_img(m2.feats(x))

    def zero_padding(m2, x):
        # grid_sample's zeros outside the map instead of the border's pixels.
        m2.to_img.forward = lambda y, _f=m2.to_img.forward: _border_as_zeros(m2.to_img, y)
        return m2(x)

    def whole_kernel_map(m2, x):
        # The large kernel on every channel instead of the first ones (the same weights
        # zero-padded): what a port that ignored the split would compute.
        for mod in m2.modules():
            if hasattr(mod, "lk"):
                conv = mod.lk.conv
                c = mixer_of(mod)[2].out_channels
                full = torch.nn.Conv2d(c, c, conv.kernel_size, 1, conv.padding).double()
                full.weight.zero_()
                full.bias.zero_()
                idx = mod.lk.idx
                full.weight[:idx, :idx] = conv.weight
                full.bias[:idx] = conv.bias
                mod.lk.forward = full.forward
        return m2(x)

    if cfg.get("mixer"):
        checks["tanh GELU"] = deviation(model, x, ref, tanh_gelu)
        checks["GELU -> Mish"] = deviation(model, x, ref, mish)
    else:
        checks["Mish -> SiLU"] = deviation(model, x, ref, silu)
    checks["input not added"] = deviation(model, x, ref, no_input_added)
    if not cfg["layer_norm"] and not cfg.get("mixer"):
        checks["GroupNorm of 2 groups"] = deviation(model, x, ref, two_groups)
    if cfg["split"] < 1:
        checks["large kernel over every channel"] = deviation(model, x, ref, whole_kernel_map)
    if cfg.get("dysample"):
        checks["zeros past the border"] = deviation(model, x, ref, zero_padding)
    b, _, h, w = x32.shape
    return dict(
        name=cfg["name"], weights=weights, io=io, weights_format=cfg["weights"],
        scale=s, features=cfg["dim"], blocks=cfg["blocks"], kernel=cfg["kernel"],
        partial=int(cfg["dim"] * cfg["split"]), attention=cfg["ea"],
        layer_norm=cfg["layer_norm"], dysample=cfg.get("dysample", False),
        mixer=cfg.get("mixer", "real"), batch=b, input_h=h, input_w=w, seed=cfg["seed"],
        covers=cfg["covers"],
        self_check=dict(max_abs=checks, out_std=float(ref.std()), out_min=float(ref.min()),
                        out_max=float(ref.max())),
    )


def _border_as_zeros(d, x):
    """DySample's forward with grid_sample's zero padding (a deliberate mistake)."""
    real = F.grid_sample

    def zeros(*a, **kw):
        kw["padding_mode"] = "zeros"
        return real(*a, **kw)

    F.grid_sample = zeros
    try:
        return type(d).forward(d, x)
    finally:
        F.grid_sample = real


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent),
                    help="the folder that gets plksr/")
    args = ap.parse_args()
    out_dir = Path(args.out) / "plksr"
    write(CASES, plksr_case, out_dir)


if __name__ == "__main__":
    main()
