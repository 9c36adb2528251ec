#!/usr/bin/env python3
"""SwinIR, Swin2SR, HAT, ESRGAN, Real-ESRGAN Compact, SPAN, DAT, PLKSR, RealPLKSR and OmniSR in PyTorch (spandrel's modules, which match the
official code), tiled as `upscale` tiles, for the GPU side by side: eager, then
`torch.compile` with --compile, the same JSON lines as benches/torch_gpu_reference.py prints
for DRCT.

  python benches/torch_swin_reference.py make-weights OUT.safetensors --preset swinir-m
  python benches/torch_swin_reference.py time --preset hat-l --weights OUT.safetensors \
      --height 540 --width 960 --tile 256 --overlap 32 --tile-batch 4 --compile
  python benches/torch_swin_reference.py time --device cpu --preset swinir-tiny   # smoke
  python benches/torch_swin_reference.py make-weights OUT.safetensors --preset esrgan

Random weights of the released shapes (seeded), saved as parameters only, so that `upscale`
and PyTorch run the same network. Attention stays spandrel's own (no SDPA patch), as a user
running these models today gets it.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_gpu_reference import run_compiled, timed_reps, upscale_tiled  # noqa: E402

# The released shapes (x4, classical pixel-shuffle upsampler, one residual convolution), and
# tiny ones for the CPU smoke run.
PRESETS = {
    "swinir-m": dict(arch="swinir", embed_dim=180, depths=[6] * 6, num_heads=[6] * 6, window_size=8),
    "hat-l": dict(arch="hat", embed_dim=180, depths=[6] * 12, num_heads=[6] * 12, window_size=16),
    "swinir-tiny": dict(arch="swinir", embed_dim=24, depths=[2], num_heads=[2], window_size=8),
    # Swin2SR as Swin2SR_ClassicalSR_X4_64 (SwinIR-M's shape with SwinV2 blocks).
    "swin2sr": dict(arch="swin2sr", embed_dim=180, depths=[6] * 6, num_heads=[6] * 6, window_size=8),
    "swin2sr-tiny": dict(arch="swin2sr", embed_dim=24, depths=[2], num_heads=[2], window_size=8),
    "hat-tiny": dict(arch="hat", embed_dim=60, depths=[2], num_heads=[2], window_size=8),
    # The convolutional families (no window: window_size 1 pads nothing). ESRGAN as
    # RealESRGAN_x4plus and 4x-UltraSharp are (64 filters, 23 blocks); Compact as
    # realesr-general-x4v3 is (64 features, 32 convolutions, PReLU).
    "esrgan": dict(arch="esrgan", num_filters=64, num_blocks=23, window_size=1),
    "compact": dict(arch="compact", num_feat=64, num_conv=32, window_size=1),
    # SPAN as 4xNomos8k_span_otf_strong (48 features); DAT as DAT_x4 (embed 180, 6 groups of
    # 6 blocks, 6 heads, 8x32 windows). DAT pads inside its spatial blocks: no window here.
    "span": dict(arch="span", feature_channels=48, window_size=1),
    "dat": dict(arch="dat", embed_dim=180, depth=[6] * 6, num_heads=[6] * 6, split_size=[8, 32],
                window_size=1),
    "esrgan-tiny": dict(arch="esrgan", num_filters=8, num_blocks=1, window_size=1),
    "span-tiny": dict(arch="span", feature_channels=8, window_size=1),
    "dat-tiny": dict(arch="dat", embed_dim=32, depth=[2], num_heads=[2], split_size=[4, 8],
                     window_size=1),
    "compact-tiny": dict(arch="compact", num_feat=8, num_conv=2, window_size=1),
    # RealPLKSR as the released GroupNorm models (64 features, 28 blocks, 17x17 on 16).
    "realplksr": dict(arch="realplksr", dim=64, n_blocks=28, window_size=1),
    "realplksr-tiny": dict(arch="realplksr", dim=16, n_blocks=2, window_size=1),
    # The original PLKSR (no norms), its DCCM mixer, the same widths.
    "plksr": dict(arch="plksr", dim=64, n_blocks=28, window_size=1),
    "plksr-tiny": dict(arch="plksr", dim=16, n_blocks=2, window_size=1),
    # OmniSR as the released models (64 features, 5 groups of 1 block, window 8); it pads
    # its input itself (zeros, to a multiple of the window).
    "omnisr": dict(arch="omnisr", num_feat=64, res_num=5, window_size=1),
    "omnisr-tiny": dict(arch="omnisr", num_feat=16, res_num=1, window_size=1),
    # Real-CUGAN x4 (UpCunet4x): its widths are fixed, so it has no tiny form. It pads its
    # input itself (reflect, 19 a side and to a multiple of 2).
    "realcugan": dict(arch="realcugan", window_size=1),
    # RCAN as the authors' models (64 features, 10 groups of 20 blocks, the mean shift); it
    # pads nothing at x4.
    "rcan": dict(arch="rcan", n_feats=64, n_resgroups=10, n_resblocks=20, window_size=1),
    "rcan-tiny": dict(arch="rcan", n_feats=16, n_resgroups=1, n_resblocks=2, window_size=1),
    # MoSR as its defaults (64 features, 24 GatedCNN blocks, 7x7 depthwise, PixelShuffle).
    "mosr": dict(arch="mosr", dim=64, n_block=24, window_size=1),
    "mosr-tiny": dict(arch="mosr", dim=16, n_block=2, window_size=1),
    # FDAT "medium" (embed 120, 4 groups of 3 pairs of blocks, 4 heads, window 8) with its
    # default transpose+conv upsampler; it pads its windows itself (zero tokens).
    "fdat": dict(arch="fdat", embed_dim=120, num_groups=4, depth_per_group=3, num_heads=4,
                 window_size=1),
    "fdat-tiny": dict(arch="fdat", embed_dim=16, num_groups=1, depth_per_group=1, num_heads=2,
                      window_size=1),
    # SAFMN as the authors' models (dim 36, 8 blocks); its multi-scale pooling wants a
    # multiple of 8, which the tiles are.
    "safmn": dict(arch="safmn", dim=36, n_blocks=8, window_size=8),
    "safmn-tiny": dict(arch="safmn", dim=8, n_blocks=1, window_size=8),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(preset, seed):
    p = dict(PRESETS[preset])
    arch = p.pop("arch")
    torch.manual_seed(seed)
    if arch == "esrgan":
        from spandrel.architectures.ESRGAN import ESRGAN
        return ESRGAN(in_nc=3, out_nc=3, num_filters=p["num_filters"], num_blocks=p["num_blocks"],
                      scale=4).eval()
    if arch == "compact":
        from spandrel.architectures.Compact import Compact
        return Compact(num_in_ch=3, num_out_ch=3, num_feat=p["num_feat"], num_conv=p["num_conv"],
                       upscale=4).eval()
    if arch == "span":
        from spandrel.architectures.SPAN import SPAN
        return SPAN(num_in_ch=3, num_out_ch=3, feature_channels=p["feature_channels"],
                    upscale=4).eval()
    if arch == "realplksr":
        from spandrel.architectures.PLKSR import RealPLKSR
        return RealPLKSR(dim=p["dim"], n_blocks=p["n_blocks"], upscaling_factor=4).eval()
    if arch == "plksr":
        from spandrel.architectures.PLKSR import PLKSR
        return PLKSR(dim=p["dim"], n_blocks=p["n_blocks"], upscaling_factor=4,
                     ccm_type="DCCM").eval()
    if arch == "omnisr":
        from spandrel.architectures.OmniSR import OmniSR
        return OmniSR(num_feat=p["num_feat"], res_num=p["res_num"], block_num=1, window_size=8,
                      pe=True, up_scale=4).eval()
    if arch == "realcugan":
        from spandrel.architectures.RealCUGAN import UpCunet4x
        return UpCunet4x(in_channels=3, out_channels=3).eval()
    if arch == "mosr":
        from spandrel.architectures.MoSR import MoSR
        return MoSR(upscale=4, dim=p["dim"], n_block=p["n_block"]).eval()
    if arch == "safmn":
        from spandrel.architectures.SAFMN import SAFMN
        return SAFMN(dim=p["dim"], n_blocks=p["n_blocks"], upscaling_factor=4).eval()
    if arch == "fdat":
        from spandrel.architectures.FDAT import FDAT
        return FDAT(scale=4, embed_dim=p["embed_dim"], num_groups=p["num_groups"],
                    depth_per_group=p["depth_per_group"], num_heads=p["num_heads"],
                    window_size=8).eval()
    if arch == "rcan":
        from spandrel.architectures.RCAN import RCAN
        return RCAN(scale=4, n_feats=p["n_feats"], n_resgroups=p["n_resgroups"],
                    n_resblocks=p["n_resblocks"], reduction=min(16, p["n_feats"] // 4)).eval()
    if arch == "dat":
        from spandrel.architectures.DAT import DAT
        return DAT(upscale=4, in_chans=3, img_size=64, img_range=1.0, depth=p["depth"],
                   embed_dim=p["embed_dim"], num_heads=p["num_heads"], expansion_factor=4,
                   resi_connection="1conv", split_size=p["split_size"],
                   upsampler="pixelshuffle").eval()
    common = dict(img_size=64, patch_size=1, in_chans=3, mlp_ratio=2.0, upscale=4,
                  img_range=1.0, upsampler="pixelshuffle", resi_connection="1conv", **p)
    if arch == "swin2sr":
        from spandrel.architectures.Swin2SR import Swin2SR
        return Swin2SR(**common).eval()
    if arch == "hat":
        from spandrel.architectures.HAT import HAT
        return HAT(compress_ratio=3, squeeze_factor=30, conv_scale=0.01, overlap_ratio=0.5,
                   **common).eval()
    from spandrel.architectures.SwinIR import SwinIR
    return SwinIR(**common).eval()


def cache_masks(model, dev, dtype):
    """Every shift mask built once per tile size, on the model's device and in its dtype.

    SwinIR, HAT and DAT build the masks of a size other than img_size on the CPU in every
    forward (SwinIR in f32, which `attn + mask` then promotes, and the bf16 `attn @ v`
    refuses). The eager run fills the cache, so torch.compile traces a lookup instead of CPU
    work: traced, that work became a C++ kernel that the GPU machine's compiler refused."""
    for m in model.modules():
        if not hasattr(m, "calculate_mask"):
            continue
        memo = {}

        def cached(*args, _f=m.calculate_mask, _memo=memo, **kw):
            key = (tuple(args), tuple(sorted(kw.items())))
            if key not in _memo:
                r = _f(*args, **kw)
                move = lambda t: t.to(dev, dtype)  # noqa: E731
                _memo[key] = tuple(map(move, r)) if isinstance(r, (tuple, list)) else move(r)
            return _memo[key]

        m.calculate_mask = cached


