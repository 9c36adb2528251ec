#!/usr/bin/env python3
"""The optimised PyTorch DRCT pipeline, as a GPU baseline for side-by-sides.

  python benches/torch_gpu_reference.py --preset drct --height 512 --width 512 \
      --tile 256 --overlap 32 --tile-batch 4 --reps 5
  python benches/torch_gpu_reference.py --device cpu --preset tiny      # smoke test
  python benches/torch_gpu_reference.py --preset drct-l --height 540 --width 960 --compile

With --compile, after the eager timing (printed as without it) the same model is run through
torch.compile (default mode, dynamic=False) on the same image: the first, compiling call is
timed on its own (first_call_s), then the reps; its summary line (impl "compile-default")
carries the peak memory and the largest difference from the eager output (max_abs_vs_eager).

What it does, beyond stock spandrel:
- window attention through F.scaled_dot_product_attention (relative-position bias plus the
  shift mask passed as attn_mask, scale kept at head_dim**-0.5); on CUDA the head dims are
  zero-padded to a multiple of 8 by default (exact, because the scale is not recomputed) so
  DRCT's odd head dims (53, 77, 122 ...) can use the fused kernels;
- shift masks built once per size on the device instead of on the CPU in every block;
- bf16 weights and activations (spandrel/chaiNNer mark DRCT unsafe in fp16), channels_last;
- the image cut into equal tiles (multiples of the window; the last tile of a row/column is
  moved back flush with the border), run tile-batch at a time, pasted back with each tile
  owning the half of every overlap nearest to it (no blending, no border taper).
spandrel's WindowAttention instances get a new forward; spandrel itself is not modified.
Before timing, the SDPA attention is checked against spandrel's own on a small input.
"""

import argparse
import copy
import json
import math
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_drct import PRESETS, build_model, load_weights  # noqa: E402

from spandrel.architectures.DRCT.__arch.drct_arch import (  # noqa: E402
    SwinTransformerBlock,
    WindowAttention,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------------------
# attention through SDPA
# --------------------------------------------------------------------------------------
def _rel_bias(attn, dtype):
    """(heads, N, N) relative-position bias; weights are frozen, so built once per dtype."""
    cache = attn.__dict__.setdefault("_sdpa_bias", {})
    if dtype not in cache:
        n = attn.window_size[0] * attn.window_size[1]
        idx = attn.relative_position_index.reshape(-1)
        b = attn.relative_position_bias_table[idx].reshape(n, n, -1).permute(2, 0, 1)
        cache[dtype] = b.to(dtype).contiguous()
    return cache[dtype]


def sdpa_window_attention(self, x, mask=None):
    b_, n, c = x.shape
    nh = self.num_heads
    hd = c // nh
    qkv = self.qkv(x).view(b_, n, 3, nh, hd).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]  # (windows, heads, N, hd)
    bias = _rel_bias(self, x.dtype)
    if mask is None or self._sdpa_drop_mask:
        attn_mask = bias.unsqueeze(0)  # broadcast over windows
    else:
        # Fold windows into the head axis so one (nW*heads, N, N) mask broadcasts over the
        # images of the batch without being copied per image.
        nw = mask.shape[0]
        b = b_ // nw
        q, k, v = (t.reshape(b, nw * nh, n, hd) for t in (q, k, v))
        attn_mask = (bias.unsqueeze(0) + mask.to(x.dtype).unsqueeze(1)).reshape(1, nw * nh, n, n)
    pad = (-hd) % self._sdpa_head_multiple if self._sdpa_head_multiple > 1 else 0
    if pad:
        # zero columns add nothing to q.k and give zero output columns; the scale below is
        # still the unpadded head_dim**-0.5
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)
    if pad:
        out = out[..., :hd]
    out = out.reshape(b_, nh, n, hd).transpose(1, 2).reshape(b_, n, c)
    return self.proj(out)


