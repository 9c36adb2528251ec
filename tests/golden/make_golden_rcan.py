#!/usr/bin/env python3
"""Write the float64 RCAN reference fixtures used by the Rust tests (tests/golden/rcan/).

Run from anywhere:  python tests/golden/make_golden_rcan.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's RCAN module in float64 and eval mode, every parameter random
(rounded to float32 so a float32 port loads exactly what the reference used), the output
not clamped. The mean shift's 1x1 convolutions (`sub_mean`, `add_mean`) are perturbed away
from the DIV2K mean the class builds them with, so that a port which builds its own shift
instead of reading the file's fails. spandrel's forward multiplies its input by the image
range in place, so every call here gets a copy. Each state dict is loaded back through
spandrel's own loader, which must reproduce the output: the configuration it reads (groups,
blocks, scale, unshuffle, mean shift) is the reference's.

released.json holds the names and shapes of the state dicts of the released configuration
(n_feats 64, 10 groups of 20 blocks, reduction 16, with the mean shift) at x2, x3, x4 and
x8, and of the traiNNer-redux form that unshuffles its input (x2 and x1), with the
parameter count of each. The body's tensors, the same in all, are listed in the first only.
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
from spandrel.architectures.RCAN import RCAN  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

CASES = [
    dict(
        name="rcan_x4_shift", scale=4, nf=8, ng=2, nb=2, reduction=4, norm=True,
        unshuffle=False, input=dict(kind="pattern", shape=(1, 3, 13, 11)), seed=61,
        weights="pth-plain",
        covers="mean shift (sub_mean/add_mean, range 255), x4 (two doublings), 2 groups "
               "of 2 blocks, a plain .pth state dict as the authors' RCAN_BIX4.pt",
    ),
    dict(
        name="rcan_x3_plain", scale=3, nf=8, ng=1, nb=3, reduction=2, norm=False,
        unshuffle=False, input=dict(kind="noise", shape=(2, 3, 9, 10)), seed=62,
        weights="safetensors",
        covers="no mean shift (range 1), x3 (one tripling), batch 2",
    ),
    dict(
        name="rcan_x2_unshuffle", scale=2, nf=8, ng=2, nb=1, reduction=4, norm=True,
        unshuffle=True, input=dict(kind="pattern", shape=(1, 3, 15, 9)), seed=63,
        weights="pth-params",
        covers="x2 with its input pixel-unshuffled by 2 (12 head channels, an x4 "
               "upsampler), 15x9 reflect-padded to 16x10 and cropped; {'params': ...}",
    ),
    dict(
        name="rcan_x1_unshuffle", scale=1, nf=8, ng=1, nb=2, reduction=4, norm=False,
        unshuffle=True, input=dict(kind="pattern", shape=(1, 3, 13, 18)), seed=64,
        weights="safetensors",
        covers="x1 with its input pixel-unshuffled by 4 (48 head channels), 13x18 "
               "reflect-padded to 16x20 and cropped",
    ),
    dict(
        name="rcan_x8_shift", scale=8, nf=6, ng=1, nb=1, reduction=3, norm=True,
        unshuffle=False, input=dict(kind="pattern", shape=(1, 3, 7, 5)), seed=65,
        weights="safetensors",
        covers="mean shift, x8 (three doublings), one group of one block, 7x5",
    ),
]

RELEASED = [
    ("RCAN x2", dict(scale=2)),
    ("RCAN x3", dict(scale=3)),
    ("RCAN x4", dict(scale=4)),
    ("RCAN x8", dict(scale=8)),
    ("RCAN x2, unshuffled input", dict(scale=2, unshuffle_mod=True)),
    ("RCAN x1, unshuffled input, no mean shift", dict(scale=1, unshuffle_mod=True, norm=False)),
]


def build(cfg):
    m = RCAN(scale=cfg["scale"], n_resgroups=cfg["ng"], n_resblocks=cfg["nb"],
             n_feats=cfg["nf"], reduction=cfg["reduction"], norm=cfg["norm"],
             unshuffle_mod=cfg["unshuffle"])
    return m.double().eval()


@torch.no_grad()
def randomise(model, seed):
    """Weights at 1 / sqrt(fan-in), biases at 0.1; the mean shift's near its own."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if name.startswith(("sub_mean.", "add_mean.")):
            r = p + (0.05 * noise if name.endswith(".weight") else 3.0 * noise)
        elif name.endswith(".bias"):
            r = 0.1 * noise
        else:
            r = noise / math.sqrt(p[0].numel())
        p.copy_(r.float().double())
    return model


def forward(model, x):
    with torch.no_grad():
        return model(x.clone())


