#!/usr/bin/env bash
# nvcc for CI's CUDA build (set as $NVCC, which candle's build and ours both honour): our
# kernels (kernels/) compile exactly as in a release build, while the CUDA sources of
# dependencies (candle's quantized and MoE kernels, about a quarter of the step's compile
# work) skip device-code optimisation. CI only needs those compiled and linked, never run:
# every flag is still parsed and every source still compiled to PTX and SASS, about 2.3x
# faster.
set -euo pipefail
real=${UPSCALE_REAL_NVCC:-${CUDA_HOME:?set CUDA_HOME or UPSCALE_REAL_NVCC}/bin/nvcc}
ours="$(cd "$(dirname "$0")/.." && pwd)/kernels/"
dependency=0
for arg in "$@"; do
  case $arg in
    *.cu)
      case $(realpath -m -- "$arg") in
        "$ours"*) ;;
        *) dependency=1 ;;
      esac
      ;;
  esac
done
if [ "$dependency" = 1 ]; then
  exec "$real" "$@" -Xcicc -O0 -Xptxas -O0
fi
exec "$real" "$@"
