#!/usr/bin/env bash
# GPU side-by-side: `upscale bench` (CUDA build) against the optimised PyTorch pipeline
# (benches/torch_gpu_reference.py: spandrel DRCT + SDPA, bf16, channels_last, batched tiles),
# same weights, input size, tile, overlap and batch, one after the other on the same GPU.
#
# usage: benches/gpu_side_by_side.sh UPSCALE_BIN [PRESET] [HxW] [TILE] [OVERLAP] [BATCH] [STREAMS]
# e.g.   benches/gpu_side_by_side.sh ./upscale-cuda drct-l 540x960 256 32 4 2
# Set PEAK_TFLOPS to the GPU's measured bf16 matmul rate to get model FLOP utilisation.
# PyTorch is timed eager and then through torch.compile (about a minute of compiling first);
# TORCH_COMPILE=0 times eager only.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: $0 UPSCALE_BIN [PRESET] [HxW] [TILE] [OVERLAP] [BATCH] [STREAMS]}
preset=${2:-drct-l}
size=${3:-540x960}
tile=${4:-256}
overlap=${5:-32}
batch=${6:-4}
streams=${7:-1}
reps=${REPS:-5}
PY=${PYTHON:-python3}
h=${size%x*}
w=${size#*x}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PY" benches/torch_drct.py make-weights "$work/w.safetensors" --preset "$preset" --scale 4 --seed 0 >/dev/null
peak=()
[ -n "${PEAK_TFLOPS:-}" ] && peak=(--peak_tflops "$PEAK_TFLOPS")
compile=(--compile)
[ "${TORCH_COMPILE:-1}" = 0 ] && compile=()
echo "== upscale"
"$bin" bench -m "$work/w.safetensors" --device cuda --precision bf16 --size "$size" \
  --tile "$tile" --tile_overlap "$overlap" --tile_batch_size "$batch" --streams "$streams" \
  --reps "$reps" --json "${peak[@]}" | tee "$work/ours.json"
echo "== pytorch${compile:+, eager then torch.compile}"
"$PY" benches/torch_gpu_reference.py --device cuda --weights "$work/w.safetensors" --preset "$preset" \
  --dtype bf16 --height "$h" --width "$w" --tile "$tile" --overlap "$overlap" --tile-batch "$batch" \
  --reps "$reps" "${compile[@]}" | tee "$work/torch.log"
