#!/usr/bin/env bash
# nvcc for CI's CUDA check (set as $NVCC, which candle's build and ours both honour).
#
# Our kernels (kernels/) compile exactly as in a release build: build.rs assembles them to
# SASS, so a malformed instruction fails CI.
#
# The CUDA sources of dependencies (candle's elementwise PTX, its quantized and MoE static
# library) are not compiled at all: each output nvcc would write is left empty (an empty
# archive for `--lib`). CI type-checks with them and links its CUDA test binaries against them
# but runs nothing on a GPU; compiling them took about 3.5 minutes of the step. A build meant
# to run (a release binary, the GPU pack) must use the real nvcc, never this script.
set -euo pipefail
real=${UPSCALE_REAL_NVCC:-${CUDA_HOME:?set CUDA_HOME or UPSCALE_REAL_NVCC}/bin/nvcc}
ours="$(cd "$(dirname "$0")/.." && pwd)/kernels/"
dependency=0
lib=0
out=
odir=
src=
prev=
for arg in "$@"; do
  case $prev in
    -o) out=$arg ;;
    --output-directory | -odir) odir=$arg ;;
  esac
  case $arg in
    --lib | -lib) lib=1 ;;
    *.cu)
      src=$arg
      case $(realpath -m -- "$arg") in
        "$ours"*) ;;
        *) dependency=1 ;;
      esac
      ;;
  esac
  prev=$arg
done
# `--ptx --output-directory DIR x.cu` writes DIR/x.ptx.
if [ -z "$out" ] && [ -n "$odir" ] && [ -n "$src" ]; then
  out="$odir/$(basename "$src" .cu).ptx"
fi
# A library made of the objects written below: every input object is an empty stub.
if [ "$lib" = 1 ] && [ -n "$out" ]; then
  stubs=1
  for arg in "$@"; do
    case $arg in *.o) [ -s "$arg" ] && stubs=0 ;; esac
  done
  if [ "$stubs" = 1 ]; then
    printf '!<arch>\n' >"$out"
    exit 0
  fi
fi
if [ "$dependency" = 1 ]; then
  [ -n "$out" ] || { echo "ci-nvcc.sh: no -o in: $*" >&2; exit 2; }
  mkdir -p "$(dirname "$out")"
  : >"$out"
  exit 0
fi
exec "$real" "$@"
