#!/usr/bin/env bash
# Peak memory (maximum resident set, from GNU time) and wall time of one large image through
# the embedded model on the CPU, written whole (UPSCALE_STREAM=never) and in bands of rows as
# its tiles finish (UPSCALE_STREAM=always), alternating rep by rep; the outputs' samples are
# compared.
#
# usage: benches/large_output.sh [WIDTH] [HEIGHT] [REPS] [MODES]
#   WIDTH x HEIGHT  the input (default 2000x1500: 8000x6000 out at x4)
#   MODES           the UPSCALE_STREAM values to run (default "never always")
#   EXT             the output format (default png)
#   MODEL           weights to use instead of the embedded model (a small fixture shows how the
#                   peak grows with the image in minutes rather than hours)
# Needs /usr/bin/time (GNU) and python3 with numpy and pillow to make the input.
set -euo pipefail
cd "$(dirname "$0")/.."
width=${1:-2000}
height=${2:-1500}
reps=${3:-1}
modes=${4:-never always}
ext=${EXT:-png}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo build --release --quiet
bin=./target/release/upscale
model_args=()
if [ -n "${MODEL:-}" ]; then model_args=(--model "$MODEL"); fi

# A photo-like input: shading, texture and grain (the model's time does not depend on it).
"$PY" - "$work/in.png" "$width" "$height" <<'PYEOF'
import sys
import numpy as np
from PIL import Image
path, w, h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
y, x = np.mgrid[0:h, 0:w].astype(np.float32)
rng = np.random.default_rng(7)
img = np.stack([
    128 + 60 * np.sin(x / 97.0) * np.cos(y / 61.0),
    128 + 60 * np.sin((x + y) / 43.0),
    128 + 60 * np.cos(x / 23.0 - y / 31.0),
], -1) + rng.normal(0, 6, (h, w, 3))
Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path)
PYEOF

echo "input ${width}x${height}, output .$ext, $(nproc) CPUs"
printf '%-8s %4s %12s %10s\n' mode rep peak_MiB seconds
for rep in $(seq 1 "$reps"); do
  for mode in $modes; do
    out="$work/out-$mode.$ext"
    rm -f "$out"
    UPSCALE_STREAM=$mode /usr/bin/time -v -o "$work/time" \
      "$bin" --device cpu -q "${model_args[@]}" "$work/in.png" -o "$out"
    kb=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$work/time")
    wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$work/time")
    secs=$(echo "$wall" | awk -F: '{ s = 0; for (i = 1; i <= NF; i++) s = s * 60 + $i; print s }')
    printf '%-8s %4d %12.0f %10.1f\n' "$mode" "$rep" "$((kb / 1024))" "$secs"
  done
done

set -- $modes
if [ $# -ge 2 ]; then
  "$PY" - "$work/out-$1.$ext" "$work/out-$2.$ext" <<'PYEOF'
import sys
import numpy as np
from PIL import Image
Image.MAX_IMAGE_PIXELS = None
a, b = (np.asarray(Image.open(p)) for p in sys.argv[1:3])
print("outputs", a.shape, "samples identical" if a.shape == b.shape and (a == b).all() else "DIFFER")
PYEOF
fi
