#!/usr/bin/env python3
"""Training recipe for the small DRCT x4 model embedded in `upscale` as its default.

Subcommands (all paths are arguments; nothing is fetched at run time):

  photos  --debroot DIR --out tests/photos
      Writes the held-out validation photos (HR PNGs) that CI evaluates on.
  train   --debroot DIR --photos tests/photos --workdir DIR --steps N ...
      Trains (on the CPU, or --device cuda), validates periodically, keeps the
      best checkpoint by validation Y-PSNR; resumes from DIR/last.pt when it
      exists. --images FILE.npz reads the training images that `pack` wrote
      instead of the sources (for a machine without the packages).
  pack    --debroot DIR --out FILE.npz [--sources v3]
      Writes the training images, shrunk as training reads them, to one file.
      With --held-out-photos tests/photos instead of --debroot it packs the held-out
      photos themselves: training on them measures how far a shape can go on the
      test set when it has seen it (a ceiling, never a model to ship).
  export  --ckpt DIR/best.pt --out models/default_x4.safetensors
      Writes the official DRCT key layout, float32, no buffers, with metadata.
  eval    --weights models/default_x4.safetensors --photos tests/photos
      Y-PSNR of the model and of MATLAB-style bicubic on the held-out photos.

DIR for --debroot is a folder into which the Debian packages in DEB_PACKAGES
were extracted with `dpkg-deb -x`; the other photos come from the installed
Python packages in PY_PACKAGES (scikit-image, scikit-learn). models/train_v2.sh
does all of it (data and training) in one command; models/README.md lists every
image with its licence.
"""

import os

# The training machine is shared: keep numpy's BLAS to one thread as well.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse
import copy
import hashlib
import json
import math
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
from torch_drct import set_upsampler_width  # noqa: E402  (torch only: the GPU benches use it too)

SCALE = 4

# Small DRCT: 2 residual dense groups of the official 5-block design. Widths of
# the five blocks are E + k*gc = 48..112, all divisible by 4 heads, so every
# block keeps 4 heads (head dim 12..28). num_feat stays 64 because spandrel (and
# tools built on it) hard-codes that width for the upsampler.
CONFIG = dict(
    embed_dim=48,
    groups=2,
    window_size=8,
    num_heads=4,
    gc=16,
    mlp_ratio=2.0,
    # Width of the pixel-shuffle upsampler. The official code hard-codes 64; at x4 that
    # upsampler is over half of the model's arithmetic per pixel, so a smaller one leaves
    # room for a deeper body at the same inference cost.
    num_feat=64,
)