def fold_once(model):
    """SPAN's eval mode folds its three-branch convolutions again in every forward, assigning
    the folded weights to `.data`: compiled, that assignment left a weight in another memory
    layout than the graph was traced with (a stride assertion on the GPU). For torch.compile
    the folds are made once (by the eager run) and kept, which is also the faster PyTorch.
    Returns whether the model had any."""
    folded = False
    for m in model.modules():
        if hasattr(m, "update_params") and hasattr(m, "eval_conv"):
            m.update_params = lambda: None
            m.eval_conv.weight.data = m.eval_conv.weight.data.contiguous()
            m.eval_conv.bias.data = m.eval_conv.bias.data.contiguous()
            folded = True
    return folded


def cmd_make_weights(a):
    from safetensors.torch import save_file
    model = build_model(a.preset, a.seed)
    # Parameters only for SwinIR and HAT (their index buffers are rebuilt by both programs);
    # the whole state dict for the convolutional ones, whose files hold nothing else, and for
    # Swin2SR, whose window and shift are recorded only in its buffers, as released; DAT's
    # without its masks and index (rebuilt by both, 94 MB at these shapes), as released.
    state = model.named_parameters() if PRESETS[a.preset]["arch"] in ("swinir", "hat") \
        else model.state_dict().items()
    rebuilt = ("attn_mask_0", "attn_mask_1", "relative_position_index")
    if PRESETS[a.preset]["arch"] == "swin2sr":
        rebuilt = ()
    params = {k: v.detach().contiguous() for k, v in state if not k.endswith(rebuilt)}
    save_file(params, a.out, metadata={"preset": a.preset, "seed": str(a.seed)})
    print(json.dumps({"out": a.out, "preset": a.preset, "seed": a.seed, "tensors": len(params)}))


