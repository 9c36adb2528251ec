#!/usr/bin/env python3
"""Write the float64 OmniSR reference fixtures used by the Rust tests (tests/golden/omnisr/).

Run from anywhere:  python tests/golden/make_golden_omnisr.py [--out DIR]
Needs: torch, spandrel==0.4.2, einops, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's OmniSR module in float64 and eval mode, every parameter random
and rounded to float32 so a float32 port loads exactly what the reference used; the norms'
weights spread around 1, the channel attentions' temperatures around 1. The upsampling
convolution is scaled so the output spreads about 0.3. Each file is loaded back through
spandrel's own loader, which must give the same output. The inputs are sizes the model pads
(zeros, to a multiple of its window) and crops back.

With --bench DIR: random weights of the released shape (64 features, 5 groups of 1 block,
window 8, position bias, x4) as DIR/omnisr_x4_random.safetensors, for the speed benches.
"""

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_esrgan import deviation, save, sd32, write  # noqa: E402
from make_golden_swinir import make_input  # noqa: E402

import spandrel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from spandrel.architectures.OmniSR import OmniSR  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

GAIN = 1.0

CASES = [
    dict(
        name="omnisr_x4", feat=16, groups=2, blocks=1, window=8, pe=True, bias=True,
        scale=4, input=dict(kind="pattern", shape=(1, 3, 19, 21)), seed=81, weights="pth-ema",
        covers="x4, 2 groups of 1 block, window 8, position bias, {'params_ema': ...}; "
               "19x21 padded to 24x24",
    ),
    dict(
        name="omnisr_x2_no_bias", feat=20, groups=1, blocks=2, window=8, pe=False,
        bias=False, scale=2, input=dict(kind="noise", shape=(2, 3, 16, 17)), seed=82,
        weights="safetensors",
        covers="x2, 1 group of 2 blocks, 20 features (heads of 5), no position bias, no "
               "biases, batch 2; 16x17 padded to 16x24",
    ),
    dict(
        name="omnisr_x3_w4", feat=16, groups=1, blocks=1, window=4, pe=True, bias=True,
        scale=3, input=dict(kind="pattern", shape=(1, 3, 18, 15)), seed=83,
        weights="pth-params",
        covers="x3, window 4, {'params': ...}; 18x15 padded to 20x16",
    ),
    dict(
        name="omnisr_x1", feat=16, groups=1, blocks=1, window=8, pe=True, bias=True,
        scale=1, input=dict(kind="pattern", shape=(1, 3, 16, 24)), seed=84,
        weights="pth-plain",
        covers="x1, plain .pth; 16x24, no padding",
    ),
]


def build(cfg):
    m = OmniSR(num_in_ch=3, num_out_ch=3, num_feat=cfg["feat"], block_num=cfg["blocks"],
               pe=cfg["pe"], window_size=cfg["window"], res_num=cfg["groups"],
               up_scale=cfg["scale"], bias=cfg["bias"])
    return m.double().eval()


@torch.no_grad()
def randomise(model, seed):
    """Weights at GAIN / sqrt(fan-in), biases at 0.1, norm weights and temperatures around 1,
    position biases at 0.5."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if name.endswith("rel_pos_bias.weight"):
            r = 0.5 * r
        elif name.endswith(".bias"):
            r = 0.1 * r
        elif p.dim() == 1 or name.endswith("temperature"):
            r = 1.0 + 0.2 * r
        else:
            r = r * (GAIN / math.sqrt(p[0].numel()))
        p.copy_(r.float().double())
    return model


@torch.no_grad()
def calibrate(model, last, x, target):
    """Scale the last convolution (its bias too, where it has one) so the output spreads
    about `target`."""
    std = float(model(x).std())
    for p in (last.weight, last.bias):
        if p is not None:
            p.copy_((p * (target / std)).float().double())


@torch.no_grad()
def omnisr_case(cfg, out_dir):
    x32 = make_input(cfg["input"], cfg["seed"])
    x = x32.double()
    s = cfg["scale"]
    model = randomise(build(cfg), cfg["seed"])
    calibrate(model, model.up[0], x, 0.3)
    ref = model(x)
    assert torch.isfinite(ref).all()
    sd = sd32(model)
    desc = spandrel.ModelLoader().load_from_state_dict(copy.deepcopy(sd))
    assert desc.architecture.id == "OmniSR" and desc.scale == s
    again = desc.model.double().eval()(x)
    assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = save(model, cfg, out_dir, sd)
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))
    f32 = copy.deepcopy(model).float()(x32).double()
    checks = {"float32": float((f32 - ref).abs().max())}

    def reflect_padding(m2, x):
        from spandrel.architectures.__arch_helpers.padding import pad_to_multiple
        m2.check_image_size = lambda t: pad_to_multiple(t, m2.window_size, mode="reflect")
        return m2(x)

    def no_esa(m2, x):
        for g in m2.residual_layer:
            g.esa.forward = lambda t: t
        return m2(x)

    def corners_aligned(m2, x):
        real = F.interpolate

        def aligned(*a, **kw):
            kw["align_corners"] = True
            return real(*a, **kw)

        F.interpolate = aligned
        try:
            return m2(x)
        finally:
            F.interpolate = real

    def grid_as_blocks(m2, x):
        # The grid attention (layer 8) run over block windows: what a port that missed the
        # stride would compute.
        from einops.layers.torch import Rearrange
        w = m2.window_size
        for g in m2.residual_layer:
            for blk in list(g.residual_layer)[:-1]:
                blk.layer[7] = Rearrange("b d (x w1) (y w2) -> b x y w1 w2 d", w1=w, w2=w)
                blk.layer[9] = Rearrange("b x y w1 w2 d -> b d (x w1) (y w2)")
        return m2(x)

    checks["reflect padding"] = deviation(model, x, ref, reflect_padding)
    checks["no ESA"] = deviation(model, x, ref, no_esa)
    checks["bilinear with corners aligned"] = deviation(model, x, ref, corners_aligned)
    checks["grid attention over blocks"] = deviation(model, x, ref, grid_as_blocks)
    b, _, h, w = x32.shape
    return dict(
        name=cfg["name"], weights=weights, io=io, weights_format=cfg["weights"],
        scale=s, features=cfg["feat"], groups=cfg["groups"], blocks=cfg["blocks"],
        window=cfg["window"], position_bias=cfg["pe"], bias=cfg["bias"], batch=b,
        input_h=h, input_w=w, seed=cfg["seed"], covers=cfg["covers"],
        self_check=dict(max_abs=checks, out_std=float(ref.std()), out_min=float(ref.min()),
                        out_max=float(ref.max())),
    )


def bench_model(out_dir):
    """Random weights of the released shape (64 features, 5 groups, window 8, x4)."""
    cfg = dict(feat=64, groups=5, blocks=1, window=8, pe=True, bias=True, scale=4)
    model = randomise(build(cfg), 0)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(sd32(model), str(out_dir / "omnisr_x4_random.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent),
                    help="the folder that gets omnisr/")
    ap.add_argument("--bench", help="write only the bench model into this folder")
    args = ap.parse_args()
    if args.bench:
        bench_model(Path(args.bench))
        return
    write(CASES, omnisr_case, Path(args.out) / "omnisr")


if __name__ == "__main__":
    main()