def patch_model(model, head_multiple=1, sdpa=True):
    """Route every WindowAttention through SDPA (unless sdpa=False) and cache shift masks per
    input size, in the model's dtype: stock spandrel 0.4.2 builds them in float32, which
    makes a bf16 model fail (float attn @ bf16 v) at any size but the training size."""
    n_attn = 0
    for m in model.modules():
        if sdpa and isinstance(m, WindowAttention):
            m._sdpa_head_multiple = head_multiple
            m.forward = types.MethodType(sdpa_window_attention, m)
            n_attn += 1
    # spandrel (like the official code) calls calculate_mask in EVERY block whenever the input
    # size differs from the training size, unshifted blocks included, where it yields an
    # all-zero mask; SDPA blocks drop that mask, and every mask is built once per size.
    masks = {}
    for m in model.modules():
        if isinstance(m, SwinTransformerBlock):
            m.attn._sdpa_drop_mask = m.shift_size == 0
            orig = m.calculate_mask

            def cached(x_size, _orig=orig, _blk=m):
                ref = _blk.norm1.weight  # follows model.to(device/dtype)
                key = (tuple(x_size), _blk.window_size, _blk.shift_size, ref.device, ref.dtype)
                if key not in masks:
                    masks[key] = _orig(x_size).to(ref.device, ref.dtype)
                return masks[key]

            m.calculate_mask = cached
    return n_attn


# --------------------------------------------------------------------------------------
# tiling
# --------------------------------------------------------------------------------------
def axis_plan(length, tile, overlap):
    """Tile starts along one axis and the [lo, hi) each tile owns in the result."""
    if length <= tile:
        return [(0, 0, length)]
    stride = tile - overlap
    starts = list(range(0, length - tile, stride)) + [length - tile]
    plan = []
    for i, s in enumerate(starts):
        lo = 0 if i == 0 else (s + starts[i - 1] + tile) // 2
        hi = length if i == len(starts) - 1 else (starts[i + 1] + s + tile) // 2
        plan.append((s, lo, hi))
    return plan


