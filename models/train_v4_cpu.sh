#!/bin/sh
# The default x4 model v4.3 on a CPU (v4's two stages, then a third, a fourth and a fifth): v3 grown to three residual groups with a 32-channel
# upsampler (the same inference cost as v3's two groups and 64 channels), trained on the v3
# photographs (CC0, public domain or CC-BY), in one command:
#
#   sh models/train_v4_cpu.sh WORKDIR [STAGE1_STOP_BY [STAGE2_STOP_BY [STAGE3_STOP_BY [STAGE4_STOP_BY [STAGE5_STOP_BY]]]]]   (UTC HH:MM)
#
# The start is v3 (WORKDIR/default_x4_v3.safetensors): when missing, it is taken from this
# repository's history (the commit that embedded v3) or, outside a git checkout, rebuilt with
# models/train_v3_cpu.sh (hours). v3's upsampler is first narrowed from 64 to 32 channels
# (`train_default.py narrow`, fitted to its own activations); then v3's two groups carry
# over, the third group starts as the identity, and for the first 500 steps only the third
# group and the upsampler train. A second, a third, a fourth and a fifth stage each restart the
# schedule from the previous stage's last checkpoint (weights, Adam moments and EMA carried
# over), as v3 did after v2; the third to fifth at lower peaks (2e-4, 1.5e-4, 1e-4), which lose
# less at the restart. The fourth ran on one thread, beside a second run that tried
# `--scales 1,0.75,0.5` (models/README.md, v4.2); the fifth beside a second run with 64x64
# patches in batches of 4 (v4.3).
# Rerunning the same command resumes where it stopped (WORKDIR/v4/run, WORKDIR/v4b/run, then
# WORKDIR/v4c/run, WORKDIR/v4d/run, WORKDIR/v4e/run).
# The optional deadlines fit each stage's cosine schedule (at most 8,000 steps) to end by
# then; the committed runs used them (stage 1: 5,026 steps, stages 2 to 5: see the log).
# The export's `train_steps` metadata counts the last stage only; the embedded file was
# exported with --total-steps (v3's steps and all five stages', as the log shows).
set -eu
WORK=${1:?usage: train_v4_cpu.sh WORKDIR [STAGE1_STOP_BY [STAGE2_STOP_BY [STAGE3_STOP_BY [STAGE4_STOP_BY [STAGE5_STOP_BY]]]]] (UTC HH:MM)}
STOP_BY=${2:-}
STOP_BY2=${3:-}
STOP_BY3=${4:-}
STOP_BY4=${5:-}
STOP_BY5=${6:-}
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
[ -f "$WORK/v3nf32.safetensors" ] || "$PY" "$HERE/train_default.py" narrow \
  --weights "$WORK/default_x4_v3.safetensors" --images "$WORK/pack/train_v3.npz" \
  --photos "$HERE/../tests/photos" --num-feat 32 --out "$WORK/v3nf32.safetensors"
set -- train --images "$WORK/pack/train_v3.npz" --photos "$HERE/../tests/photos" \
  --workdir "$WORK/v4/run" --grow-from "$WORK/v3nf32.safetensors" \
  --first-only conv_before_upsample,upsample,conv_last,layers.2 --first-steps 500 \
  --config '{"groups": 3, "num_feat": 32}' --steps 8000 --batch 8 --patch 48 \
  --lr 2e-4 --warmup 200 --val-every 250 --ema 0.999 --seed 5 --threads 2
[ -n "$STOP_BY" ] && set -- "$@" --stop-by "$STOP_BY"
nice -n 5 "$PY" "$HERE/train_default.py" "$@"
# Stages 2 to 5: a warm restart from the previous stage's last checkpoint.
# usage: restart RUN_DIR FROM_CHECKPOINT PEAK_LR SEED THREADS [STOP_BY]
restart() {
  run=$1 from=$2 lr=$3 seed=$4 threads=$5 stop=${6:-}
  set -- train --images "$WORK/pack/train_v3.npz" --photos "$HERE/../tests/photos" \
    --workdir "$run" --init "$from" \
    --config '{"groups": 3, "num_feat": 32}' --steps 8000 --batch 8 --patch 48 \
    --lr "$lr" --warmup 200 --val-every 250 --ema 0.999 --seed "$seed" --threads "$threads"
  [ -n "$stop" ] && set -- "$@" --stop-by "$stop"
  nice -n 5 "$PY" "$HERE/train_default.py" "$@"
}
restart "$WORK/v4b/run" "$WORK/v4/run/last.pt" 3e-4 6 2 "$STOP_BY2"
restart "$WORK/v4c/run" "$WORK/v4b/run/last.pt" 2e-4 7 2 "$STOP_BY3"
restart "$WORK/v4d/run" "$WORK/v4c/run/last.pt" 1.5e-4 8 1 "$STOP_BY4"
restart "$WORK/v4e/run" "$WORK/v4d/run/last.pt" 1e-4 9 1 "$STOP_BY5"
"$PY" "$HERE/train_default.py" export --ckpt "$WORK/v4e/run/best.pt" \
  --photos "$HERE/../tests/photos" --out "$WORK/default_x4_v4.safetensors"
