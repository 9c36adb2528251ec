#!/usr/bin/env python3
"""Write the float64 SAFMN reference fixtures used by the Rust tests (tests/golden/safmn/).

Run from anywhere:  python tests/golden/make_golden_safmn.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's SAFMN in float64 and eval mode, every parameter random (weights at
1 / sqrt(fan-in), biases at 0.1, the LayerNorms around 1 and 0; rounded to float32), run as
spandrel's model descriptor runs it: the input reflect-padded (bottom, right) to a multiple
of 8, which the multi-scale pooling needs, and the output cropped. The last convolution is
scaled so the output spreads about 0.3. Each state dict is loaded back through spandrel's
loader, which must read the same configuration and reproduce the output.
`--bench DIR` writes random weights of the released shape (dim 36, 8 blocks, x4) instead.
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
from spandrel.architectures.SAFMN import SAFMN  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

CASES = [
    dict(name="safmn_x4", args=dict(dim=16, n_blocks=2, ffn_scale=2.0, upscaling_factor=4),
         input=(1, 3, 13, 11), seed=111, weights="safetensors",
         covers="x4, two blocks, the input padded to 16x16"),
    dict(name="safmn_x2_ema", args=dict(dim=8, n_blocks=1, ffn_scale=1.5, upscaling_factor=2),
         input=(2, 3, 16, 24), seed=112, weights="pth-ema",
         covers="x2, FFN 1.5, batch 2, no padding"),
    dict(name="safmn_x3_params", args=dict(dim=12, n_blocks=1, ffn_scale=2.0,
                                           upscaling_factor=3),
         input=(1, 3, 9, 17), seed=113, weights="pth-params",
         covers="x3, the input padded to 16x24"),
    dict(name="safmn_x1_plain", args=dict(dim=8, n_blocks=2, ffn_scale=2.0, upscaling_factor=1),
         input=(1, 3, 20, 12), seed=114, weights="pth-plain",
         covers="x1 (restoration), the input padded to 24x16"),
]


def run(model, x):
    """As spandrel's descriptor runs SAFMN: reflect-padded to a multiple of 8, cropped."""
    h, w = x.shape[-2:]
    ph, pw = (-h) % 8, (-w) % 8
    y = model(F.pad(x, (0, pw, 0, ph), "reflect"))
    s = y.shape[-1] // (w + pw)
    return y[..., : h * s, : w * s]


@torch.no_grad()
def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if ".norm" in name and name.endswith(".weight"):
            r = 1.0 + 0.2 * r
        elif name.endswith(".bias"):
            r = 0.1 * r
        else:
            r = r / math.sqrt(p[0].numel())
        p.copy_(r.float().double())
    return model


@torch.no_grad()
def safmn_case(cfg, out_dir):
    x32 = make_input(dict(kind="pattern", shape=cfg["input"]), cfg["seed"])
    x = x32.double()
    model = randomise(SAFMN(**cfg["args"]).double().eval(), cfg["seed"])
    last = model.to_img[0]
    std = float(run(model, x).std())
    for p in (last.weight, last.bias):
        p.copy_((p * (0.3 / std)).float().double())
    ref = run(model, x)
    assert torch.isfinite(ref).all()
    sd = sd32(model)
    desc = spandrel.ModelLoader().load_from_state_dict(copy.deepcopy(sd))
    assert desc.architecture.id == "SAFMN" and desc.scale == cfg["args"]["upscaling_factor"]
    again = desc.model.double().eval()
    assert float((run(again, x) - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = save(model, cfg, out_dir, sd)
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))
    f32 = run(copy.deepcopy(model).float(), x32).double()
    checks = {"float32": float((f32 - ref).abs().max())}

    def zero_padded(m2, x):
        h, w = x.shape[-2:]
        y = m2(F.pad(x, (0, (-w) % 8, 0, (-h) % 8)))
        s = y.shape[-1] // (w + (-w) % 8)
        return y[..., : h * s, : w * s]

    def average_pooled(m2, x):
        real = F.adaptive_max_pool2d
        F.adaptive_max_pool2d = F.adaptive_avg_pool2d
        try:
            return run(m2, x)
        finally:
            F.adaptive_max_pool2d = real

    if cfg["input"][2] % 8 or cfg["input"][3] % 8:
        checks["zero padding"] = deviation(model, x, ref, zero_padded)
    checks["average pooling"] = deviation(model, x, ref, average_pooled)
    a = cfg["args"]
    b, _, h, w = x32.shape
    return dict(
        name=cfg["name"], weights=weights, io=io, weights_format=cfg["weights"],
        scale=a["upscaling_factor"], dim=a["dim"], blocks=a["n_blocks"],
        hidden=int(a["dim"] * a["ffn_scale"]), batch=b, input_h=h, input_w=w,
        seed=cfg["seed"], covers=cfg["covers"],
        self_check=dict(max_abs=checks, out_std=float(ref.std())),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "safmn"))
    ap.add_argument("--bench", help="write the benchmark's weights into this folder instead")
    args = ap.parse_args()
    if args.bench:
        out = Path(args.bench)
        out.mkdir(parents=True, exist_ok=True)
        model = randomise(SAFMN(dim=36, n_blocks=8, ffn_scale=2.0, upscaling_factor=4), 0)
        save_file(sd32(model), str(out / "safmn_x4_random.safetensors"))
        return
    write(CASES, safmn_case, Path(args.out))


if __name__ == "__main__":
    main()