def upscale_tiled(model, img, scale, window, tile, overlap, tile_batch, dtype, channels_last):
    """img: (1, 3, H, W) float32 on the device -> (1, 3, H*s, W*s) float32."""
    _, c, h, w = img.shape
    th = min(tile, -(-h // window) * window)
    tw = min(tile, -(-w // window) * window)
    ph, pw = max(0, th - h), max(0, tw - w)
    x = F.pad(img, (0, pw, 0, ph), mode="reflect") if (ph or pw) else img
    hh, ww = x.shape[-2:]
    ys, xs = axis_plan(hh, th, overlap), axis_plan(ww, tw, overlap)
    jobs = [(y, xx) for y in ys for xx in xs]
    out = torch.empty((1, c, hh * scale, ww * scale), dtype=torch.float32, device=img.device)
    xin = x.to(dtype)
    for i in range(0, len(jobs), tile_batch):
        chunk = jobs[i : i + tile_batch]
        batch = torch.cat([xin[:, :, y[0] : y[0] + th, xx[0] : xx[0] + tw] for y, xx in chunk])
        if channels_last:
            batch = batch.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            res = model(batch)
        for j, ((y0, ylo, yhi), (x0, xlo, xhi)) in enumerate(chunk):
            out[:, :, ylo * scale : yhi * scale, xlo * scale : xhi * scale] = res[
                j : j + 1, :, (ylo - y0) * scale : (yhi - y0) * scale,
                (xlo - x0) * scale : (xhi - x0) * scale].float()
    return out[:, :, : h * scale, : w * scale], len(jobs)


def whole(model, img, scale, window):
    h, w = img.shape[-2:]
    ph, pw = (window - h % window) % window, (window - w % window) % window
    x = F.pad(img, (0, pw, 0, ph), mode="reflect") if (ph or pw) else img
    with torch.inference_mode():
        return model(x)[:, :, : h * scale, : w * scale]


# --------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------
def check_attention(base_fp32, device, window, scale, head_multiple, seed, dtype):
    """SDPA attention vs spandrel's own, in float32: one shifted block's attention on random
    tokens, then the whole model on a small image (masked and unmasked blocks, sizes that
    differ from the training size so calculate_mask is used)."""
    ref = base_fp32
    pat = copy.deepcopy(base_fp32)
    patch_model(pat, head_multiple)
    g = torch.Generator().manual_seed(seed + 2)

    blk_ref = next(m for m in ref.modules() if isinstance(m, SwinTransformerBlock) and m.shift_size > 0)
    blk_pat = next(m for m in pat.modules() if isinstance(m, SwinTransformerBlock) and m.shift_size > 0)
    hw = (2 * window, 3 * window)
    mask = blk_ref.calculate_mask(hw).to(device)
    n = window * window
    tokens = torch.randn((2 * mask.shape[0], n, blk_ref.dim), generator=g).to(device)
    with torch.inference_mode():
        a = blk_ref.attn(tokens, mask)
        b = blk_pat.attn(tokens, mask)
        a0 = blk_ref.attn(tokens, None)
        b0 = blk_pat.attn(tokens, None)
    attn_dev = max(float((a - b).abs().max()), float((a0 - b0).abs().max()))

    img = torch.rand((1, 3, 2 * window + 3, 3 * window + 5), generator=g).to(device)
    y_ref = whole(ref, img, scale, window)
    y_pat = whole(pat, img, scale, window)
    model_dev = float((y_ref - y_pat).abs().max())
    # what the run dtype costs on the same image (SDPA model in dtype vs spandrel in fp32)
    low = copy.deepcopy(pat).to(dtype)
    low_dev = float((whole(low, img.to(dtype), scale, window).float() - y_ref).abs().max())
    del low

    # The tiler on its own: with a pointwise "model" (nearest upscaling) tiling must be
    # exact. (Tiled-vs-whole PSNR of a random-weight DRCT says little: untrained attention
    # is far less local than a trained model's.)
    near = lambda t: F.interpolate(t, scale_factor=scale, mode="nearest")
    big = torch.rand((1, 3, 5 * window + 3, 4 * window + 1), generator=g).to(device)
    y_tiled, nt = upscale_tiled(near, big, scale, window, 2 * window, window // 2 + 1, 3, torch.float32, False)
    tiler_dev = float((y_tiled - near(big)).abs().max())
    return dict(attn_max_abs_fp32=attn_dev, model_max_abs_fp32=model_dev,
                run_dtype_vs_fp32_max_abs=low_dev,
                tiler_max_abs=tiler_dev, check_tiles=nt)


# --------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="drct")
    ap.add_argument("--scale", type=int, choices=(2, 3, 4), default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", help="safetensors from torch_drct.py make-weights (default: random from --seed)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--height", type=int, help="input image height (default 512 on cuda, 3*tile-ish on cpu)")
    ap.add_argument("--width", type=int)
    ap.add_argument("--image", help="an image file to upscale instead of random noise (needs Pillow)")
    ap.add_argument("--tile", type=int, help="tile side in input pixels, a multiple of the window (default 256; cpu 2*window)")
    ap.add_argument("--overlap", type=int, help="tile overlap in input pixels (default 32; cpu window/2)")
    ap.add_argument("--tile-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (cpu device only)")
    ap.add_argument("--head-multiple", type=int,
                    help="zero-pad head dims to this multiple (default 8 on cuda, 1 elsewhere)")
    ap.add_argument("--no-sdpa", action="store_true", help="keep spandrel's attention (baseline)")
    ap.add_argument("--no-channels-last", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="after the eager run, time torch.compile(model) too (default mode, dynamic=False)")
    a = ap.parse_args()

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if not cuda:
        torch.set_num_threads(a.threads)
    p = PRESETS[a.preset]
    ws = p["window"]
    tile = a.tile or (256 if cuda else 2 * ws)
    if tile % ws:
        sys.exit(f"--tile {tile} is not a multiple of the window ({ws})")
    overlap = a.overlap if a.overlap is not None else (32 if cuda else ws // 2)
    if not 0 <= overlap < tile:
        sys.exit("--overlap must be in [0, tile)")
    head_multiple = a.head_multiple or (8 if cuda else 1)
    dtype = DTYPES[a.dtype]

    base = build_model(a.preset, a.scale, a.seed)
    if a.weights:
        load_weights(base, a.weights)
    base = base.to(dev)

    check = check_attention(base, dev, ws, a.scale, head_multiple, a.seed, dtype)
    print(json.dumps({"check": True, **check}), flush=True)

    model = copy.deepcopy(base)
    del base
    n_attn = patch_model(model, head_multiple, sdpa=not a.no_sdpa)
    model = model.to(dtype)
    if not a.no_channels_last:
        model = model.to(memory_format=torch.channels_last)

    if a.image:
        import numpy as np
        from PIL import Image

        arr = np.asarray(Image.open(a.image).convert("RGB"), dtype=np.float32) / 255.0
        img_cpu = torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(0).contiguous()
    else:
        h = a.height or (512 if cuda else 3 * tile - ws // 2 + 1)
        w = a.width or (512 if cuda else 2 * tile + ws + 3)
        img_cpu = torch.rand((1, 3, h, w), generator=torch.Generator().manual_seed(a.seed + 3))
    if cuda:
        img_cpu = img_cpu.pin_memory()

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def once(net=model):
        sync()
        t0 = time.perf_counter()
        y, nt = upscale_tiled(net, img_cpu.to(dev, non_blocking=True), a.scale, ws, tile,
                              overlap, a.tile_batch, dtype, not a.no_channels_last)
        y = y.cpu()
        sync()
        return time.perf_counter() - t0, y, nt

    times, y, nt = timed_reps(once, a.warmup, a.reps, dev if cuda else None)
    med = statistics.median(times)
    hd = sorted({m.dim // m.num_heads for m in model.modules() if isinstance(m, WindowAttention)})
    # What the run was, shared by the eager and the compiled summary lines.
    run = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "preset": a.preset,
        "scale": a.scale, "dtype": a.dtype, "channels_last": not a.no_channels_last,
        "input": list(img_cpu.shape), "tile": tile, "overlap": overlap, "tile_batch": a.tile_batch,
        "tiles": nt, "reps": a.reps,
    }
    print(json.dumps({
        "summary": True, "impl": "pytorch-spandrel-sdpa" if n_attn else "pytorch-spandrel",
        **run, "median_s_per_image": round(med, 4),
        "tiles_per_s": round(nt / med, 2),
        "peak_mem_mib": round(torch.cuda.max_memory_allocated(dev) / 2**20, 1) if cuda else None,
        "head_dims": hd, "head_multiple": head_multiple if n_attn else None,
        "finite": bool(torch.isfinite(y).all()), "torch": torch.__version__, **check,
    }), flush=True)

    if a.compile:
        run_compiled(model, once, a.reps, run, y, med, dev if cuda else None)


def timed_reps(once, warmup, reps, cuda_dev):
    """`warmup` untimed calls of once(), the device's peak memory reset, then `reps` timed ones,
    each printed as a JSON line; the times and the last call's output and tile count."""
    for _ in range(warmup):
        once()
    if cuda_dev is not None:
        torch.cuda.reset_peak_memory_stats(cuda_dev)
    times = []
    for i in range(reps):
        t, y, nt = once()
        times.append(t)
        print(json.dumps({"rep": i, "seconds": round(t, 4), "tiles_per_s": round(nt / t, 2)}), flush=True)
    return times, y, nt


def run_compiled(model, once, reps, run, y_eager, eager_med, cuda_dev):
    """torch.compile(model) on the image the eager run just did (once(net) upscales it with
    net); y_eager is the eager output, eager_med its median."""
    import torch._dynamo

    cfg = torch._dynamo.config
    # Every DRCT block of another width costs a recompile: past the default limit (8) dynamo
    # silently runs the rest eagerly, and "compiled" would time mostly eager code.
    # (recompile_limit is the newer name of cache_size_limit.)
    limit_name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, limit_name, 256)
    compiled = torch.compile(model, dynamic=False)
    nt = run["tiles"]
    # The first call compiles (a smaller last batch compiles once more): timed on its own, and
    # it is the reps' warm-up.
    first, y, _ = once(compiled)
    print(json.dumps({"impl": "compile-default", "first_call_s": round(first, 2)}), flush=True)
    if cuda_dev is not None:
        torch.cuda.reset_peak_memory_stats(cuda_dev)
    times = []
    for i in range(reps):
        t, y, _ = once(compiled)
        times.append(t)
        print(json.dumps({"impl": "compile-default", "rep": i, "seconds": round(t, 4),
                          "tiles_per_s": round(nt / t, 2)}), flush=True)
    med = statistics.median(times)
    print(json.dumps({
        "summary": True, "impl": "compile-default", **run, "median_s_per_image": round(med, 4),
        "times": [round(t, 4) for t in times], "tiles_per_s": round(nt / med, 2),
        "first_call_s": round(first, 2),
        "peak_mem_mib": round(torch.cuda.max_memory_allocated(cuda_dev) / 2**20, 1)
        if cuda_dev is not None else None,
        "eager_median_s_per_image": round(eager_med, 4), "eager_over_compiled": round(eager_med / med, 3),
        "max_abs_vs_eager": float((y - y_eager).abs().max()),
        "finite": bool(torch.isfinite(y).all()), "torch": torch.__version__,
        "mode": "default", "dynamic": False, limit_name: 256,
    }), flush=True)


if __name__ == "__main__":
    main()
