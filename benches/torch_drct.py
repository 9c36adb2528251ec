#!/usr/bin/env python3
"""PyTorch (spandrel) side of the DRCT CPU benchmarks.

  python benches/torch_drct.py make-weights OUT.safetensors [--preset drct] [--scale 4] [--seed 0]
  python benches/torch_drct.py time --preset drct --size 64 --threads 2 --reps 5 --warmup 1

Weights are random but of the released shapes, so timings match the real models; no
checkpoint is needed or downloaded. `time` builds the same weights from the same seed as
`make-weights` (or loads --weights), so both sides of a side-by-side run identical numbers.
"""

import argparse
import json
import math
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# name -> DRCT hyper-parameters; "drct"/"drct-l" are the released shapes
PRESETS = {
    "drct": dict(groups=6, embed_dim=180, window=16, heads=6, gc=32, mlp_ratio=2.0),
    "drct-l": dict(groups=12, embed_dim=180, window=16, heads=6, gc=32, mlp_ratio=2.0),
    # the embedded default model's shape (models/default_x4.safetensors: pass it as --weights);
    # its upsampler is 32 channels wide where the released models' is 64
    "default": dict(groups=3, embed_dim=48, window=8, heads=4, gc=16, mlp_ratio=2.0, num_feat=32),
    # small enough for a CPU smoke test
    "tiny": dict(groups=1, embed_dim=24, window=8, heads=6, gc=10, mlp_ratio=2.0),
}


# models/train_default.py's CONFIG names for the fields whose names differ here.
TRAIN_NAMES = {"window_size": "window", "num_heads": "heads"}


def build_model(preset, scale=4, seed=0, img_size=64, config=None):
    """spandrel's DRCT of the preset's shape, with `config` (a dict in train_default.py's CONFIG
    names) overriding fields, with seeded random weights, float32, eval."""
    from spandrel.architectures.DRCT import DRCT

    p = dict(PRESETS[preset])
    for key, value in (config or {}).items():
        key = TRAIN_NAMES.get(key, key)
        if key not in ("groups", "embed_dim", "window", "heads", "gc", "mlp_ratio", "num_feat"):
            sys.exit(f"--config: unknown field {key}")
        p[key] = value
    model = DRCT(
        img_size=img_size, patch_size=1, in_chans=3, embed_dim=p["embed_dim"],
        depths=(6,) * p["groups"], num_heads=(p["heads"],) * p["groups"],
        window_size=p["window"], mlp_ratio=p["mlp_ratio"], qkv_bias=True,
        drop_path_rate=0.0, upscale=scale, img_range=1.0, upsampler="pixelshuffle",
        resi_connection="1conv", gc=p["gc"],
    )
    # The default model's upsampler is narrower than spandrel's fixed 64 channels.
    set_upsampler_width(model, p["embed_dim"], p.get("num_feat", 64), scale)
    randomise(model, seed)
    return model.float().eval()


def set_upsampler_width(model, embed_dim, nf, scale):
    """spandrel's DRCT with an nf-channel upsampler. The reference hard-codes 64; these three
    modules are the whole upsampler and the forward pass only calls them, so replacing them
    changes nothing else."""
    if nf != 64:
        from spandrel.architectures.DRCT.__arch.drct_arch import Upsample
        model.conv_before_upsample = torch.nn.Sequential(
            torch.nn.Conv2d(embed_dim, nf, 3, 1, 1), torch.nn.LeakyReLU(inplace=True))
        model.upsample = Upsample(scale, nf)
        model.conv_last = torch.nn.Conv2d(nf, 3, 3, 1, 1)
    return model