@torch.no_grad()
def calibrate(model, x, target):
    """Scale the last convolution so that the output spreads about `target`."""
    last = model.tail[-1]
    for _ in range(3):
        std = float(forward(model, x).std())
        for p in (last.weight, last.bias):
            p.copy_((p * (target / std)).float().double())
    return model


def sd32(model):
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}


def save(sd, cfg, out_dir):
    name = cfg["name"]
    kind = cfg["weights"]
    if kind == "safetensors":
        weights = f"{name}.safetensors"
        save_file(sd, str(out_dir / weights))
    else:
        weights = f"{name}.pth"
        wrap = {"pth-plain": None, "pth-params": "params"}[kind]
        torch.save(sd if wrap is None else {wrap: sd}, out_dir / weights)
    return weights


def deviation(model, x, ref, mutate):
    m2 = copy.deepcopy(model)
    with torch.no_grad():
        y = mutate(m2, x.clone())
    return float((y - ref).abs().max())


@torch.no_grad()
def case(cfg, out_dir):
    x32 = make_input(cfg["input"], cfg["seed"])
    x = x32.double()
    model = calibrate(randomise(build(cfg), cfg["seed"]), x, 0.5)
    ref = forward(model, x)
    assert torch.isfinite(ref).all()
    sd = sd32(model)
    desc = spandrel.ModelLoader().load_from_state_dict(sd)
    again = forward(desc.model.double().eval(), x)
    assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = save(sd, cfg, out_dir)
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out_dir / io))

    f32 = forward(copy.deepcopy(model).float(), x32).double()
    checks = {"float32": float((f32 - ref).abs().max())}

    def no_attention(m2, x):
        for mod in m2.modules():
            if hasattr(mod, "conv_du"):
                mod.forward = lambda t: t
        return m2(x)

    def leaky(m2, x):
        for mod in m2.modules():
            if hasattr(mod, "body") and isinstance(mod.body, torch.nn.Sequential):
                for i, sub in enumerate(mod.body):
                    if isinstance(sub, torch.nn.ReLU):
                        mod.body[i] = torch.nn.LeakyReLU(0.2)
        return m2(x)

    def div2k_shift(m2, x):
        fresh = RCAN(scale=1, n_resgroups=0, n_resblocks=0, n_feats=4).double()
        m2.sub_mean.load_state_dict(fresh.sub_mean.state_dict())
        m2.add_mean.load_state_dict(fresh.add_mean.state_dict())
        return m2(x)

    def replicate_pad(m2, x):
        d = m2.downscale_factor
        _, _, h, w = x.shape
        m2.check_img_size = lambda t: F.pad(
            t, (0, (d - w % d) % d, 0, (d - h % d) % d), mode="replicate")
        return m2(x)

    checks["no channel attention"] = deviation(model, x, ref, no_attention)
    checks["LeakyReLU 0.2 for ReLU"] = deviation(model, x, ref, leaky)
    if cfg["norm"]:
        checks["the DIV2K shift, not the file's"] = deviation(model, x, ref, div2k_shift)
    if cfg["unshuffle"]:
        checks["replicate padding"] = deviation(model, x, ref, replicate_pad)
    b, _, h, w = x32.shape
    return dict(
        name=cfg["name"], weights=weights, io=io, weights_format=cfg["weights"],
        scale=cfg["scale"], features=cfg["nf"], groups=cfg["ng"], blocks=cfg["nb"],
        reduction=cfg["reduction"], mean_shift=cfg["norm"],
        unshuffle=(4 // cfg["scale"]) if cfg["unshuffle"] else 1, batch=b, input_h=h,
        input_w=w, seed=cfg["seed"], covers=cfg["covers"],
        self_check=dict(max_abs=checks, out_std=float(ref.std()), out_min=float(ref.min()),
                        out_max=float(ref.max())),
    )


def released():
    """Every released configuration's tensor shapes; the body's (the same in all) only in
    the first's."""
    out = {}
    body = None
    for name, kw in RELEASED:
        sd = RCAN(**kw).state_dict()
        shapes = {k: list(v.shape) for k, v in sd.items()}
        own = {k: s for k, s in shapes.items() if not k.startswith("body.")}
        if body is None:
            body = {k: s for k, s in shapes.items() if k.startswith("body.")}
            own = shapes
        else:
            assert {k: s for k, s in shapes.items() if k.startswith("body.")} == body
        out[name] = dict(args=kw, parameters=sum(v.numel() for v in sd.values()), shapes=own)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "rcan"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = []
    for cfg in CASES:
        entry = case(cfg, out)
        manifest.append(entry)
        checks = entry["self_check"]["max_abs"]
        print(f"{entry['name']}: out std {entry['self_check']['out_std']:.3f}; "
              + ", ".join(f"{k} {v:.2e}" for k, v in checks.items()), flush=True)
    with open(out / "manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    with open(out / "released.json", "w") as f:
        json.dump(released(), f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
