#!/usr/bin/env bash
# Trains the default x4 model on a GPU machine (PyTorch there, no network) from the folder
# scripts/gpu-train-pack.sh built, for MINUTES of wall time: the cosine schedule is fitted to
# end by then. Writes the log and the exported weights to OUTDIR (the checkpoints, 17 MB each
# with the optimiser state, stay in RUNDIR, default /tmp/gpu-train-run).
#
# usage: scripts/gpu-train.sh PACKDIR OUTDIR [MINUTES] [more train flags, which win]
#        DEVICE=cpu runs the same recipe on the CPU (a smoke test of the script).
set -euo pipefail
cd "$(dirname "$0")/.."
pack=${1:?usage: $0 PACKDIR OUTDIR [MINUTES] [flags...]}
out=${2:?}
minutes=${3:-8}
shift 3 || shift $#
run=${RUNDIR:-/tmp/gpu-train-run}
mkdir -p "$out"
if ! python3 -c 'import spandrel' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$pack"/spandrel-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 models/train_default.py train --images "$pack/train_v3.npz" --photos tests/photos \
  --workdir "$run" --device "${DEVICE:-cuda}" --steps 200000 --batch 32 --patch 48 \
  --lr 8e-4 --warmup 500 --val-every 1000 --log-every 100 --ema 0.999 --seed 0 --threads 8 \
  --stop-by "$(date -u -d "+$minutes min" +%H:%M)" --stop-margin 60 "$@"
cp "$run/train.log" "$out/"
python3 models/train_default.py export --ckpt "$run/best.pt" --photos tests/photos \
  --out "$out/default_x4_v3.safetensors"
