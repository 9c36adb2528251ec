#!/usr/bin/env bash
# SwinIR or HAT on the CPU, side by side: whole-process `upscale` (load, decode, forward,
# encode) against PyTorch's warm forward pass alone (spandrel's module, f32, the same thread
# count), alternating rep by rep, with random weights of a released shape: SwinIR-M classical
# x4 (E 180, 6 groups of 6 blocks, 6 heads, window 8) or, with MODEL=hat, HAT x4 (E 180,
# 6 groups of 6 blocks, 6 heads, window 16, compress 3, squeeze 30, overlap 0.5) or, with
# MODEL=dat, DAT x4 (E 180, 6 groups of 6 blocks, 6 heads, split 8x32, expansion 4) or, with
# MODEL=swinir-jpeg, SwinIR-M's colour JPEG model (x1, window 7, range 255) or, with
# MODEL=swin2sr, Swin2SR's classical x2 (E 180, 6 groups of 6 blocks, 6 heads, window 8).
# Prints each rep and the ratio of medians (PyTorch / ours).
#
# usage: [MODEL=swinir|swinir-jpeg|swin2sr|hat|dat] benches/swin_family_cpu_vs_torch.sh [REPS] [SIZE]   (5 reps, 64x64)
# needs: python3 with torch, spandrel, safetensors, numpy, pillow  (PYTHON=... to choose one)
# BEFORE=path/to/upscale also times that binary (an earlier build) in every rep, between
# ours and PyTorch, for a before/after of a change in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
REPS=${1:-5}
SIZE=${2:-64}
THREADS=${THREADS:-$(nproc)}
MODEL=${MODEL:-swinir}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cargo build --release --quiet
case "$MODEL" in
  swinir) "$PY" tests/golden/make_golden_swinir.py --bench "$work" >/dev/null 2>&1
          weights="$work/swinir_m_x4_random.safetensors" ;;
  swinir-jpeg) "$PY" tests/golden/make_golden_swinir.py --bench "$work" >/dev/null 2>&1
               weights="$work/swinir_m_jpeg_random.safetensors" ;;
  swin2sr) "$PY" tests/golden/make_golden_swin2sr.py --bench "$work" >/dev/null 2>&1
           weights="$work/swin2sr_classical_x2_random.safetensors" ;;
  hat) "$PY" tests/golden/make_golden_hat.py --bench "$work" >/dev/null 2>&1
       weights="$work/hat_x4_random.safetensors" ;;
  dat) "$PY" tests/golden/make_golden_dat.py --bench "$work" >/dev/null 2>&1
       weights="$work/dat_x4_random.safetensors" ;;
  *) echo "MODEL must be swinir, swinir-jpeg, swin2sr, hat or dat" >&2; exit 2 ;;
esac
"$PY" - "$work/in.png" "$SIZE" <<'PYEOF'
import sys
import numpy as np
from PIL import Image
n = int(sys.argv[2])
rng = np.random.default_rng(0)
y, x = np.mgrid[0:n, 0:n]
img = 0.5 + 0.3 * np.sin(x[..., None] * 0.2 + np.arange(3)) * np.cos(y[..., None] * 0.13)
img = np.clip(img + rng.normal(0, 0.05, img.shape), 0, 1)
Image.fromarray((img * 255).round().astype(np.uint8)).save(sys.argv[1])
PYEOF
cat > "$work/torch_time.py" <<'PYEOF'
import sys, time
import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
weights, image, threads, model = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
if model == "dat":
    from spandrel.architectures.DAT import DAT
    m = DAT(img_size=64, in_chans=3, embed_dim=180, split_size=[8, 32], depth=[6] * 6,
            num_heads=[6] * 6, expansion_factor=4.0, upscale=4, img_range=1.0,
            resi_connection="1conv", upsampler="pixelshuffle")
elif model == "hat":
    from spandrel.architectures.HAT import HAT
    m = HAT(img_size=64, patch_size=1, in_chans=3, embed_dim=180, depths=(6,) * 6,
            num_heads=(6,) * 6, window_size=16, compress_ratio=3, squeeze_factor=30,
            conv_scale=0.01, overlap_ratio=0.5, mlp_ratio=2.0, upscale=4, img_range=1.0,
            upsampler="pixelshuffle", resi_connection="1conv")
