"""Rebuild docs/before_after.png, the README's picture: a crop of tests/photos/coffee.png
(CC0, Rachel Michetti; see tests/photos/LICENSES.md) shrunk by 4, then enlarged by 4 with
bicubic interpolation and with `upscale` (the embedded default model), beside the original.

usage: python3 docs/make_before_after.py [UPSCALE_BINARY]      (needs pillow)
"""
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw

root = Path(__file__).resolve().parent.parent
binary = sys.argv[1] if len(sys.argv) > 1 else str(root / "target/release/upscale")
hr = Image.open(root / "tests/photos/coffee.png").convert("RGB")
lr = hr.resize((hr.width // 4, hr.height // 4), Image.BICUBIC, reducing_gap=None)
with tempfile.TemporaryDirectory() as tmp:
    lr_path, sr_path = Path(tmp) / "lr.png", Path(tmp) / "sr.png"
    lr.save(lr_path)
    subprocess.run([binary, str(lr_path), "-o", str(sr_path), "-q"], check=True)
    sr = Image.open(sr_path).convert("RGB")
bicubic = lr.resize(hr.size, Image.BICUBIC)

box = (224, 128, 352, 256)  # the spoon, the cup and the saucer: edges and highlights
zoom = 2
panels = [("bicubic x4", bicubic), ("upscale x4", sr), ("original", hr)]
side = (box[2] - box[0]) * zoom
label_h, gap = 22, 6
out = Image.new("RGB", (len(panels) * side + (len(panels) - 1) * gap, side + label_h), "white")
draw = ImageDraw.Draw(out)
for i, (label, img) in enumerate(panels):
    x = i * (side + gap)
    out.paste(img.crop(box).resize((side, side), Image.NEAREST), (x, label_h))
    draw.text((x + 4, 4), label, fill="black")
out.save(root / "docs/before_after.png", optimize=True)
print(root / "docs/before_after.png")
