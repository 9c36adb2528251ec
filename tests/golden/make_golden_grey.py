#!/usr/bin/env python3
"""Write the float64 reference fixtures of greyscale models (one image channel in and out)
used by the Rust tests (tests/golden/grey/).

Run from anywhere:  python tests/golden/make_golden_grey.py [--out DIR]
Needs: torch, spandrel==0.4.2, numpy, safetensors. Nothing is downloaded.

The reference is spandrel's RRDBNet (ESRGAN), SRVGGNetCompact, RCAN, SPAN, MoSR and SwinIR's
restoration network built with one image channel, in float64 and eval mode, every parameter random (rounded to float32), the output
not clamped; each state dict is loaded back through spandrel's own loader, which must read
it as the same one-channel network. The inputs are one-channel: the tests feed them to
`upscale` as RGB images whose three channels are equal, which is how a grey image reaches
the network.
"""

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden_esrgan import ESRGAN_GAIN, randomise, sd32  # noqa: E402
from make_golden_swinir import make_input  # noqa: E402

import spandrel  # noqa: E402
from spandrel.architectures.__arch_helpers import block as B  # noqa: E402
from spandrel.architectures.Compact import Compact  # noqa: E402
from spandrel.architectures.MoSR import MoSR  # noqa: E402
from spandrel.architectures.ESRGAN import ESRGAN  # noqa: E402
from spandrel.architectures.RCAN import RCAN  # noqa: E402
from spandrel.architectures.SPAN import SPAN  # noqa: E402
from spandrel.architectures.SwinIR import SwinIR  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

GROWTH = 4


def esrgan():
    rrdb = B.RRDB
    B.RRDB = lambda **kw: rrdb(**{**kw, "gc": GROWTH})
    try:
        return ESRGAN(in_nc=1, out_nc=1, num_filters=8, num_blocks=1, scale=4)
    finally:
        B.RRDB = rrdb


def swinir(window):
    """SwinIR's restoration network (no upsampler: the input plus a correction) with one
    channel, as 004_grayDN (window 8, range 1) and 006_CAR (window 7, range 255) are; the
    range by the reference loader's rule for window 7."""
    return SwinIR(img_size=4 * window, patch_size=1, in_chans=1, embed_dim=8, depths=[2, 2],
                  num_heads=[2, 2], window_size=window, mlp_ratio=2.0, upscale=1,
                  img_range=255.0 if window == 7 else 1.0, upsampler="",
                  resi_connection="1conv")


def swinir_forward(model, x):
    """The reference test pipeline's padding (reflect, bottom and right, to the window) and
    crop around the module, as spandrel's own forward does for SwinIR."""
    _, _, h, w = x.shape
    win = model.window_size
    x = torch.nn.functional.pad(x, (0, (win - w % win) % win, 0, (win - h % win) % win),
                                mode="reflect")
    return model(x)[:, :, :h, :w]


CASES = [
    dict(name="esrgan_x4_grey", family="ESRGAN", scale=4, build=esrgan, gain=ESRGAN_GAIN,
         last=lambda m: m.model[-1], input=(1, 1, 13, 11), seed=71,
         covers="ESRGAN's old-arch keys, one channel in and out, x4"),
    dict(name="compact_x2_grey", family="Compact", scale=2,
         build=lambda: Compact(num_in_ch=1, num_out_ch=1, num_feat=6, num_conv=2, upscale=2),
         gain=1.4, last=lambda m: m.body[-1], input=(2, 1, 9, 10), seed=72,
         covers="Compact (PReLU), one channel, x2, batch 2"),
    dict(name="rcan_x2_grey", family="RCAN", scale=2,
         build=lambda: RCAN(scale=2, n_resgroups=1, n_resblocks=2, n_feats=8, n_colors=1,
                            norm=False, reduction=4),
         gain=1.0, last=lambda m: m.tail[-1], input=(1, 1, 12, 9), seed=73,
         covers="RCAN without the mean shift, one channel, x2"),
    dict(name="span_x2_grey", family="SPAN", scale=2,
         build=lambda: SPAN(num_in_ch=1, num_out_ch=1, feature_channels=8, upscale=2,
                            norm=False),
         gain=1.4, last=lambda m: m.upsampler[0], input=(1, 1, 11, 8), seed=74,
         covers="SPAN without input normalisation (its `no_norm` buffer), one channel, x2"),
    dict(name="swinir_dn_grey", family="SwinIR", scale=1, build=lambda: swinir(4),
         gain=1.0, last=lambda m: m.conv_last, input=(1, 1, 10, 9), seed=75,
         covers="SwinIR's restoration network with one channel (no mean), window 4, range 1, "
                "as 004_grayDN; 10x9 padded to 12x12", forward=swinir_forward),
    dict(name="swinir_jpeg_grey", family="SwinIR", scale=1, build=lambda: swinir(7),
         gain=1.0, last=lambda m: m.conv_last, input=(1, 1, 15, 13), seed=76,
         covers="the same with window 7 and range 255, as 006_CAR; 15x13 padded to 21x14",
         forward=swinir_forward),
    dict(name="mosr_x2_grey", family="MoSR", scale=2,
         build=lambda: MoSR(in_ch=1, out_ch=1, upscale=2, n_block=1, dim=8),
         gain=1.0, last=lambda m: m.upsampler[0], input=(1, 1, 9, 8), seed=77,
         covers="MoSR (PixelShuffle), one channel, x2"),
]


def load_back(sd):
    rrdb = B.RRDB
    B.RRDB = lambda **kw: rrdb(**{**kw, "gc": GROWTH})
    try:
        return spandrel.ModelLoader().load_from_state_dict(sd)
    finally:
        B.RRDB = rrdb


@torch.no_grad()
def case(cfg, out):
    x32 = make_input(dict(kind="pattern", shape=cfg["input"]), cfg["seed"])
    x = x32.double()
    model = randomise(cfg["build"]().double().eval(), cfg["seed"], cfg["gain"])
    fwd = cfg.get("forward", lambda m, t: m(t))
    # The restoration networks add their input: the correction is what is calibrated.
    last = cfg["last"](model)
    y0 = fwd(model, x.clone()) - (x if cfg["scale"] == 1 and "forward" in cfg else 0)
    for p in (last.weight, last.bias):
        p.copy_((p * (0.5 / float(y0.std()))).float().double())
    ref = fwd(model, x.clone())
    assert torch.isfinite(ref).all()
    sd = sd32(model)
    desc = load_back(sd)
    assert desc.input_channels == 1 and desc.output_channels == 1, cfg["name"]
    again = fwd(desc.model.double().eval(), x.clone())
    assert float((again - ref).abs().max()) < 1e-6, "spandrel reads the file differently"
    weights = f"{cfg['name']}.safetensors"
    # SPAN's `no_norm` buffer is in its state dict: the file keeps it, as released.
    save_file(sd, str(out / weights))
    io = f"{cfg['name']}.io.safetensors"
    save_file({"input": x32.contiguous(), "output": ref.contiguous()}, str(out / io))
    f32 = fwd(copy.deepcopy(model).float(), x32.clone()).double()
    b, _, h, w = x32.shape
    return dict(name=cfg["name"], weights=weights, io=io, family=cfg["family"],
                scale=cfg["scale"], batch=b, input_h=h, input_w=w, seed=cfg["seed"],
                covers=cfg["covers"],
                self_check=dict(max_abs={"float32": float((f32 - ref).abs().max())},
                                out_std=float(ref.std())))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "grey"))
    args = ap.parse_args()
    out = Path(args.out)
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