def cmd_time(a):
    cuda = a.device.startswith("cuda")
    dev = torch.device(a.device)
    if not cuda:
        torch.set_num_threads(a.threads)
    model = build_model(a.preset, a.seed)
    if a.weights:
        from safetensors.torch import load_file
        missing, unexpected = model.load_state_dict(load_file(a.weights), strict=False)
        # The file holds parameters only; the buffers the model built itself are the misses.
        bad = [k for k in missing if k in dict(model.named_parameters())] + list(unexpected)
        if bad:
            sys.exit(f"{a.weights}: does not match {a.preset} ({bad[:5]})")
    dtype = DTYPES[a.dtype]
    model = model.to(dev, dtype)
    cache_masks(model, dev, dtype)
    ws = PRESETS[a.preset]["window_size"]
    tile = a.tile or (256 if cuda else max(2 * ws, 16))
    overlap = a.overlap if a.overlap is not None else (32 if cuda else max(ws // 2, 4))
    h, w = a.height or (512 if cuda else 3 * tile), a.width or (512 if cuda else 3 * tile)
    img = torch.rand((1, 3, h, w), generator=torch.Generator().manual_seed(a.seed + 3))
    if cuda:
        img = img.pin_memory()

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def once(net=model):
        sync()
        t0 = time.perf_counter()
        y, nt = upscale_tiled(net, img.to(dev, non_blocking=True), 4, ws, tile, overlap,
                              a.tile_batch, dtype, True)
        y = y.cpu()
        sync()
        return time.perf_counter() - t0, y, nt

    times, y, nt = timed_reps(once, a.warmup, a.reps, dev if cuda else None)
    med = statistics.median(times)
    run = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "preset": a.preset,
        "scale": 4, "dtype": a.dtype, "channels_last": True, "input": list(img.shape),
        "tile": tile, "overlap": overlap, "tile_batch": a.tile_batch, "tiles": nt, "reps": a.reps,
    }
    print(json.dumps({
        "summary": True, "impl": "pytorch-spandrel", **run, "median_s_per_image": round(med, 4),
        "tiles_per_s": round(nt / med, 2),
        "peak_mem_mib": round(torch.cuda.max_memory_allocated(dev) / 2**20, 1) if cuda else None,
        "finite": bool(torch.isfinite(y).all()), "torch": torch.__version__,
    }), flush=True)
    if a.compile:
        if fold_once(model):
            run["folds_kept"] = True
        run_compiled(model, once, a.reps, run, y, med, dev if cuda else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mw = sub.add_parser("make-weights")
    mw.add_argument("out")
    mw.add_argument("--preset", choices=sorted(PRESETS), default="swinir-m")
    mw.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("time")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--preset", choices=sorted(PRESETS), default="swinir-m")
    t.add_argument("--weights", help="safetensors from make-weights (default: random from --seed)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    t.add_argument("--height", type=int)
    t.add_argument("--width", type=int)
    t.add_argument("--tile", type=int, help="a multiple of the window (default 256; cpu 2*window)")
    t.add_argument("--overlap", type=int)
    t.add_argument("--tile-batch", type=int, default=4)
    t.add_argument("--reps", type=int, default=3)
    t.add_argument("--warmup", type=int, default=1)
    t.add_argument("--threads", type=int, default=2, help="CPU threads (cpu device only)")
    t.add_argument("--compile", action="store_true", help="then torch.compile(model, dynamic=False)")
    a = ap.parse_args()
    {"make-weights": cmd_make_weights, "time": cmd_time}[a.cmd](a)


if __name__ == "__main__":
    main()
