#!/bin/sh
# Rebuilds the v2 training data from its packages and trains the default x4
# model v2 with a fixed seed, in one command:
#
#   sh models/train_v2.sh WORKDIR [STOP_BY_UTC_HH:MM]
#
# Needs Debian 12's apt (the wallpapers are only downloaded and extracted, not
# installed) and a Python with torch, spandrel, numpy, pillow, safetensors.
# WORKDIR receives the extracted packages (WORKDIR/debroot), the checkpoints
# and train.log; rerunning the same command resumes from WORKDIR/run/last.pt.
# The optional deadline shortens the cosine schedule so training ends by then
# (the committed run used it; without it the full 11,000 steps are run).
set -eu
WORK=${1:?usage: train_v2.sh WORKDIR [STOP_BY_UTC_HH:MM]}
STOP_BY=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
"$PY" -m pip install -q scikit-image==0.26.0 scikit-learn==1.9.1
mkdir -p "$WORK/debroot"
(cd "$WORK/debroot" && apt-get download lomiri-wallpapers-16.04=20.04.0-2 && \
  for f in *.deb; do dpkg-deb -x "$f" .; done)
set -- train --debroot "$WORK/debroot" --photos "$HERE/../tests/photos" \
  --workdir "$WORK/run" --steps 11000 --batch 8 --patch 32 --lr 8e-4 --warmup 200 \
  --val-every 250 --ema 0.999 --seed 0 --threads 1
[ -n "$STOP_BY" ] && set -- "$@" --stop-by "$STOP_BY"
nice -n 19 "$PY" "$HERE/train_default.py" "$@"
"$PY" "$HERE/train_default.py" export --ckpt "$WORK/run/best.pt" \
  --photos "$HERE/../tests/photos" --out "$WORK/default_x4_v2.safetensors"
