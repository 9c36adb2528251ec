#!/usr/bin/env bash
# Side-by-side on the CPU: whole-process `upscale` (load, decode, forward, encode) against
# PyTorch's forward alone (spandrel's DRCT, f32, same thread count), alternating rep by rep so
# both see the same machine load. Prints each rep and the ratio of medians (PyTorch / ours).
#
# usage: benches/cpu_vs_torch.sh [REPS] [PRESET] [SIZE]     (PRESET: drct | drct-l)
#        PRECISION=bf16 compares `--precision bf16` with PyTorch in pure bf16 (model and input
#        cast to bfloat16); TILE=N passes --tile N (default 0: the whole input at once),
#        TILE=auto no --tile at all (the automatic tile a plain command gets).
# needs: python3 with torch, spandrel, safetensors, numpy, pillow  (PYTHON=... to choose one)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
REPS=${1:-5}
PRESET=${2:-drct}
SIZE=${3:-64}
THREADS=${THREADS:-$(nproc)}
PRECISION=${PRECISION:-fp32}
TILE=${TILE:-0}
case "$PRECISION" in
  fp32) TORCH_DTYPE=float32 ;;
  bf16) TORCH_DTYPE=bfloat16 ;;
  *) echo "PRECISION must be fp32 or bf16" >&2; exit 2 ;;
esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cargo build --release --quiet
"$PY" benches/torch_drct.py make-weights "$work/w.safetensors" --preset "$PRESET" --scale 4 --seed 0 >/dev/null
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

tile_args=(--tile "$TILE")
[ "$TILE" = auto ] && tile_args=()
ours=(); torch=()
for i in $(seq "$REPS"); do
  t0=$(date +%s.%N)
  RAYON_NUM_THREADS=$THREADS ./target/release/upscale -m "$work/w.safetensors" "$work/in.png" \
    -o "$work/out.png" --device cpu --precision "$PRECISION" "${tile_args[@]}" --overwrite -q
  t1=$(date +%s.%N)
  o=$(echo "$t1 - $t0" | bc -l)
  t=$("$PY" benches/torch_drct.py time --preset "$PRESET" --weights "$work/w.safetensors" \
        --size "$SIZE" --threads "$THREADS" --reps 1 --warmup 1 --dtype "$TORCH_DTYPE" | tail -n 1 |
      "$PY" -c 'import json,sys; print(json.load(sys.stdin)["median_s"])')
  ours+=("$o"); torch+=("$t")
  printf 'rep %d: upscale %.3f s (whole process), pytorch %.3f s (forward)\n' "$i" "$o" "$t"
done
"$PY" - "$PRESET" "$SIZE" "$THREADS" "${ours[*]}" "${torch[*]}" "$PRECISION" "$TILE" <<'PYEOF'
import json, statistics, sys
preset, size, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ours = [float(v) for v in sys.argv[4].split()]
torch = [float(v) for v in sys.argv[5].split()]
precision, tile = sys.argv[6], sys.argv[7]
tile = int(tile) if tile != "auto" else tile
mo, mt = statistics.median(ours), statistics.median(torch)
print(json.dumps({"preset": preset, "input": [size, size], "threads": threads,
                  "precision": precision, "tile": tile,
                  "upscale_median_s": round(mo, 3), "pytorch_median_s": round(mt, 3),
                  "ratio_pytorch_over_upscale": round(mt / mo, 3)}))
PYEOF
