#!/usr/bin/env python3
"""Writes the parity fixture for the default model: a small crop of a held-out
photo and the float64 reference output of the committed weights.

  python models/make_parity_fixture.py \
      --weights models/default_x4.safetensors \
      --photo tests/photos/astronaut.png \
      --out tests/golden/default_x4.io.safetensors

The reference is spandrel's DRCT run in float64 (spandrel is numerically the
official implementation), with the official test pipeline's padding:
reflect-101 on the bottom/right up to a multiple of the window, only when
needed, then a crop. The output is left unclamped so a port is compared on the
network itself, not on clipping. The crop size (36x42) is deliberately not a
multiple of the window, so the padding path and the shifted-window mask for a
non-training size are both exercised.
"""

import argparse
import hashlib
import os
import sys

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_default as recipe  # noqa: E402  (model config lives there)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--weights", default="models/default_x4.safetensors")
    p.add_argument("--photo", default="tests/photos/astronaut.png")
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--left", type=int, default=100)
    p.add_argument("--height", type=int, default=36)
    p.add_argument("--width", type=int, default=42)
    p.add_argument("--out", default="tests/golden/default_x4.io.safetensors")
    a = p.parse_args()

    sd = load_file(a.weights)
    recipe.CONFIG.update(recipe.config_from_weights(sd))
    ws = recipe.CONFIG["window_size"]
    if a.height % ws == 0 or a.width % ws == 0:
        raise SystemExit(f"crop {a.height}x{a.width} should not be a multiple of the window {ws}")

    model = recipe.build_model(img_size=64)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(
        k.endswith(("relative_position_index", "attn_mask")) for k in missing
    ), (missing, unexpected)
    model = model.double().eval()

    img = np.asarray(Image.open(a.photo).convert("RGB"))
    crop = img[a.top:a.top + a.height, a.left:a.left + a.width]
    x32 = torch.from_numpy(crop.copy()).permute(2, 0, 1)[None].float() / 255.0
    with torch.no_grad():
        y = recipe.run_padded(model, x32.double())
    assert y.dtype == torch.float64 and y.shape[-2:] == (a.height * 4, a.width * 4)

    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    sha = hashlib.sha256(open(a.weights, "rb").read()).hexdigest()
    save_file(
        {"input": x32.contiguous(), "output": y.contiguous()},
        a.out,
        metadata={
            "weights_sha256": sha,
            "source": f"{os.path.basename(a.photo)} rows {a.top}..{a.top + a.height} "
                      f"cols {a.left}..{a.left + a.width}, /255",
            "reference": "spandrel DRCT, float64, reflect-101 pad bottom/right to window multiple, crop",
            "window_size": str(ws),
            "scale": "4",
        },
    )
    print(f"{a.out}: input {tuple(x32.shape)} output {tuple(y.shape)} "
          f"range [{y.min().item():.4f}, {y.max().item():.4f}] weights sha256 {sha}")


if __name__ == "__main__":
    main()
