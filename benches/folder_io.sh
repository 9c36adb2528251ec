#!/usr/bin/env bash
# Images per second for a folder of photos with each --io_threads count in IO_THREADS
# (encoder threads beside the model; 0 runs everything inline), alternating rep by rep, and
# each count's time relative to the first's.
#
# usage: benches/folder_io.sh MODEL [IMAGES] [REPS] [SIZE]
#   IO_THREADS   the counts to compare (default "2 1 0")
#   EXTRA        more flags for every run (e.g. "--outscale 8" for large outputs)
#   PHOTOS=repo  the inputs are copies of tests/photos (no Python packages needed); otherwise
#                SIZE x SIZE crops of scikit-image's photos (python3 with scikit-image, pillow)
# Set UPSCALE_DEFER_FINISH in the environment to compare it too (README).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: $0 MODEL [IMAGES] [REPS] [SIZE]}
count=${2:-24}
reps=${3:-3}
size=${4:-96}
threads=${IO_THREADS:-2 1 0}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo build --release --quiet
bin=./target/release/upscale

mkdir -p "$work/in"
if [ "${PHOTOS:-}" = repo ]; then
  photos=(tests/photos/*.png)
  for i in $(seq 0 $((count - 1))); do
    cp "${photos[i % ${#photos[@]}]}" "$work/in/$(printf %03d "$i").png"
  done
else
  "$PY" - "$work/in" "$count" "$size" <<'PYEOF'
import os, sys
from PIL import Image
from skimage import data
out, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
for i in range(count):
    p = photos[i % len(photos)]
    y = (i * 37) % (p.shape[0] - size)
    x = (i * 53) % (p.shape[1] - size)
    Image.fromarray(p[y:y + size, x:x + size]).save(f"{out}/{i:03d}.png")
PYEOF
fi

declare -A times
for r in $(seq "$reps"); do
  for t in $threads; do
    rm -rf "$work/out"
    s=$(date +%s.%N)
    # shellcheck disable=SC2086
    "$bin" -m "$model" --device cpu --tile 0 -q "$work/in" -o "$work/out" --io_threads "$t" ${EXTRA:-}
    e=$(date +%s.%N)
    times[$t]+="$(echo "$e - $s" | bc -l) "
  done
done
args=()
for t in $threads; do args+=("$t=${times[$t]}"); done
"$PY" - "$count" "${args[@]}" <<'PYEOF'
import json, statistics, sys
n = int(sys.argv[1])
med = {}
for arg in sys.argv[2:]:
    t, values = arg.split("=")
    med[t] = statistics.median(float(v) for v in values.split())
first = next(iter(med.values()))
print(json.dumps({"images": n, **{f"io_threads_{t}_s": round(m, 3) for t, m in med.items()},
                  **{f"images_per_s_{t}": round(n / m, 2) for t, m in med.items()},
                  **{f"time_ratio_{t}": round(m / first, 3) for t, m in med.items()}}))
PYEOF
