#!/usr/bin/env python3
"""Write the float64 FDAT reference fixtures used by the Rust tests (tests/golden/fdat/).

Run from anywhere:  python tests/golden/make_golden_fdat.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's FDAT in float64 and eval mode, every parameter random (weights at
1 / sqrt(fan-in), biases at 0.1, the LayerNorms around 1 and 0, the attention biases and
temperatures at their scale; rounded to float32), the output not clamped, and its last
convolution scaled so that the output spreads about 0.3. Each state dict is loaded back
through spandrel's loader, which must read the same configuration and reproduce the output.
`--bench DIR` writes random weights of the "medium" shape (embed 120, 4 groups of 3 pairs of
blocks, 4 heads, window 8, pixelshuffle x4) for the benchmarks instead.
"""

import argparse
import copy
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_esrgan import deviation, save, sd32, write  # noqa: E402
from make_golden_swinir import make_input  # noqa: E402

import spandrel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from spandrel.architectures.FDAT import FDAT  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

# FDAT's DySample asks for its normaliser in pinned memory, which needs a CUDA driver; where
# a tensor lives does not change its values (spandrel's shared DySample dropped the request).
_tensor = torch.tensor


def _unpinned(*args, **kwargs):
    kwargs.pop("pin_memory", None)
    return _tensor(*args, **kwargs)


torch.tensor = _unpinned

SMALL = dict(embed_dim=16, num_groups=2, depth_per_group=1, num_heads=2, window_size=4,
             ffn_expansion_ratio=1.5, aim_reduction_ratio=4, mid_dim=16)

CASES = [
    dict(name="fdat_x4_ps", args=dict(scale=4, upsampler_type="pixelshuffle", mid_dim=12),
         input=(1, 3, 13, 11), seed=91, weights="safetensors",
         covers="pixelshuffle x4 (two x2 stages), windows padded inside the attention"),
    dict(name="fdat_x2_tc", args=dict(scale=2, upsampler_type="transpose+conv"),
         input=(2, 3, 8, 12), seed=92, weights="pth-ema",
         covers="transpose+conv x2, batch 2, no window padding"),
    dict(name="fdat_x3_tc", args=dict(scale=3, upsampler_type="transpose+conv",
                                      depth_per_group=2),
         input=(1, 3, 9, 7), seed=93, weights="pth-params",
         covers="transpose+conv x3 (kernel 3, stride 3), two pairs of blocks a group"),
    dict(name="fdat_x4_tc", args=dict(scale=4, upsampler_type="transpose+conv",
                                      window_size=8, num_heads=4),
         input=(1, 3, 10, 9), seed=94, weights="pth-plain",
         covers="transpose+conv x4 (two transposed convolutions and a GELU), window 8, "
                "4 heads"),
    dict(name="fdat_x3_psd", args=dict(scale=3, upsampler_type="pixelshuffledirect"),
         input=(1, 3, 7, 10), seed=95, weights="safetensors",
         covers="pixelshuffledirect x3"),
    dict(name="fdat_x4_dys", args=dict(scale=4, upsampler_type="dysample", mid_dim=12),
         input=(1, 3, 9, 8), seed=96, weights="safetensors",
         covers="DySample x4 after a 3x3 to mid_dim"),
    dict(name="fdat_x2_dys_same", args=dict(scale=2, upsampler_type="dysample"),
         input=(1, 3, 8, 9), seed=97, weights="safetensors",
         covers="DySample x2 straight from the body (mid_dim = embed_dim)"),
    dict(name="fdat_x2_pa", args=dict(scale=2, upsampler_type="pa_up"),
         input=(1, 3, 9, 6), seed=98, weights="safetensors",
         covers="pa_up x2 (nearest, 3x3, pixel attention). pa_up records mid_dim as its input "
                "width, which spandrel's loader then takes for embed_dim: its fixtures keep the "
                "two equal (the default here) so that the loader's check can run"),
    dict(name="fdat_x3_pa", args=dict(scale=3, upsampler_type="pa_up"),
         input=(1, 3, 6, 7), seed=99, weights="safetensors",
         covers="pa_up x3"),
    dict(name="fdat_x4_nc", args=dict(scale=4, upsampler_type="nearest+conv"),
         input=(1, 3, 7, 6), seed=100, weights="safetensors",
         covers="nearest+conv x4"),
    dict(name="fdat_x1_conv", args=dict(scale=1, upsampler_type="conv"),
         input=(1, 3, 11, 13), seed=101, weights="safetensors",
         covers="scale 1: one 3x3 to RGB"),
    dict(name="fdat_x2_unshuffle", args=dict(scale=2, upsampler_type="pixelshuffle",
                                             unshuffle_mod=True),
         input=(1, 3, 9, 10), seed=102, weights="safetensors",
         covers="unshuffle_mod x2: the input pixel-unshuffled by 2 (reflect-padded to even "
                "sizes), the upsampler x4"),
]


