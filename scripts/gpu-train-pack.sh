#!/usr/bin/env bash
# Builds the folder a GPU training run carries (scripts/gpu-train.sh): the v3 training images,
# shrunk as training reads them, in one .npz made from the pinned packages, the embedded model
# with a 32-channel upsampler (a start for --grow-from) and the spandrel wheel (the GPU machine
# has PyTorch but no network). About 25 MB.
#
# usage: scripts/gpu-train-pack.sh [DIR]            (default: train-pack)
# needs: apt-get (Debian 12 sources; packages are only downloaded and extracted), pip, and a
#        python with torch, spandrel, numpy, pillow  (PYTHON=... to choose one)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${1:-train-pack}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip install -q scikit-image==0.26.0 scikit-learn==1.9.1
(
  cd "$work"
  apt-get download -q lomiri-wallpapers-16.04=20.04.0-2 sddm-theme-maldives=0.19.0-5 \
    libjxl-testdata=0.0~git20230110.d6168ff-1
  for f in *.deb; do dpkg-deb -x "$f" root; done
)
mkdir -p "$out"
"$PY" models/train_default.py pack --debroot "$work/root" --out "$out/train_v3.npz" --sources v3
# A start for --grow-from (models/README.md, "v4"): the embedded model with a 32-channel
# upsampler. Since v4 it has one, and `narrow` copies it; a wider one would be narrowed.
"$PY" models/train_default.py narrow --weights models/default_x4.safetensors \
  --images "$out/train_v3.npz" --num-feat 32 --out "$out/default_nf32.safetensors"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$out" spandrel==0.4.2
ls -l "$out"