# ---------------------------------------------------------------------------
# Data sources (v2). Only real photographs whose licence allows any use with
# attribution at most: CC0, public domain, CC-BY. Nothing under GPL, LGPL,
# share-alike or an unstated licence. Licences and authors are those stated by
# the shipping package (Debian copyright file, scikit-image docstring,
# scikit-learn's datasets/images/README.txt).
#
# A source id is "KIND:PACKAGE/FILE":
#   deb:PACKAGE/FILE  FILE relative to the folder PACKAGE was extracted into
#                     (--debroot; `dpkg-deb -x PACKAGE.deb DEBROOT`)
#   py:PACKAGE/FILE   FILE relative to the installed Python package's folder
# Every image is read with PIL and converted to RGB (the greyscale texture
# photos become R = G = B).
DEB_PACKAGES = {
    # package: version (Debian 12)
    "lomiri-wallpapers-16.04": "20.04.0-2",
    # v3 only (--sources v3)
    "sddm-theme-maldives": "0.19.0-5",
    "libjxl-testdata": "0.0~git20230110.d6168ff-1",
}
PY_PACKAGES = {
    # import name: (PyPI distribution, version)
    "skimage": ("scikit-image", "0.26.0"),
    "sklearn": ("scikit-learn", "1.9.1"),
}
_BG = "usr/share/backgrounds/"
SOURCES = {
    # id: (licence, author)
    "py:skimage/data/astronaut.png": ("public domain", "NASA"),
    "py:skimage/data/coffee.png": ("CC0", "Rachel Michetti"),
    "py:skimage/data/chelsea.png": ("CC0", "Stefan van der Walt"),
    "py:skimage/data/rocket.jpg": ("public domain", "SpaceX"),
    "py:skimage/data/camera.png": ("CC0", "Lav Varshney"),
    "py:skimage/data/brick.png": ("CC0", "CC0Textures (Bricks25)"),
    "py:skimage/data/grass.png": ("CC0", "CC0Textures (Grass)"),
    "py:skimage/data/gravel.png": ("CC0", "CC0Textures (Gravel04)"),
    "py:sklearn/datasets/images/china.jpg": ("CC-BY-2.0", "danielbuechele (Flickr)"),
    "py:sklearn/datasets/images/flower.jpg": ("CC-BY-2.0", "vultilion (Flickr; README credits danielbuechele)"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "Picture_0B_by_freespace.jpg": ("CC-BY-4.0", "Trevor 'Freespace'"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "Picture_1A_by_freespace.jpg": ("CC-BY-4.0", "Trevor 'Freespace'"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "Wine_by_Jakkub_Mede.jpg": ("CC-BY-4.0", "Jakub Mede"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "aitzgorri_by_Aitzol_Berasategi.jpg": ("CC-BY-4.0", "Aitzol Berasategi"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "friends_by_Aitzol_Berasategi.jpg": ("CC-BY-4.0", "Aitzol Berasategi"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "life_by_Aitzol_Berasategi.jpg": ("CC-BY-4.0", "Aitzol Berasategi"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "sunset_by_Aitzol_Berasategi.jpg": ("CC-BY-4.0", "Aitzol Berasategi"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "seeding_by_Clements_Engelhardt.jpg": ("CC0-1.0", "Clemens Engelhardt"),
    "deb:lomiri-wallpapers-16.04/" + _BG + "picosdeeuropa_by_Aitzol_Berasategi.jpg": ("CC-BY-4.0", "Aitzol Berasategi"),
}
# Added for v3 (models/README.md, "More licence-clean photographs"): each
# file's licence is stated for the file itself in the package's copyright file.
_WESATURATE = "deb:libjxl-testdata/usr/share/libjxl-testdata/external/wesaturate/500px/"
SOURCES_V3 = dict(SOURCES, **{
    "deb:sddm-theme-maldives/usr/share/sddm/themes/maldives/background.jpg":
        ("CC-BY-3.0", "Nevit Dilmen (Wikimedia Commons)"),
    _WESATURATE + "cvo9xd_keong_macan_srgb8.png": ("CC0", "Keong Macan (wesaturate.com)"),
    _WESATURATE + "tmshre_riaphotographs_srgb8.png": ("CC0", "Ria Photographs (wesaturate.com)"),
    _WESATURATE + "u76c0g_bliznaca_srgb8.png": ("CC0", "Bliznaca (wesaturate.com)"),
})
CLEAN_LICENCES = ("CC0", "CC0-1.0", "public domain", "CC-BY-2.0", "CC-BY-3.0", "CC-BY-4.0")
assert all(lic in CLEAN_LICENCES for lic, _ in SOURCES_V3.values())

# Held-out photos: whole source images never used for training (the same four
# as for v1). Each is reduced (MATLAB-style resize, then a fixed crop) to a
# small PNG that is committed, so CI scores exactly what the model card reports.
# name -> (source id, downscale target long side or None, crop (top, left, h, w))
HELD_OUT = {
    "astronaut": ("py:skimage/data/astronaut.png", None, (32, 128, 256, 256)),
    "coffee": ("py:skimage/data/coffee.png", None, (40, 96, 256, 384)),
    "seeding": ("deb:lomiri-wallpapers-16.04/" + _BG + "seeding_by_Clements_Engelhardt.jpg", 768,
                (96, 192, 256, 384)),
    "picosdeeuropa": ("deb:lomiri-wallpapers-16.04/" + _BG + "picosdeeuropa_by_Aitzol_Berasategi.jpg", 640,
                      (120, 128, 256, 384)),
}

# Wallpapers are 2-5 Mpx camera JPEGs; shrinking them removes JPEG blocking and
# camera softness so HR patches carry real detail, as in DIV2K-style data.
TRAIN_LONG_SIDE = 1200


# ---------------------------------------------------------------------------
# MATLAB imresize (bicubic, a = -0.5), written from its documented behaviour:
# when shrinking, the kernel is stretched by 1/scale (antialiasing); borders use
# symmetric (half-sample) reflection; weights are normalised per output sample.
def _cubic(x):
    ax = np.abs(x)
    ax2, ax3 = ax * ax, ax * ax * ax
    return ((1.5 * ax3 - 2.5 * ax2 + 1.0) * (ax <= 1)
            + (-0.5 * ax3 + 2.5 * ax2 - 4.0 * ax + 2.0) * ((ax > 1) & (ax <= 2)))


_WEIGHT_CACHE = {}


def resize_matrix(in_len, out_len, scale):
    """Dense (out_len, in_len) matrix M with out = M @ in along one axis."""
    key = (in_len, out_len, float(scale))
    if key in _WEIGHT_CACHE:
        return _WEIGHT_CACHE[key]
    antialias = scale < 1
    width = 4.0 / scale if antialias else 4.0
    x = np.arange(1, out_len + 1, dtype=np.float64)
    # Output sample x maps to input coordinate u (1-based, pixel centres).
    u = x / scale + 0.5 * (1.0 - 1.0 / scale)
    left = np.floor(u - width / 2.0)
    taps = int(math.ceil(width)) + 2
    idx = left[:, None] + np.arange(taps)[None, :]
    dist = u[:, None] - idx
    w = scale * _cubic(scale * dist) if antialias else _cubic(dist)
    w = w / w.sum(axis=1, keepdims=True)
    # Symmetric padding: index sequence 1..n, n..1 repeated.
    mirror = np.concatenate([np.arange(in_len), np.arange(in_len)[::-1]])
    src = mirror[np.mod(idx.astype(np.int64) - 1, 2 * in_len)]
    m = np.zeros((out_len, in_len), dtype=np.float64)
    np.add.at(m, (np.repeat(np.arange(out_len), taps), src.ravel()), w.ravel())
    _WEIGHT_CACHE[key] = m
    return m


def imresize(img, scale=None, out_hw=None):
    """img: float64 (H, W, C). Returns float64, unrounded, unclipped."""
    h, w = img.shape[:2]
    if out_hw is None:
        out_hw = (int(math.ceil(h * scale)), int(math.ceil(w * scale)))
        sh = sw = scale
    else:
        sh, sw = out_hw[0] / h, out_hw[1] / w
    mh = resize_matrix(h, out_hw[0], sh)
    mw = resize_matrix(w, out_hw[1], sw)
    # MATLAB resizes the dimension with the smaller scale first (rows on ties).
    # tensordot goes through BLAS, which matters for multi-megapixel sources.
    rows = lambda a: np.tensordot(mh, a, axes=(1, 0))
    cols = lambda a: np.tensordot(mw, a, axes=(1, 1)).transpose(1, 0, 2)
    return cols(rows(img)) if sh <= sw else rows(cols(img))


def to_uint8(x):
    # MATLAB rounds half away from zero; values are non-negative after clipping.
    return np.floor(np.clip(x, 0.0, 255.0) + 0.5).astype(np.uint8)


# ---------------------------------------------------------------------------
def source_path(src, debroot):
    kind, rest = src.split(":", 1)
    package, rel = rest.split("/", 1)
    if kind == "deb":
        assert package in DEB_PACKAGES, src
        # Every package is extracted into the same root; the path inside it is
        # the installed path.
        return os.path.join(debroot, rel)
    if kind == "py":
        import importlib
        assert package in PY_PACKAGES, src
        return os.path.join(os.path.dirname(importlib.import_module(package).__file__), rel)
    raise ValueError(src)


def load_source(src, debroot):
    return np.asarray(Image.open(source_path(src, debroot)).convert("RGB"))


def all_sources(which="v2"):
    return list(SOURCES_V3 if which == "v3" else SOURCES)


def shrink_long_side(img, long_side):
    h, w = img.shape[:2]
    if max(h, w) <= long_side:
        return img
    s = long_side / max(h, w)
    out_hw = (int(round(h * s)), int(round(w * s)))
    return to_uint8(imresize(img.astype(np.float64), out_hw=out_hw))


def held_out_image(name, debroot):
    src, long_side, (t, l, h, w) = HELD_OUT[name]
    img = load_source(src, debroot)
    if long_side:
        img = shrink_long_side(img, long_side)
    return img[t:t + h, l:l + w]


def cmd_photos(a):
    os.makedirs(a.out, exist_ok=True)
    for name in HELD_OUT:
        img = held_out_image(name, a.debroot)
        path = os.path.join(a.out, f"{name}.png")
        Image.fromarray(img).save(path, optimize=True)
        print(path, img.shape, os.path.getsize(path), "bytes")


# ---------------------------------------------------------------------------
def build_model(img_size=64):
    from spandrel.architectures.DRCT import DRCT
    c = CONFIG
    model = DRCT(
        img_size=img_size, patch_size=1, in_chans=3, embed_dim=c["embed_dim"],
        depths=(6,) * c["groups"], num_heads=(c["num_heads"],) * c["groups"],
        window_size=c["window_size"], mlp_ratio=c["mlp_ratio"], qkv_bias=True,
        drop_path_rate=0.0, ape=False, patch_norm=True, upscale=SCALE,
        img_range=1.0, upsampler="pixelshuffle", resi_connection="1conv", gc=c["gc"],
    )
    return set_upsampler_width(model, c["embed_dim"], c.get("num_feat", 64), SCALE)


def run_padded(model, lr):
    """Official test-pipeline padding: reflect-101 bottom/right to a multiple of
    the window only when needed, forward, crop."""
    ws = CONFIG["window_size"]
    _, _, h, w = lr.shape
    ph, pw = (-h) % ws, (-w) % ws
    x = F.pad(lr, (0, pw, 0, ph), mode="reflect") if (ph or pw) else lr
    y = model(x)
    return y[..., : h * SCALE, : w * SCALE]


def y_channel(rgb01):
    return 16.0 + 65.481 * rgb01[..., 0] + 128.553 * rgb01[..., 1] + 24.966 * rgb01[..., 2]


def psnr_y(a_u8, b_u8, crop=SCALE):
    ya = y_channel(a_u8.astype(np.float64) / 255.0)
    yb = y_channel(b_u8.astype(np.float64) / 255.0)
    ya, yb = ya[crop:-crop, crop:-crop], yb[crop:-crop, crop:-crop]
    mse = np.mean((ya - yb) ** 2)
    return 10.0 * math.log10(255.0 ** 2 / mse)


def load_val(photos_dir):
    val = []
    for name in HELD_OUT:
        hr = np.asarray(Image.open(os.path.join(photos_dir, f"{name}.png")).convert("RGB"))
        h, w = hr.shape[0] // SCALE * SCALE, hr.shape[1] // SCALE * SCALE
        val.append(val_entry(name, hr[:h, :w]))
    return val


def val_entry(name, hr):
    """(name, HR, LR, bicubic Y-PSNR) for an HR image whose sides are multiples of SCALE."""
    lr = to_uint8(imresize(hr.astype(np.float64), scale=1.0 / SCALE))
    bic = to_uint8(imresize(lr.astype(np.float64), scale=float(SCALE)))
    return name, hr, lr, psnr_y(bic, hr)


@torch.no_grad()
def evaluate(model, val):
    model.eval()
    device = next(model.parameters()).device
    rows = []
    for name, hr, lr, p_bic in val:
        x = torch.from_numpy(lr).permute(2, 0, 1)[None].float().to(device) / 255.0
        y = run_padded(model, x)[0].permute(1, 2, 0).float().cpu().numpy()
        sr = to_uint8(y.astype(np.float64) * 255.0)
        rows.append((name, psnr_y(sr, hr), p_bic))
    model.train()
    return rows


# ---------------------------------------------------------------------------
def shrunk_copies(hr, scales, min_side):
    """The image at each factor of `scales` (1 = as it is; below 1 a MATLAB-style shrink),
    leaving out copies whose short side falls below `min_side`. Shrinking a photograph
    further gives ground truths with more detail per pixel, as the multi-scale ground
    truths of Real-ESRGAN's DF2K recipe (factors 0.75, 0.5, 1/3) do."""
    out = []
    h, w = hr.shape[:2]
    for s in scales:
        size = (int(round(h * s)), int(round(w * s)))
        if min(size) < min_side:
            continue
        out.append(hr if s == 1 else to_uint8(imresize(hr.astype(np.float64), out_hw=size)))
    return out


class Patches:
    """Random aligned LR/HR crops with flips and transposes, from LR images
    precomputed once per HR image (as DIV2K's bicubic LR set is). With `scales`, each
    image also contributes shrunk copies (`shrunk_copies`)."""

    def __init__(self, hrs, lr_patch, rng, scales=(1.0,)):
        self.items = []
        for hr in (c for img in hrs for c in shrunk_copies(img, scales, lr_patch * SCALE)):
            h, w = hr.shape[0] // SCALE * SCALE, hr.shape[1] // SCALE * SCALE
            hr = hr[:h, :w]
            lr = to_uint8(imresize(hr.astype(np.float64), scale=1.0 / SCALE))
            self.items.append((hr, lr))
        # Sample images in proportion to their area so every pixel is equally likely.
        areas = np.array([lr.shape[0] * lr.shape[1] for _, lr in self.items], dtype=np.float64)
        self.p = areas / areas.sum()
        self.lp = lr_patch
        self.rng = rng

    def batch(self, n):
        lrs, hrs = [], []
        lp, hp = self.lp, self.lp * SCALE
        for _ in range(n):
            hr, lr = self.items[self.rng.choice(len(self.items), p=self.p)]
            y = self.rng.integers(0, lr.shape[0] - lp + 1)
            x = self.rng.integers(0, lr.shape[1] - lp + 1)
            l = lr[y:y + lp, x:x + lp]
            h = hr[y * SCALE:y * SCALE + hp, x * SCALE:x * SCALE + hp]
            if self.rng.random() < 0.5:
                l, h = l[:, ::-1], h[:, ::-1]
            if self.rng.random() < 0.5:
                l, h = l[::-1], h[::-1]
            if self.rng.random() < 0.5:
                l, h = l.transpose(1, 0, 2), h.transpose(1, 0, 2)
            lrs.append(np.ascontiguousarray(l))
            hrs.append(np.ascontiguousarray(h))
        lt = torch.from_numpy(np.stack(lrs)).permute(0, 3, 1, 2).float() / 255.0
        ht = torch.from_numpy(np.stack(hrs)).permute(0, 3, 1, 2).float() / 255.0
        return lt, ht


def lr_at(step, total, base, warmup, floor):
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + 0.5 * (base - floor) * (1.0 + math.cos(math.pi * t))


def training_images(debroot, log, which="v2"):
    held = {HELD_OUT[k][0] for k in HELD_OUT}
    hrs = []
    for src in all_sources(which):
        if src in held:
            continue
        img = shrink_long_side(load_source(src, debroot), TRAIN_LONG_SIDE)
        log(f"train image {src} {img.shape[1]}x{img.shape[0]}")
        hrs.append((src, img))
    return hrs


def packed_images(path, log):
    """The (source id, image) pairs that `pack` wrote, in their order."""
    with np.load(path) as z:
        ids = [str(v) for v in z["ids"]]
        hrs = [(src, z[f"img{i}"]) for i, src in enumerate(ids)]
    for src, img in hrs:
        log(f"train image {src} {img.shape[1]}x{img.shape[0]} (from {path})")
    return hrs


def cmd_pack(a):
    if a.held_out_photos:
        hrs = [(f"held-out:{name}", hr) for name, hr, _, _ in load_val(a.held_out_photos)]
    else:
        hrs = training_images(a.debroot, print, a.sources)
    arrays = {f"img{i}": img for i, (_, img) in enumerate(hrs)}
    np.savez_compressed(a.out, ids=np.array([src for src, _ in hrs]), **arrays)
    print(f"{a.out}: {len(hrs)} images, {os.path.getsize(a.out)} bytes")


def load_without_masks(model, state):
    """Loads weights, keeping the model's own shift masks (they depend on the patch size)."""
    state = {k: v for k, v in state.items() if not k.endswith("attn_mask")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("attn_mask") for k in missing):
        raise SystemExit(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


def grow_from(model, path):
    """Copies every tensor of `path` whose name and shape match `model`. Groups that the file
    lacks start as the identity: a group returns 0.2 * adjust5(...) + x, so a zero adjust5
    passes its input through and the grown model computes what the file's body did.
    Returns the names of the parameters the file did not provide."""
    from safetensors.torch import load_file
    src = load_file(path)
    own = dict(model.named_parameters())
    new = []
    with torch.no_grad():
        for name, p in own.items():
            if name in src and src[name].shape == p.shape:
                p.copy_(src[name])
            else:
                new.append(name)
                if ".adjust5." in name:
                    p.zero_()
    return new


def cmd_train(a):
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    if a.config:
        CONFIG.update(json.loads(a.config))
    os.makedirs(a.workdir, exist_ok=True)
    logf = open(os.path.join(a.workdir, "train.log"), "a")

    def log(msg):
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    model = build_model(img_size=a.patch).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"config {json.dumps(CONFIG)} params {n_params} threads {a.threads} "
        f"ema {a.ema} seed {a.seed} steps {a.steps} lr {a.lr} warmup {a.warmup} "
        f"batch {a.batch} patch {a.patch} device {device} loss {a.loss}")
    # L1 trains faster and more stably; a short MSE stage after it aims at PSNR itself.
    loss_fn = F.mse_loss if a.loss == "mse" else F.l1_loss
    # Exponential moving average of the weights (decay a.ema, ramped up over the
    # first steps so early averages are not dominated by the random init).
    # Validation and export use the EMA weights when it is on.
    ema = copy.deepcopy(model).eval() if a.ema > 0 else None
    if ema is not None:
        for p in ema.parameters():
            p.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, betas=(0.9, 0.99))
    data_rng = np.random.default_rng(a.seed)
    if a.images:
        hrs = packed_images(a.images, log)
    else:
        hrs = training_images(a.debroot, log, a.sources)
    data = Patches([img for _, img in hrs], a.patch, data_rng, a.scales)
    if a.scales != [1.0]:
        log(f"scales {a.scales}: {len(data.items)} ground-truth images")
    val = load_val(a.photos)
    for name, _, _, p_bic in val:
        log(f"val {name} bicubic {p_bic:.3f}")

    step, best, elapsed, total = 0, -1.0, 0.0, a.steps
    last = os.path.join(a.workdir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, weights_only=False, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        if ema is not None:
            ema.load_state_dict(ck.get("ema", ck["model"]))
        step, best, elapsed = ck["step"], ck["best"], ck["elapsed"]
        if ck.get("steps_arg") == a.steps:
            total = ck.get("total", total)  # keep a schedule fitted by --stop-by
        data.rng.bit_generator.state = ck["data_rng"]
        torch.set_rng_state(ck["torch_rng"].cpu())
        log(f"resumed at step {step}, best {best:.3f}")
    elif a.init:
        # A further stage: weights and Adam moments carry over, the step
        # counter and the LR schedule start again (a warm restart).
        # The shift masks are buffers sized by the patch, which a new stage may change.
        ck = torch.load(a.init, weights_only=False, map_location=device)
        start = ck.get("ema", ck["model"]) if a.init_weights == "ema" else ck["model"]
        load_without_masks(model, start)
        opt.load_state_dict(ck["opt"])
        if ema is not None:
            load_without_masks(ema, ck.get("ema", ck["model"]))
        log(f"initialised from {a.init} (step {ck['step']} of its stage)")
    grown = []
    if step == 0 and not a.init and a.grow_from:
        grown = grow_from(model, a.grow_from)
        if ema is not None:
            ema.load_state_dict(model.state_dict())
        log(f"grown from {a.grow_from}: {len(grown)} tensors new")
    # Some tensors train alone first (by default the ones --grow-from did not provide), so
    # that new or approximated ones do not push their first, large gradients into a trained body.
    if a.first_only:
        prefixes = tuple(a.first_only.split(","))
        first_names = {n for n, _ in model.named_parameters() if n.startswith(prefixes)}
    else:
        first_names = set(grown)
    if step >= a.first_steps:
        first_names = set()

    def save(path, extra=None):
        ck = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
              "best": best, "elapsed": elapsed, "config": CONFIG, "total": total, "steps_arg": a.steps,
              "data_rng": data.rng.bit_generator.state, "torch_rng": torch.get_rng_state()}
        if ema is not None:
            ck["ema"] = ema.state_dict()
        if extra:
            ck.update(extra)
        torch.save(ck, path + ".tmp")
        os.replace(path + ".tmp", path)

    stop_by = None
    if a.stop_by:
        # Wall-clock deadline (UTC HH:MM, today or, if already past, tomorrow).
        hh, mm = map(int, a.stop_by.split(":"))
        now = time.time()
        stop_by = now - now % 86400 + hh * 3600 + mm * 60
        if stop_by < now:
            stop_by += 86400
        log(f"stop by {time.strftime('%H:%M:%S', time.gmtime(stop_by))} UTC")
    recent = []  # (wall time, step) pairs for the step-time estimate

    model.train()
    t0, run_loss = time.time(), 0.0
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, a.lr, a.warmup, a.lr_floor)
        if first_names:
            first = step < a.first_steps
            for n, p in model.named_parameters():
                p.requires_grad_(not first or n in first_names)
            if not first:
                log(f"step {step}: all tensors train from here")
                first_names = set()
        lr_b, hr_b = data.batch(a.batch)
        lr_b, hr_b = lr_b.to(device, non_blocking=True), hr_b.to(device, non_blocking=True)
        # bf16 autocast uses the CPU's AMX/AVX512-BF16 units (~2.5x faster per
        # step here) or a GPU's tensor cores; weights, optimiser state and the
        # loss stay float32.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
            out = model(lr_b)
        loss = loss_fn(out.float(), hr_b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if ema is not None:
            d = min(a.ema, (1.0 + step) / (10.0 + step))
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.mul_(d).add_(pm.detach(), alpha=1.0 - d)
        run_loss += loss.item()
        if step % a.log_every == 0:
            now = time.time()
            elapsed += now - t0
            t0 = now
            log(f"step {step} loss {run_loss / a.log_every:.5f} lr {opt.param_groups[0]['lr']:.2e} "
                f"elapsed {elapsed:.0f}s ({elapsed / step:.3f}s/step)")
            run_loss = 0.0
            recent = (recent + [(now, step)])[-20:]
            if stop_by is not None and len(recent) >= 4:
                # Fit the schedule (at most --steps) so that the cosine decay ends
                # by the deadline at the recent pace, validation included. It is
                # re-fitted as the pace changes (the machine is shared), only
                # when the change is over 0.5%, so the LR does not jitter.
                per_step = (recent[-1][0] - recent[0][0]) / (recent[-1][1] - recent[0][1])
                per_step *= 1.0 + 1.0 / a.val_every * 10  # ~10 steps' time per validation
                fit = min(a.steps, step + int((stop_by - now - a.stop_margin) / per_step))
                if abs(fit - total) > 0.005 * total:
                    total = max(step + 1, fit)
                    log(f"schedule fitted to {total} steps to end by the deadline "
                        f"({per_step:.3f}s/step recently)")
        if step % a.val_every == 0 or step == total:
            if ema is not None:
                raw = evaluate(model, val)
                log(f"val step {step} raw " + " ".join(f"{n} {p:.3f}" for n, p, _ in raw)
                    + f" mean {float(np.mean([r[1] for r in raw])):.3f}")
            rows = evaluate(ema if ema is not None else model, val)
            mean = float(np.mean([r[1] for r in rows]))
            mean_bic = float(np.mean([r[2] for r in rows]))
            log(f"val step {step} {'ema ' if ema is not None else ''}"
                + " ".join(f"{n} {p:.3f}" for n, p, _ in rows)
                + f" mean {mean:.3f} (bicubic {mean_bic:.3f}, gain {mean - mean_bic:+.3f})")
            if mean > best:
                best = mean
                save(os.path.join(a.workdir, "best.pt"), {"val": rows})
                log(f"new best {best:.3f}")
            now = time.time()
            elapsed += now - t0
            t0 = now
            save(last)
            if a.keep_every and step % a.keep_every == 0:
                save(os.path.join(a.workdir, f"step{step:06d}.pt"))
    log(f"done: {step} steps, {elapsed:.0f}s, best {best:.3f}")
    if step < a.steps:
        log(f"(the schedule was fitted from {a.steps} to {step} steps by --stop-by)")


# ---------------------------------------------------------------------------
def export_state_dict(model):
    # Buffers (relative_position_index, attn_mask) are derivable from the
    # config and are deliberately left out of the file.
    names = {n for n, _ in model.named_parameters()}
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if k in names}


def cmd_export(a):
    from safetensors.torch import save_file
    cks = [torch.load(c, weights_only=False, map_location="cpu") for c in a.ckpt]
    ck = cks[-1]
    CONFIG.update(ck.get("config", {}))
    model = build_model()
    # The checkpoint's attn_mask buffers belong to the training patch size;
    # only parameters are carried over. Several checkpoints of one stage's
    # low-LR tail can be averaged; for the committed model this scored no
    # better than the best single checkpoint, which is what was exported.
    params = {n for n, _ in model.named_parameters()}
    # Checkpoints of a run with EMA carry the averaged weights under "ema";
    # those are the validated (and exported) ones unless --raw is given.
    key = "model" if a.raw or "ema" not in ck else "ema"
    avg = {k: sum(c[key][k].double() for c in cks) / len(cks) for k in params}
    missing, _ = model.load_state_dict({k: v.float() for k, v in avg.items()}, strict=False)
    assert all(k.endswith(("relative_position_index", "attn_mask")) for k in missing), missing
    sd = export_state_dict(model)
    fresh = len(cks) > 1 or (a.raw and "ema" in ck)
    rows = evaluate(model, load_val(a.photos)) if fresh else ck.get("val", [])
    meta = {
        "format": "pt",
        "architecture": "DRCT",
        "scale": str(SCALE),
        "embed_dim": str(CONFIG["embed_dim"]),
        "groups": str(CONFIG["groups"]),
        "window_size": str(CONFIG["window_size"]),
        "num_heads": str(CONFIG["num_heads"]),
        "gc": str(CONFIG["gc"]),
        "mlp_ratio": str(CONFIG["mlp_ratio"]),
        "num_feat": str(CONFIG.get("num_feat", 64)),
        "img_range": "1.0",
        "rgb_mean": "0.4488,0.4371,0.4040",
        "train_steps": str(a.total_steps or ck["step"]),
        "averaged_checkpoints": str(len(cks)),
        "weights": "ema" if key == "ema" else "raw",
        "val_y_psnr": json.dumps({n: round(p, 3) for n, p, _ in rows}),
        "recipe": "models/train_default.py",
        "license": "see models/README.md",
    }
    save_file(sd, a.out, metadata=meta)
    digest = hashlib.sha256(open(a.out, "rb").read()).hexdigest()
    print(f"{a.out}: {len(sd)} tensors, {sum(v.numel() for v in sd.values())} params, "
          f"{os.path.getsize(a.out)} bytes, sha256 {digest}")


def config_from_weights(sd):
    """Reads the config back from a state dict, so that evaluating a file or making its
    parity fixture uses the file's shape and not what CONFIG currently says."""
    groups = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    table = sd["layers.0.swin1.attn.relative_position_bias_table"]
    return dict(
        embed_dim=sd["conv_first.weight"].shape[0],
        groups=groups,
        window_size=(math.isqrt(table.shape[0]) + 1) // 2,
        num_heads=table.shape[1],
        gc=sd["layers.0.adjust1.weight"].shape[0],
        mlp_ratio=sd["layers.0.swin1.mlp.fc1.weight"].shape[0] / sd["conv_first.weight"].shape[0],
        num_feat=sd["conv_before_upsample.0.weight"].shape[0],
    )


def load_weights(path, img_size=64):
    from safetensors.torch import load_file
    sd = load_file(path)
    CONFIG.update(config_from_weights(sd))
    model = build_model(img_size=img_size)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [k for k in missing if not (k.endswith("relative_position_index") or k.endswith("attn_mask"))]
    if bad or unexpected:
        raise SystemExit(f"weights do not match the config: missing {bad}, unexpected {unexpected}")
    return model.eval()


# ---------------------------------------------------------------------------
def _tap_sum(w, v):
    """What a 3x3 convolution with weights w (out, in, 3, 3) adds for an input that is the
    constant v[c] on channel c (away from the border)."""
    return w.sum(dim=(2, 3)) @ v


def _pixel_unshuffle_rows(w, b, r2, u, mean):
    """Rows of a convolution whose output is pixel-shuffled into channels c (r2 rows each,
    row c * r2 + s), re-expressed for the channels' principal components: new channel k
    at sub-position s is sum_c u[c, k] (row c * r2 + s - mean[c])."""
    out_c = w.shape[0] // r2
    w = w.reshape(out_c, r2, *w.shape[1:])
    b = b.reshape(out_c, r2) - mean[:, None]
    nw = torch.einsum("ck,cs...->ks...", u, w).reshape(-1, *w.shape[2:])
    nb = torch.einsum("ck,cs->ks", u, b).reshape(-1)
    return nw, nb


@torch.no_grad()
def narrow_upsampler(model, nf, lrs):
    """Returns the upsampler tensors of `model` (x4: conv, LeakyReLU, two conv + shuffle
    stages, conv) rewritten for nf channels, fitted on the activations of the LR batch `lrs`.
    After the LeakyReLU, nf channels are kept (pivoted QR) and the others are predicted from
    them by least squares, folded into the next convolution; the two shuffled maps feed the
    next convolution linearly, so each is replaced by its nf leading principal components.
    Fine-tuning starts from there instead of from a random upsampler."""
    from scipy.linalg import qr
    acts = {}
    hooks = [model.conv_before_upsample.register_forward_hook(lambda m, i, o: acts.__setitem__("a0", o)),
             model.upsample[1].register_forward_hook(lambda m, i, o: acts.__setitem__("a1", o)),
             model.upsample[3].register_forward_hook(lambda m, i, o: acts.__setitem__("a2", o))]
    model.eval()
    model(lrs)
    for h in hooks:
        h.remove()
    flat = {k: v.double().permute(1, 0, 2, 3).reshape(v.shape[1], -1) for k, v in acts.items()}
    sd = {k: v.double() for k, v in model.state_dict().items()}
    w0, b0 = sd["conv_before_upsample.0.weight"], sd["conv_before_upsample.0.bias"]
    w1, b1 = sd["upsample.0.weight"], sd["upsample.0.bias"]
    w2, b2 = sd["upsample.2.weight"], sd["upsample.2.bias"]
    w3, b3 = sd["conv_last.weight"], sd["conv_last.bias"]

    # Stage 0: keep nf channels of the LeakyReLU output, predict the rest from them.
    a0 = flat["a0"]
    centred = (a0 - a0.mean(1, keepdim=True)).T.numpy()
    _, _, piv = qr(centred, mode="economic", pivoting=True)
    keep, drop = sorted(piv[:nf]), sorted(piv[nf:])
    design = torch.cat([a0[keep], torch.ones(1, a0.shape[1], dtype=a0.dtype)]).T
    coef = torch.linalg.lstsq(design, a0[drop].T).solution  # (nf + 1, dropped)
    a_map, beta = coef[:nf].T, coef[nf]  # dropped ~ a_map @ kept + beta
    w0, b0 = w0[keep], b0[keep]
    b1 = b1 + _tap_sum(w1[:, drop], beta)
    w1 = w1[:, keep] + torch.einsum("ocij,ck->okij", w1[:, drop], a_map)

    # Stages 1 and 2: principal components of each shuffled map.
    def pca(x):
        mean = x.mean(1)
        cov = torch.cov(x)
        _, vecs = torch.linalg.eigh(cov)
        return vecs[:, -nf:].flip(1), mean

    u1, m1 = pca(flat["a1"])
    w1, b1 = _pixel_unshuffle_rows(w1, b1, 4, u1, m1)
    b2 = b2 + _tap_sum(w2, m1)
    w2 = torch.einsum("ocij,ck->okij", w2, u1)
    u2, m2 = pca(flat["a2"])
    w2, b2 = _pixel_unshuffle_rows(w2, b2, 4, u2, m2)
    b3 = b3 + _tap_sum(w3, m2)
    w3 = torch.einsum("ocij,ck->okij", w3, u2)
    out = {"conv_before_upsample.0.weight": w0, "conv_before_upsample.0.bias": b0,
           "upsample.0.weight": w1, "upsample.0.bias": b1, "upsample.2.weight": w2,
           "upsample.2.bias": b2, "conv_last.weight": w3, "conv_last.bias": b3}
    return {k: v.float().contiguous() for k, v in out.items()}


def cmd_narrow(a):
    """Writes a copy of a model whose x4 upsampler has fewer channels (narrow_upsampler)."""
    from safetensors.torch import save_file
    torch.set_num_threads(a.threads)
    model = load_weights(a.weights)
    if CONFIG["num_feat"] <= a.num_feat:
        # Already that narrow (the embedded model since v4): the start is the model itself.
        shutil.copyfile(a.weights, a.out)
        print(f"{a.out}: {a.weights} already has a {CONFIG['num_feat']}-channel upsampler; copied")
        return
    hrs = packed_images(a.images, print)
    data = Patches([img for _, img in hrs], a.patch, np.random.default_rng(a.seed))
    lrs, _ = data.batch(a.samples)
    sd = export_state_dict(model)
    sd.update(narrow_upsampler(model, a.num_feat, lrs))
    save_file(sd, a.out, metadata={"format": "pt", "architecture": "DRCT", "scale": str(SCALE),
                                   "narrowed_from": os.path.basename(a.weights),
                                   "num_feat": str(a.num_feat), "recipe": "models/train_default.py"})
    rows = evaluate(load_weights(a.out), load_val(a.photos))
    for n, p, b in rows:
        print(f"{n:16s} model {p:.3f} dB  bicubic {b:.3f} dB  gain {p - b:+.3f}")
    print(f"{a.out}: upsampler narrowed to {a.num_feat} channels, mean gain "
          f"{np.mean([r[1] - r[2] for r in rows]):+.3f} dB")


def train_crops(path, side=256, seed=0):
    """One random crop per training image, as validation entries: how well a model fits
    its own training data, beside the held-out photos."""
    rng = np.random.default_rng(seed)
    val = []
    for src, img in packed_images(path, lambda _: None):
        if img.ndim == 2:
            img = np.stack([img] * 3, -1)
        ch, cw = min(side, img.shape[0] // SCALE * SCALE), min(side, img.shape[1] // SCALE * SCALE)
        y, x = rng.integers(0, img.shape[0] - ch + 1), rng.integers(0, img.shape[1] - cw + 1)
        val.append(val_entry(src.rsplit("/", 1)[-1], img[y:y + ch, x:x + cw]))
    return val


def cmd_eval(a):
    torch.set_num_threads(a.threads)
    model = load_weights(a.weights)
    rows = evaluate(model, train_crops(a.train_crops) if a.train_crops else load_val(a.photos))
    for n, p, b in rows:
        print(f"{n[:36]:36s} model {p:.3f} dB  bicubic {b:.3f} dB  gain {p - b:+.3f}")
    m, mb = np.mean([r[1] for r in rows]), np.mean([r[2] for r in rows])
    print(f"{'mean':16s} model {m:.3f} dB  bicubic {mb:.3f} dB  gain {m - mb:+.3f}")


def cmd_bench(a):
    """Times training steps for the current CONFIG (used to pick it)."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build_model(img_size=a.patch).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    lr_b = torch.rand(a.batch, 3, a.patch, a.patch)
    hr_b = torch.rand(a.batch, 3, a.patch * SCALE, a.patch * SCALE)
    times = []
    for i in range(a.steps):
        t = time.time()
        loss = F.l1_loss(model(lr_b), hr_b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.time() - t)
    print(f"params {sum(p.numel() for p in model.parameters())} "
          f"step {np.median(times[1:]):.3f}s (batch {a.batch}, LR patch {a.patch})")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("photos")
    s.add_argument("--debroot", required=True)
    s.add_argument("--out", default="tests/photos")
    s = sub.add_parser("pack")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--debroot")
    src.add_argument("--held-out-photos", help="pack these held-out photos instead (ceiling runs only)")
    s.add_argument("--out", required=True)
    s.add_argument("--sources", choices=("v2", "v3"), default="v2")
    s = sub.add_parser("train")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--debroot")
    src.add_argument("--images", help="training images written by `pack`")
    s.add_argument("--sources", choices=("v2", "v3"), default="v2",
                   help="with --debroot: v3 adds the photos surveyed after v2")
    s.add_argument("--device", default="cpu", help="cpu, or cuda")
    s.add_argument("--photos", default="tests/photos")
    s.add_argument("--workdir", required=True)
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--patch", type=int, default=32, help="LR patch side (multiple of the window)")
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--lr-floor", type=float, default=1e-5)
    s.add_argument("--warmup", type=int, default=100)
    s.add_argument("--val-every", type=int, default=250)
    s.add_argument("--log-every", type=int, default=25)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-bf16", dest="bf16", action="store_false")
    s.add_argument("--keep-every", type=int, default=0,
                   help="also keep stepNNNNNN.pt every this many steps (for checkpoint averaging)")
    s.add_argument("--init", default=None, help="start a new stage from this checkpoint (last.pt of the previous stage)")
    s.add_argument("--init-weights", choices=("raw", "ema"), default="raw",
                   help="which of --init's weights the trained model starts from (the EMA copy starts from its EMA either way)")
    s.add_argument("--loss", choices=("l1", "mse"), default="l1")
    s.add_argument("--scales", type=lambda v: [float(x) for x in v.split(",")], default=[1.0],
                   help="comma-separated factors (1 = as packed) at which every training image "
                        "is used, e.g. 1,0.75,0.5; copies too small for a patch are left out")
    s.add_argument("--grow-from", default=None,
                   help="start from the tensors of this .safetensors model that fit (a model with fewer "
                        "groups or another upsampler); added groups start as the identity")
    s.add_argument("--first-steps", type=int, default=0,
                   help="with --grow-from: train only some tensors for this many steps (--first-only)")
    s.add_argument("--first-only", default=None,
                   help="comma-separated name prefixes of the tensors --first-steps trains "
                        "(default: those --grow-from did not provide)")
    s.add_argument("--config", default=None, help="JSON overrides of CONFIG (for config search)")
    s.add_argument("--ema", type=float, default=0.999,
                   help="EMA decay of the weights that are validated and exported (0: off)")
    s.add_argument("--stop-by", default=None,
                   help="UTC HH:MM: fit the cosine schedule (at most --steps) so the run ends by then")
    s.add_argument("--stop-margin", type=float, default=120.0,
                   help="seconds kept free before --stop-by")
    s = sub.add_parser("export")
    s.add_argument("--ckpt", required=True, nargs="+", help="one checkpoint, or several to average")
    s.add_argument("--photos", default="tests/photos")
    s.add_argument("--out", default="models/default_x4.safetensors")
    s.add_argument("--raw", action="store_true", help="export the raw weights, not the EMA")
    s.add_argument("--total-steps", type=int, default=None,
                   help="steps over all stages, for the metadata (default: the checkpoint's stage)")
    s = sub.add_parser("eval")
    s.add_argument("--weights", default="models/default_x4.safetensors")
    s.add_argument("--photos", default="tests/photos")
    s.add_argument("--train-crops", default=None,
                   help="score one 256x256 crop of each image in this pack instead of the photos")
    s.add_argument("--threads", type=int, default=1)
    s = sub.add_parser("narrow", help="rewrite a model's upsampler for fewer channels")
    s.add_argument("--weights", required=True)
    s.add_argument("--images", required=True, help="training images written by `pack`")
    s.add_argument("--photos", default="tests/photos")
    s.add_argument("--out", required=True)
    s.add_argument("--num-feat", type=int, default=32)
    s.add_argument("--samples", type=int, default=64, help="LR patches the fit sees")
    s.add_argument("--patch", type=int, default=48)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=1)
    s = sub.add_parser("bench")
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--patch", type=int, default=32)
    s.add_argument("--steps", type=int, default=6)
    s.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    {"photos": cmd_photos, "pack": cmd_pack, "train": cmd_train, "export": cmd_export,
     "eval": cmd_eval, "bench": cmd_bench, "narrow": cmd_narrow}[a.cmd](a)


if __name__ == "__main__":
    main()
