#!/bin/sh
# The default x4 model v4 on a CPU: v3 grown to three residual groups with a 32-channel
# upsampler (the same inference cost as v3's two groups and 64 channels), trained on the v3
# photographs (CC0, public domain or CC-BY), in one command:
#
#   sh models/train_v4_cpu.sh WORKDIR [STOP_BY_UTC_HH:MM]
#
# The start is v3 (WORKDIR/default_x4_v3.safetensors): when missing, it is taken from this
# repository's history (the commit that embedded v3) or, outside a git checkout, rebuilt with
# models/train_v3_cpu.sh (hours). v3's two groups and everything but the upsampler carry
# over; the third group starts as the identity; for the first 300 steps only the new tensors
# train. Rerunning the same command resumes from WORKDIR/v4/run/last.pt. The optional
# deadline fits the cosine schedule (at most 8,000 steps) to end by then; the committed run
# used one.
set -eu
WORK=${1:?usage: train_v4_cpu.sh WORKDIR [STOP_BY_UTC_HH:MM]}
STOP_BY=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
V3_COMMIT=c98facf
mkdir -p "$WORK"
if [ ! -f "$WORK/default_x4_v3.safetensors" ]; then
  git -C "$HERE" show "$V3_COMMIT:models/default_x4.safetensors" >"$WORK/default_x4_v3.safetensors.tmp" &&
    mv "$WORK/default_x4_v3.safetensors.tmp" "$WORK/default_x4_v3.safetensors" ||
    sh "$HERE/train_v3_cpu.sh" "$WORK"
fi
[ -f "$WORK/pack/train_v3.npz" ] || PYTHON="$PY" "$HERE/../scripts/gpu-train-pack.sh" "$WORK/pack"
set -- train --images "$WORK/pack/train_v3.npz" --photos "$HERE/../tests/photos" \
  --workdir "$WORK/v4/run" --grow-from "$WORK/default_x4_v3.safetensors" --new-only-steps 300 \
  --config '{"groups": 3, "num_feat": 32}' --steps 8000 --batch 8 --patch 48 \
  --lr 4e-4 --warmup 200 --val-every 250 --ema 0.999 --seed 5 --threads 2
[ -n "$STOP_BY" ] && set -- "$@" --stop-by "$STOP_BY"
nice -n 5 "$PY" "$HERE/train_default.py" "$@"
"$PY" "$HERE/train_default.py" export --ckpt "$WORK/v4/run/best.pt" \
  --photos "$HERE/../tests/photos" --out "$WORK/default_x4_v4.safetensors"