@torch.no_grad()
def randomise(model, seed):
    """Fan-in scaled normal weights; LayerNorm affine near (1, 0); biases and the relative
    position table non-zero so every path does real work. Keeps outputs finite and O(1)
    even for 12 groups (each group adds only 0.2 x its output to the residual stream)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        is_norm = ".norm" in name or name.startswith("norm.")
        if is_norm:
            r = r * 0.1 + (1.0 if name.endswith(".weight") else 0.0)
        elif name.endswith("relative_position_bias_table"):
            r = r * 0.5
        elif name.endswith(".bias"):
            r = r * 0.02
        else:
            r = r / math.sqrt(max(1, int(torch.tensor(p.shape[1:]).prod())))
            if name.startswith("conv_last."):
                r = r * 0.5
        p.copy_(r.to(p.dtype))


def params_state_dict(model):
    """Parameters only (no relative_position_index / attn_mask buffers), float32."""
    return {k: v.detach().float().contiguous() for k, v in model.named_parameters()}


def load_weights(model, path):
    from safetensors.torch import load_file

    sd = load_file(path)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [k for k in missing if not k.endswith(("relative_position_index", "attn_mask"))]
    if bad or unexpected:
        sys.exit(f"{path}: does not match the preset (missing {bad[:5]}, unexpected {unexpected[:5]})")


def pad_to_window(x, window):
    """The official test pipeline's padding: reflect-101, bottom/right, only when needed."""
    h, w = x.shape[-2:]
    ph, pw = (window - h % window) % window, (window - w % window) % window
    if ph or pw:
        x = F.pad(x, (0, pw, 0, ph), mode="reflect")
    return x


def cmd_make_weights(a):
    from safetensors.torch import save_file

    model = build_model(a.preset, a.scale, a.seed, config=json.loads(a.config) if a.config else None)
    sd = params_state_dict(model)
    n = sum(v.numel() for v in sd.values())
    save_file(sd, a.out, metadata={"preset": a.preset, "scale": str(a.scale), "seed": str(a.seed)})
    print(json.dumps({"out": a.out, "preset": a.preset, "scale": a.scale, "seed": a.seed,
                      "params": n, "tensors": len(sd)}))


def cmd_time(a):
    torch.set_num_threads(a.threads)
    h = a.height or a.size
    w = a.width or a.size
    window = PRESETS[a.preset]["window"]
    # Built for the padded input size, so the shift mask is the stored buffer (cast with the
    # model); for other sizes spandrel computes it in f32, which pure bf16 cannot add.
    side = -(-max(h, w) // window) * window
    model = build_model(a.preset, a.scale, a.seed, img_size=side)
    if a.weights:
        load_weights(model, a.weights)
    g = torch.Generator().manual_seed(a.seed + 1)
    x = torch.rand((a.batch, 3, h, w), generator=g, dtype=torch.float32)
    # "bfloat16" is pure bf16 (weights and activations), PyTorch's fastest CPU mode.
    dtype = getattr(torch, a.dtype)
    model = model.to(dtype)
    x = x.to(dtype)

    def once():
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = model(pad_to_window(x, window))[:, :, : h * a.scale, : w * a.scale]
        return time.perf_counter() - t0, y

    for _ in range(a.warmup):
        once()
    times = []
    for i in range(a.reps):
        t, y = once()
        times.append(t)
        print(json.dumps({"rep": i, "seconds": round(t, 4)}), flush=True)
    assert torch.isfinite(y.float()).all(), "non-finite output"
    print(json.dumps({
        "summary": True, "impl": "pytorch-spandrel", "preset": a.preset, "scale": a.scale,
        "input": [a.batch, 3, h, w], "dtype": a.dtype, "device": "cpu", "threads": a.threads,
        "reps": a.reps, "warmup": a.warmup, "median_s": round(statistics.median(times), 4),
        "min_s": round(min(times), 4), "output_mean": round(float(y.float().mean()), 6),
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
    }), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    mw = sub.add_parser("make-weights", help="write random weights of a released shape")
    mw.add_argument("out")
    mw.add_argument("--preset", choices=sorted(PRESETS), default="drct")
    mw.add_argument("--scale", type=int, choices=(2, 3, 4), default=4)
    mw.add_argument("--seed", type=int, default=0)
    mw.add_argument("--config", help='JSON overrides of the preset in train_default.py\'s names, '
                    'e.g. \'{"groups": 4, "embed_dim": 64}\'')
    mw.set_defaults(fn=cmd_make_weights)

    t = sub.add_parser("time", help="time spandrel's DRCT forward, float32, CPU")
    t.add_argument("--preset", choices=sorted(PRESETS), default="drct")
    t.add_argument("--scale", type=int, choices=(2, 3, 4), default=4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--weights", help="safetensors from make-weights (default: rebuild from --seed)")
    t.add_argument("--size", type=int, default=64, help="square input side (LR pixels)")
    t.add_argument("--height", type=int)
    t.add_argument("--width", type=int)
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--reps", type=int, default=5)
    t.add_argument("--warmup", type=int, default=1)
    t.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    t.set_defaults(fn=cmd_time)

    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
