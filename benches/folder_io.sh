#!/usr/bin/env bash
# Images per second for a folder of small photos, with decoding/encoding on a worker thread
# (--io_threads 1, the default) and inline (--io_threads 0), alternating rep by rep.
#
# usage: benches/folder_io.sh MODEL [IMAGES] [REPS] [SIZE]
# needs: python3 with scikit-image and pillow (the photos are crops of scikit-image's)
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: $0 MODEL [IMAGES] [REPS] [SIZE]}
count=${2:-24}
reps=${3:-3}
size=${4:-96}
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo build --release --quiet
bin=./target/release/upscale

"$PY" - "$work/in" "$count" "$size" <<'PYEOF'
import os, sys
from PIL import Image
from skimage import data
out, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(out, exist_ok=True)
photos = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
for i in range(count):
    p = photos[i % len(photos)]
    y = (i * 37) % (p.shape[0] - size)
    x = (i * 53) % (p.shape[1] - size)
    Image.fromarray(p[y:y + size, x:x + size]).save(f"{out}/{i:03d}.png")
PYEOF

declare -A times
for r in $(seq "$reps"); do
  for t in 1 0; do
    rm -rf "$work/out"
    s=$(date +%s.%N)
    "$bin" -m "$model" --device cpu --tile 0 -q "$work/in" -o "$work/out" --io_threads "$t"
    e=$(date +%s.%N)
    times[$t]+="$(echo "$e - $s" | bc -l) "
  done
done
"$PY" - "$count" "${times[1]}" "${times[0]}" <<'PYEOF'
import json, statistics, sys
n = int(sys.argv[1])
w = statistics.median(float(v) for v in sys.argv[2].split())
i = statistics.median(float(v) for v in sys.argv[3].split())
print(json.dumps({"images": n, "io_threads_1_s": round(w, 3), "io_threads_0_s": round(i, 3),
                  "images_per_s_threads": round(n / w, 2), "images_per_s_inline": round(n / i, 2),
                  "speedup": round(i / w, 3)}))
PYEOF
