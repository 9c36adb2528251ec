#!/bin/sh
# How far the embedded model's shape, and one group deeper, go on the held-out photos when
# trained on those photos themselves (models/README.md, "Ceiling"). A measurement only: the
# models it makes have seen the test set and are never embedded.
#
#   sh models/ceiling_cpu.sh WORKDIR [STOP_BY]     (WORKDIR of models/train_v4_cpu.sh, UTC HH:MM)
#
# Needs stage 5 of models/train_v4_cpu.sh (WORKDIR/v4e/run/last.pt). The two runs go side by
# side, one PyTorch thread each.
set -eu
WORK=${1:?usage: ceiling_cpu.sh WORKDIR [STOP_BY]}
STOP_BY=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
PHOTOS="$HERE/../tests/photos"
V43_COMMIT=1d96f91
mkdir -p "$WORK"
[ -f "$WORK/default_x4_v4.3.safetensors" ] ||
  git -C "$HERE" show "$V43_COMMIT:models/default_x4.safetensors" >"$WORK/default_x4_v4.3.safetensors"
"$PY" "$HERE/train_default.py" pack --held-out-photos "$PHOTOS" --out "$WORK/held_out.npz"
run() {
  dir=$1 seed=$2
  shift 2
  set -- train --images "$WORK/held_out.npz" --photos "$PHOTOS" --workdir "$dir" "$@" \
    --steps 8000 --batch 8 --patch 48 --lr 2e-4 --warmup 200 --val-every 250 --ema 0.999 \
    --seed "$seed" --threads 1
  [ -n "$STOP_BY" ] && set -- "$@" --stop-by "$STOP_BY"
  nice -n 5 "$PY" "$HERE/train_default.py" "$@"
}
run "$WORK/ceiling3/run" 11 --init "$WORK/v4e/run/last.pt" --config '{"groups": 3, "num_feat": 32}' &
three=$!
run "$WORK/ceiling4/run" 12 --grow-from "$WORK/default_x4_v4.3.safetensors" \
  --config '{"groups": 4, "num_feat": 32}' &
# Wait for each by name, so that either run failing fails the script.
wait "$three"
wait $!
