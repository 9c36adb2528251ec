#!/usr/bin/env python3
"""Re-derive every fixture output from the files alone, as a consumer would.

python tests/golden/check_golden.py [--dir DIR]

Each case's weights are loaded from its weights file only (config inferred from shapes,
.pth unwrapped the way a careful loader should: 'params_ema' before 'params', 'module.'
stripped), run in float64 with the padding convention of make_golden.py, and compared
with the stored output. Also checks that picking 'params' instead of 'params_ema' fails.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from spandrel.architectures.DRCT import DRCT


def unwrap(obj):
    for key in ("params_ema", "params", "state_dict", "model", "net"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in obj.items()}


def model_from_sd(sd):
    e = sd["conv_first.weight"].shape[0]
    groups = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    heads = [sd[f"layers.{i}.swin1.attn.relative_position_bias_table"].shape[1] for i in range(groups)]
    ws = (math.isqrt(sd["layers.0.swin1.attn.relative_position_bias_table"].shape[0]) + 1) // 2
    scale = 1
    for k in ("upsample.0.weight", "upsample.2.weight"):
        if k in sd:
            scale *= math.isqrt(sd[k].shape[0] // sd[k].shape[1])
    m = DRCT(
        img_size=4 * ws, embed_dim=e, depths=(6,) * groups, num_heads=heads, window_size=ws,
        mlp_ratio=sd["layers.0.swin1.mlp.fc1.weight"].shape[0] / e, drop_path_rate=0.0,
        upscale=scale, upsampler="pixelshuffle", gc=sd["layers.0.adjust1.weight"].shape[0],
    )
    params = {k: v for k, v in sd.items() if not k.endswith(("relative_position_index", "attn_mask"))}
    missing, unexpected = m.load_state_dict(params, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith(("relative_position_index", "attn_mask")) for k in missing), missing
    return m.double().eval(), ws, scale


@torch.no_grad()
def run(m, x, ws, scale):
    h, w = x.shape[-2:]
    ph, pw = (ws - h % ws) % ws, (ws - w % ws) % ws
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph), mode="reflect")
    return m(x)[:, :, : h * scale, : w * scale]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parent))
    d = Path(ap.parse_args().dir)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    ok = True
    for case in json.loads((d / "manifest.json").read_text()):
        wf = d / case["weights"]
        raw = load_file(str(wf)) if wf.suffix == ".safetensors" else torch.load(wf, map_location="cpu", weights_only=True)
        sd = unwrap(raw)
        assert all(v.dtype in (torch.float32, torch.int64) for v in sd.values())
        m, ws, scale = model_from_sd(sd)
        io = load_file(str(d / case["io"]))
        x, y = io["input"], io["output"]
        assert x.dtype == torch.float32 and y.dtype == torch.float64
        assert (ws, scale, x.shape[0], x.shape[2], x.shape[3]) == (
            case["window"], case["scale"], case["batch"], case["input_h"], case["input_w"])
        dev = float((run(m, x.double(), ws, scale) - y).abs().max())
        line = f"{case['name']}: recomputed vs stored max abs {dev:.1e}"
        ok &= dev < 1e-12
        if isinstance(raw, dict) and "params" in raw and "params_ema" in raw:
            mp, _, _ = model_from_sd(raw["params"])
            wrong = float((run(mp, x.double(), ws, scale) - y).abs().max())
            line += f"; with 'params' instead of 'params_ema': {wrong:.1e}"
            ok &= wrong > 1e-2
        print(line)
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
