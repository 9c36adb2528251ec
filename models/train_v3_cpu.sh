#!/bin/sh
# The default x4 model v3 on a CPU: a second stage on top of v2 (a warm restart from v2's last
# checkpoint, weights, Adam moments and EMA carried over) on the v3 photographs (v2's plus four
# more, all CC0, public domain or CC-BY) with 48x48 LR patches, in one command:
#
#   sh models/train_v3_cpu.sh WORKDIR [STOP_BY_UTC_HH:MM]
#
# Runs models/train_v2.sh first when WORKDIR/v2/run/last.pt is missing (same needs: Debian 12's
# apt, a Python with torch, spandrel, numpy, pillow, safetensors), then builds the v3 images
# with scripts/gpu-train-pack.sh. Rerunning the same command resumes from WORKDIR/v3/run/last.pt.
# The optional deadline fits the cosine schedule (at most 8,000 steps) to end by then; the
# committed run used one.
set -eu
WORK=${1:?usage: train_v3_cpu.sh WORKDIR [STOP_BY_UTC_HH:MM]}
STOP_BY=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
[ -f "$WORK/v2/run/last.pt" ] || sh "$HERE/train_v2.sh" "$WORK/v2"
[ -f "$WORK/pack/train_v3.npz" ] || PYTHON="$PY" "$HERE/../scripts/gpu-train-pack.sh" "$WORK/pack"
set -- train --images "$WORK/pack/train_v3.npz" --photos "$HERE/../tests/photos" \
  --workdir "$WORK/v3/run" --init "$WORK/v2/run/last.pt" --steps 8000 --batch 8 --patch 48 \
  --lr 4e-4 --warmup 200 --val-every 250 --ema 0.999 --seed 3 --threads 2
[ -n "$STOP_BY" ] && set -- "$@" --stop-by "$STOP_BY"
nice -n 19 "$PY" "$HERE/train_default.py" "$@"
"$PY" "$HERE/train_default.py" export --ckpt "$WORK/v3/run/best.pt" \
  --photos "$HERE/../tests/photos" --out "$WORK/default_x4_v3.safetensors"
