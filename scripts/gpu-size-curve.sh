#!/usr/bin/env bash
# Held-out gain against model size, in one GPU call: trains several shapes of the default
# model at once, each from scratch on the pack's photographs for MINUTES of wall time (their
# own cosine schedules fitted to end by then), and tabulates each shape's parameters, steps
# and held-out gain over bicubic. It answers how large a default model would have to be for a
# given gain before anyone spends CPU hours on one; the cost side is `upscale bench` with
# random weights of each shape on the CPU (`benches/torch_drct.py make-weights --config`).
#
# usage: scripts/gpu-size-curve.sh PACKDIR OUTDIR [MINUTES] [CONFIG_JSON...]
#        (PACKDIR from scripts/gpu-train-pack.sh; default: four shapes from the embedded
#        model's to about DRCT's width). DEVICE=cpu runs it on the CPU (a smoke test);
#        TRAIN_FLAGS adds train_default.py flags to every run (they win).
# Writes OUTDIR/curve.md and OUTDIR/<n>.log, one training log per shape.
set -euo pipefail
cd "$(dirname "$0")/.."
pack=${1:?usage: $0 PACKDIR OUTDIR [MINUTES] [CONFIG_JSON...]}
out=${2:?}
minutes=${3:-8}
shift 3 || shift $#
configs=("$@")
if [ ${#configs[@]} = 0 ]; then
  configs=(
    '{"groups": 3, "num_feat": 32}'
    '{"groups": 4, "embed_dim": 64, "num_feat": 48}'
    '{"groups": 6, "embed_dim": 96, "gc": 24, "num_heads": 6, "num_feat": 64}'
    '{"groups": 6, "embed_dim": 120, "gc": 32, "num_heads": 6, "num_feat": 64}'
  )
fi
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! python3 -c 'import spandrel' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$pack"/spandrel-*.whl
  export PYTHONPATH=$work/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stop_by=$(date -u -d "+$minutes min" +%H:%M)
threads=$(( $(nproc) / ${#configs[@]} ))
pids=()
for i in "${!configs[@]}"; do
  python3 models/train_default.py train --images "$pack/train_v3.npz" --photos tests/photos \
    --workdir "$work/run$i" --device "${DEVICE:-cuda}" --steps 200000 --batch 32 --patch 48 \
    --lr 8e-4 --warmup 500 --val-every 500 --log-every 100 --ema 0.999 --seed 0 \
    --threads $(( threads > 0 ? threads : 1 )) --config "${configs[$i]}" \
    --stop-by "$stop_by" --stop-margin 60 ${TRAIN_FLAGS:-} > "$out/$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "shape $i failed: see $out/$i.log" >&2; failed=1; }
done
{
  echo "Each shape trained from scratch for $minutes minutes beside the others (${DEVICE:-cuda})."
  echo
  echo "| shape | params | steps | held-out gain (EMA, last validation) |"
  echo "|---|---|---|---|"
  for i in "${!configs[@]}"; do
    params=$(grep -o 'params [0-9]*' "$out/$i.log" | head -n 1 | cut -d' ' -f2)
    last=$(grep ' ema ' "$out/$i.log" | tail -n 1)
    step=$(sed -n 's/.*val step \([0-9]*\).*/\1/p' <<< "$last")
    gain=$(sed -n 's/.*gain \([-+][0-9.]*\)).*/\1/p' <<< "$last")
    echo "| \`${configs[$i]}\` | ${params:-?} | ${step:-?} | ${gain:-?} |"
  done
} > "$out/curve.md"
cat "$out/curve.md"
exit $failed
