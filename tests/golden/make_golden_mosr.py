#!/usr/bin/env python3
"""Write the float64 MoSR reference fixtures used by the Rust tests (tests/golden/mosr/).

Run from anywhere:  python tests/golden/make_golden_mosr.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's MoSR in float64 and eval mode, every parameter random (weights at
1 / sqrt(fan-in), biases at 0.1, the LayerNorms' around 1 and 0, rounded to float32; DySample
as its module initialises it but for a random scope, which it starts at zero), the output not
clamped. Each state dict is loaded back through spandrel's loader, which must read the same
configuration and reproduce the output.
"""

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_swinir import make_input  # noqa: E402

import spandrel  # noqa: E402
from spandrel.architectures.MoSR import MoSR  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

CASES = [
    dict(name="mosr_x4_ps", args=dict(upscale=4, n_block=2, dim=8, upsampler="ps",
                                      kernel_size=7, expansion_ratio=1.5, conv_ratio=1.0),
         input=(1, 3, 13, 11), seed=81,
         covers="PixelShuffle x4, two blocks, the release's 7x7 depthwise, conv_ratio 1"),
    dict(name="mosr_x2_gps", args=dict(upscale=2, n_block=1, dim=8, upsampler="gps",
                                       kernel_size=5, expansion_ratio=2.0, conv_ratio=0.5),
         input=(2, 3, 9, 10), seed=82,
         covers="GPS x2 (eight convolutions averaged), 5x5 depthwise on half the channels, "
                "batch 2"),
    dict(name="mosr_x3_dys", args=dict(upscale=3, n_block=1, dim=8, upsampler="dys",
                                       kernel_size=7, expansion_ratio=1.5, conv_ratio=1.0),
         input=(1, 3, 10, 7), seed=83,
         covers="DySample x3 (four groups)"),
]


@torch.no_grad()
def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if name.endswith("norm.weight"):
            r = 1.0 + 0.2 * noise
        elif name.endswith(".bias"):
            r = 0.1 * noise
        elif name.endswith("scope.weight") or name.endswith("offset.weight"):
            r = 0.05 * noise
        else:
            r = noise / math.sqrt(p[0].numel())
        p.copy_(r.float().double())
    return model


@torch.no_grad()
def case(cfg, out):
    x32 = make_input(dict(kind="pattern", shape=cfg["input"]), cfg["seed"])
    x = x32.double()
    model = randomise(MoSR(**cfg["args"]).double().eval(), cfg["seed"])
    ref = model(x)
    assert torch.isfinite(ref).all()
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    desc = spandrel.ModelLoader().load_from_state_dict(sd)
    again = desc.model.double().eval()(x)
    assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = f"{cfg['name']}.safetensors"
    save_file(sd, str(out / weights))
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out / io))
    f32 = copy.deepcopy(model).float()(x32).double()
    b, _, h, w = x32.shape
    return dict(name=cfg["name"], weights=weights, io=io, scale=cfg["args"]["upscale"],
                upsampler=cfg["args"]["upsampler"], blocks=cfg["args"]["n_block"],
                kernel=cfg["args"]["kernel_size"], batch=b, input_h=h, input_w=w,
                seed=cfg["seed"], covers=cfg["covers"],
                self_check=dict(max_abs={"float32": float((f32 - ref).abs().max())},
                                out_std=float(ref.std())))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "mosr"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for cfg in CASES:
        entry = case(cfg, out)
        manifest.append(entry)
        print(f"{entry['name']}: out std {entry['self_check']['out_std']:.3f}, float32 "
              f"{entry['self_check']['max_abs']['float32']:.2e}", flush=True)
    with open(out / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