elif model == "swin2sr":
    from spandrel.architectures.Swin2SR import Swin2SR
    m = Swin2SR(img_size=64, patch_size=1, in_chans=3, embed_dim=180, depths=[6] * 6,
                num_heads=[6] * 6, window_size=8, mlp_ratio=2.0, upscale=2, img_range=1.0,
                upsampler="pixelshuffle", resi_connection="1conv")
elif model == "swinir-jpeg":
    from spandrel.architectures.SwinIR import SwinIR
    m = SwinIR(img_size=126, patch_size=1, in_chans=3, embed_dim=180, depths=[6] * 6,
               num_heads=[6] * 6, window_size=7, mlp_ratio=2.0, upscale=1, img_range=255.0,
               upsampler="", resi_connection="1conv")
else:
    from spandrel.architectures.SwinIR import SwinIR
    m = SwinIR(img_size=64, patch_size=1, in_chans=3, embed_dim=180, depths=[6] * 6,
               num_heads=[6] * 6, window_size=8, mlp_ratio=2.0, upscale=4, img_range=1.0,
               upsampler="pixelshuffle", resi_connection="1conv")
r = m.load_state_dict(load_file(weights), strict=False)
# the file holds parameters only: the buffers the model built itself are the only misses
assert not r.unexpected_keys, r.unexpected_keys
assert all(k.endswith(("relative_position_index", "attn_mask", "_SA", "_OCA", "attn_mask_0",
                        "attn_mask_1", "num_batches_tracked")) for k in r.missing_keys)
m.eval()
x = torch.from_numpy(np.asarray(Image.open(image), dtype=np.float32) / 255.0)
x = x.permute(2, 0, 1)[None].contiguous()
with torch.inference_mode():
    m(x)  # warm-up
    t0 = time.perf_counter()
    m(x)
    print(time.perf_counter() - t0)
PYEOF

# Whole-process seconds of one `upscale` run of binary $1.
run_ours() {
  local t0 t1
  t0=$(date +%s.%N)
  RAYON_NUM_THREADS=$THREADS "$1" -m "$weights" \
    "$work/in.png" -o "$work/out.png" --device cpu --precision fp32 --tile 0 --overwrite -q
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc -l
}
ours=(); before=(); torch=()
for i in $(seq "$REPS"); do
  o=$(run_ours ./target/release/upscale)
  ours+=("$o")
  if [ -n "${BEFORE:-}" ]; then
    b=$(run_ours "$BEFORE")
    before+=("$b")
  fi
  t=$("$PY" "$work/torch_time.py" "$weights" "$work/in.png" "$THREADS" "$MODEL" 2>/dev/null | tail -n 1)
  torch+=("$t")
  printf 'rep %d: upscale %.3f s (whole process)%s, pytorch %.3f s (forward)\n' "$i" "$o" \
    "${b:+$(printf ', before %.3f s' "$b")}" "$t"
done
"$PY" - "$SIZE" "$THREADS" "${ours[*]}" "${torch[*]}" "$MODEL" "${before[*]}" <<'PYEOF'
import json, statistics, sys
size, threads, model = int(sys.argv[1]), int(sys.argv[2]), sys.argv[5]
ours = [float(v) for v in sys.argv[3].split()]
torch = [float(v) for v in sys.argv[4].split()]
before = [float(v) for v in sys.argv[6].split()]
mo, mt = statistics.median(ours), statistics.median(torch)
name = {"hat": "HAT x4", "dat": "DAT x4", "swinir-jpeg": "SwinIR-M colour JPEG x1",
        "swin2sr": "Swin2SR classical x2"}.get(
    model, "SwinIR-M classical x4")
report = {"model": name + " (random weights)", "input": [size, size],
          "threads": threads, "precision": "fp32", "upscale_median_s": round(mo, 3),
          "pytorch_median_s": round(mt, 3), "ratio_pytorch_over_upscale": round(mt / mo, 3)}
if before:
    mb = statistics.median(before)
    report.update({"before_median_s": round(mb, 3),
                   "ratio_pytorch_over_before": round(mt / mb, 3),
                   "speedup_before_over_upscale": round(mb / mo, 3)})
print(json.dumps(report))
PYEOF