def build(cfg):
    args = {**SMALL, **cfg["args"]}
    return FDAT(**args)


@torch.no_grad()
def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if name.endswith((".n1.weight", ".n2.weight")):
            r = 1.0 + 0.2 * r
        elif name.endswith(".bias") and p.dim() == 1:
            r = 0.1 * r
        elif name.endswith("attn.bias"):
            r = 0.5 * r
        elif name.endswith("attn.temp"):
            r = 1.0 + 0.2 * r
        elif name.endswith(("scope.weight", "offset.weight")):
            r = 0.05 * r
        else:
            r = r / math.sqrt(p[0].numel())
        p.copy_(r.float().double())
    return model


@torch.no_grad()
def calibrate(model, x, target):
    """Scale the upsampler's last layer with weights so the output spreads about `target`."""
    std = float(model(x).std())
    layers = [m for m in model.upsampler.modules() if getattr(m, "weight", None) is not None]
    # DySample's convolutions come before its sampling; its end_conv writes the output.
    ends = [m.end_conv for m in model.upsampler.modules() if hasattr(m, "end_conv")]
    last = (ends or layers)[-1]
    for p in (last.weight, last.bias):
        if p is not None:
            p.copy_((p * (target / std)).float().double())


@torch.no_grad()
def fdat_case(cfg, out_dir):
    x32 = make_input(dict(kind="pattern", shape=cfg["input"]), cfg["seed"])
    x = x32.double()
    model = randomise(build(cfg).double().eval(), cfg["seed"])
    calibrate(model, x, 0.3)
    ref = model(x)
    assert torch.isfinite(ref).all()
    sd = sd32(model)
    # The upsampler's description is a uint8 buffer: kept as it is, as a released file holds it.
    sd["upsampler.MetaUpsample"] = model.upsampler.MetaUpsample.clone()
    desc = spandrel.ModelLoader().load_from_state_dict(copy.deepcopy(sd))
    assert desc.architecture.id == "FDAT" and desc.scale == cfg["args"]["scale"]
    again = desc.model.double().eval()(x)
    assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = save(model, cfg, out_dir, sd)
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))
    f32 = copy.deepcopy(model).float()(x32).double()
    checks = {"float32": float((f32 - ref).abs().max())}

    def tanh_gelu(m2, x):
        for mod in m2.modules():
            if isinstance(mod, torch.nn.GELU):
                mod.approximate = "tanh"
        return m2(x)

    checks["tanh GELU"] = deviation(model, x, ref, tanh_gelu)
    args = {**SMALL, **cfg["args"]}
    b, _, h, w = x32.shape
    return dict(
        name=cfg["name"], weights=weights, io=io, weights_format=cfg["weights"],
        scale=args["scale"], upsampler=args["upsampler_type"], embed_dim=args["embed_dim"],
        groups=args["num_groups"], depth=args["depth_per_group"], heads=args["num_heads"],
        window=args["window_size"], mid_dim=args["mid_dim"],
        unshuffle=bool(args.get("unshuffle_mod", False)), batch=b, input_h=h, input_w=w,
        seed=cfg["seed"], covers=cfg["covers"],
        self_check=dict(max_abs=checks, out_std=float(ref.std())),
    )


def bench_model(out_dir):
    out_dir.mkdir(parents=True, exist_ok=True)
    model = FDAT(embed_dim=120, num_groups=4, depth_per_group=3, num_heads=4, window_size=8,
                 ffn_expansion_ratio=2.0, aim_reduction_ratio=8, mid_dim=64, scale=4,
                 upsampler_type="pixelshuffle")
    randomise(model.double(), 0)
    sd = sd32(model)
    sd["upsampler.MetaUpsample"] = model.upsampler.MetaUpsample.clone()
    save_file(sd, str(out_dir / "fdat_x4_random.safetensors"))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "fdat"))
    ap.add_argument("--bench", help="write the benchmark's weights into this folder instead")
    args = ap.parse_args()
    if args.bench:
        bench_model(Path(args.bench))
        return
    write(CASES, fdat_case, Path(args.out))


if __name__ == "__main__":
    main()
