#!/usr/bin/env bash
# Tiling on the CPU: peak memory against image size at a fixed tile (it must grow with the
# output image only, not with activations), and throughput against --tile_batch_size.
#
# usage: benches/cpu_tiles.sh MODEL [TILE]
# needs: python3 with numpy and pillow (to make the test pictures)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: $0 MODEL [TILE]}
tile=${2:-128}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo build --release --quiet
bin=./target/release/upscale

"$PY" - "$work" <<'PYEOF'
import sys
import numpy as np
from PIL import Image
rng = np.random.default_rng(0)
for n in (500, 1000, 2000):
    y, x = np.mgrid[0:n, 0:n]
    img = 0.5 + 0.3 * np.sin(x[..., None] * 0.05 + np.arange(3)) * np.cos(y[..., None] * 0.031)
    img = np.clip(img + rng.normal(0, 0.03, img.shape), 0, 1)
    Image.fromarray((img * 255).round().astype(np.uint8)).save(f"{sys.argv[1]}/in{n}.png")
PYEOF

echo "## peak memory, --tile $tile --tile_batch_size 1 ($($bin info "$model" --json))"
echo "| input | output | peak RSS | wall |"
echo "|---|---|---|---|"
for n in 500 1000 2000; do
  /usr/bin/time -f "%M %e" -o "$work/t" "$bin" -m "$model" "$work/in$n.png" -o "$work/out$n.png" \
    --device cpu --tile "$tile" --tile_batch_size 1 --overwrite -q
  read -r kb secs < "$work/t"
  out=$("$PY" -c "from PIL import Image; im=Image.open('$work/out$n.png'); print(f'{im.width}x{im.height}')")
  printf '| %sx%s | %s | %.0f MiB | %s s |\n' "$n" "$n" "$out" "$(echo "$kb / 1024" | bc -l)" "$secs"
done

echo
echo "## throughput against --tile_batch_size (256x256 input, --tile 64, overlap 16)"
echo "| batch | median s | input MP/s | tiles/s | peak RSS MiB |"
echo "|---|---|---|---|---|"
for b in 1 2 4 8; do
  "$bin" bench -m "$model" --device cpu --size 256x256 --tile 64 --tile_overlap 16 \
    --tile_batch_size "$b" --reps 3 --json |
    "$PY" -c 'import json, sys
r = json.load(sys.stdin)
print("| %d | %.3f | %.4f | %.2f | %d |" % (r["batch"], r["median_s"], r["input_mpix_per_s"], r["tiles_per_s"], r["peak_rss_bytes"] // 2**20))'
done
