#!/usr/bin/env python3
"""Write the float64 SPAN reference fixtures used by the Rust tests (tests/golden/span/).

Run from anywhere:  python tests/golden/make_golden_span.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's SPAN module in float64 and eval mode, every parameter random
(rounded to float32 so a float32 port loads exactly what the reference used). In eval mode
each three-branch convolution (Conv3XC) folds its 1x1 -> 3x3 -> 1x1 branch and its 1x1 skip
into `eval_conv` on every forward; the `eval_conv` tensors saved in the files are left random,
so a port that used them instead of folding would fail. A model with input normalisation
(no `no_norm` buffer) multiplies its input, less the RGB mean, by 255: those fixtures scale
the first convolution's input weights by 1/255, as a trained model's are, so the features
stay near 1. The upsampling convolution is scaled so the output spreads about 0.5. Each
file is loaded back through spandrel's own loader, which must give the same output.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_esrgan import calibrate, deviation, randomise, save, sd32, write  # noqa: E402
from make_golden_swinir import make_input  # noqa: E402

import spandrel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from spandrel.architectures.SPAN import SPAN  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

# The weights are drawn at GAIN / sqrt(fan-in). Three random convolutions in a row per
# branch, six blocks deep, amplify rounding: at 1.4 float32 PyTorch lands 3e-4 from its
# float64 output on the x4 case, which measures the random network, not a port.
GAIN = 1.0

CASES = [
    dict(
        name="span_x4_norm", nf=4, scale=4, norm=True,
        input=dict(kind="pattern", shape=(1, 3, 13, 11)), seed=61, weights="pth-ema",
        covers="input normalisation (mean, x255), x4, {'params_ema': ...}; 13x11",
    ),
    dict(
        name="span_x2_no_norm", nf=5, scale=2, norm=False,
        input=dict(kind="noise", shape=(2, 3, 9, 10)), seed=62, weights="safetensors",
        covers="no normalisation (the no_norm buffer), x2, batch 2; 9x10",
    ),
    dict(
        name="span_x3_no_norm", nf=4, scale=3, norm=False,
        input=dict(kind="pattern", shape=(1, 3, 10, 7)), seed=63, weights="pth-params",
        covers="no normalisation, x3, {'params': ...}; 10x7",
    ),
    dict(
        name="span_x1_norm", nf=4, scale=1, norm=True,
        input=dict(kind="pattern", shape=(1, 3, 11, 14)), seed=64, weights="pth-plain",
        covers="input normalisation, x1, plain .pth state dict; 11x14",
    ),
]

CONV3XC = ["conv_1", "conv_2"] + [f"block_{b}.c{k}_r" for b in range(1, 7) for k in (1, 2, 3)]


def build(cfg):
    m = SPAN(num_in_ch=3, num_out_ch=3, feature_channels=cfg["nf"], upscale=cfg["scale"],
             norm=cfg["norm"])
    return m.double().eval()


@torch.no_grad()
def span_case(cfg, out_dir):
    x32 = make_input(cfg["input"], cfg["seed"])
    x = x32.double()
    model = randomise(build(cfg), cfg["seed"], GAIN)
    if cfg["norm"]:
        first = model.conv_1
        for p in (first.sk.weight, first.conv[0].weight):
            p.copy_((p / 255).float().double())
    calibrate(model, model.upsampler[0], x, 0.5)
    ref = model(x)
    assert torch.isfinite(ref).all()
    # What a port that folds in float64 and runs in float32 computes: the folded weights
    # (the forward above wrote them into eval_conv) rounded to float32, not folded again.
    folded = copy.deepcopy(model).float()
    for name in CONV3XC:
        folded.get_submodule(name).update_params = lambda: None
    port = float((folded(x32).double() - ref).abs().max())
    # Random eval_conv weights, as stale as a file's may be: the reference folds again on
    # every forward, so they must not matter.
    g = torch.Generator().manual_seed(cfg["seed"] + 100)
    for name in CONV3XC:
        conv = model.get_submodule(name).eval_conv
        for p in (conv.weight, conv.bias):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).float().double())
    sd = sd32(model)
    assert float((copy.deepcopy(model)(x) - ref).abs().max()) == 0.0
    desc = spandrel.ModelLoader().load_from_state_dict(copy.deepcopy(sd))
    assert desc.architecture.id == "SPAN" and desc.scale == cfg["scale"]
    again = desc.model.double().eval()(x)
    assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    # Reload: eval_conv random again (the check above folded it in place).
    model = build(cfg)
    model.load_state_dict({k: v.double() for k, v in sd.items()})
    weights = save(model, cfg, out_dir, sd)
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))

    f32 = copy.deepcopy(model).float()(x32).double()
    checks = {"float32": float((f32 - ref).abs().max()), "float32, folded in float64": port}

    def stored_eval_conv(m2, x):
        for name in CONV3XC:
            m2.get_submodule(name).update_params = lambda: None
        return m2(x)

    def norm_flipped(m2, x):
        m2.no_norm = None if cfg["norm"] is False else torch.zeros(1)
        return m2(x)

    def no_skip(m2, x):
        for name in CONV3XC:
            m2.get_submodule(name).sk.weight.zero_()
        return m2(x)

    def plain_sigmoid(m2, x):
        for b in range(1, 7):
            block = m2.get_submodule(f"block_{b}")

            def forward(x, block=block):
                o1 = block.c1_r(x)
                o2 = block.c2_r(block.act1(o1))
                o3 = block.c3_r(block.act1(o2))
                att = torch.sigmoid(o3)
                return (o3 + x) * att, o1, att

            block.forward = forward
        return m2(x)

    def out1_not_in_place(m2, x):
        # The reference's SiLU works in place: block 6 hands silu(o1) to the concatenation.
        m2.block_6.act1 = torch.nn.SiLU(inplace=False)
        return m2(x)

    checks["stored eval_conv"] = deviation(model, x, ref, stored_eval_conv)
    checks["o1 without its in-place SiLU"] = deviation(model, x, ref, out1_not_in_place)
    checks["normalisation flipped"] = deviation(model, x, ref, norm_flipped)
    checks["no 1x1 skip"] = deviation(model, x, ref, no_skip)
    checks["sigmoid without -0.5"] = deviation(model, x, ref, plain_sigmoid)
    b, _, h, w = x32.shape
    return dict(
        name=cfg["name"], weights=weights, io=io, weights_format=cfg["weights"],
        scale=cfg["scale"], features=cfg["nf"], norm=cfg["norm"], batch=b, input_h=h,
        input_w=w, seed=cfg["seed"], covers=cfg["covers"],
        self_check=dict(max_abs=checks, out_std=float(ref.std()), out_min=float(ref.min()),
                        out_max=float(ref.max())),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent),
                    help="the folder that gets span/")
    args = ap.parse_args()
    write(CASES, span_case, Path(args.out) / "span")


if __name__ == "__main__":
    main()
