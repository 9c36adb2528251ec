#!/usr/bin/env bash
# Build the CUDA binary and the CUDA test binary on this (build) machine and pack them for a GPU
# machine that has no Rust and no network. Together with the repository's tracked files
# (fixtures, test photos, bench scripts), which the GPU run reads in place, the pack stays
# under 64 MiB.
#
# usage: scripts/gpu-pack.sh [PACK]          (default: gpu-pack/, git-ignored)
#   UPSCALE_BASES="LABEL=FILE ..." also packs earlier CUDA builds (FILE: an upscale binary, or
#   upscale.xz from an earlier pack; LABEL: its commit) for gpu-run.sh's before/after part.
#   A bare commit (UPSCALE_BASES="ca9a024 77ac68e") is built here, in a temporary worktree
#   that shares the CUDA target directory (so only the crate itself is recompiled).
#   UPSCALE_PACK_TESTS=0 leaves the CUDA test binary out, which makes room for more earlier
#   builds in a pack meant for the before/after part alone.
# then, on the GPU machine, from the repository root: scripts/gpu-run.sh PACK OUTDIR [part]
set -euo pipefail
cd "$(dirname "$0")/.."
pack=${1:-gpu-pack}
prefix=${UPSCALE_CUDA_PREFIX:-$HOME/.cache/upscale-cuda}
limit_mib=${PACK_LIMIT_MIB:-64}

cargo fetch --quiet
scripts/cuda-toolkit-from-pypi.sh "$prefix" >/dev/null
# shellcheck disable=SC1091
source "$prefix/env.sh"
CARGO_TARGET_DIR=$(realpath -m "${CARGO_TARGET_DIR:-target-cuda}")
export CARGO_TARGET_DIR
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}

cargo build --release --features cuda --bin upscale
# The CUDA tests are unit tests of the library (src/tests/gpu/, named tests::gpu::...), so the
# library's test binary carries them all.
tests=$(cargo test --release --features cuda --lib --no-run --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    j = json.loads(line)
    if j.get("reason") == "compiler-artifact" and j.get("executable") and j["target"]["kind"] == ["lib"]:
        print(j["executable"])')
[ -n "$tests" ] || { echo "no CUDA test binary was built" >&2; exit 1; }

rm -rf "$pack"
mkdir -p "$pack"
strip -o "$pack/upscale" "$CARGO_TARGET_DIR/release/upscale"
xz -T0 -6 "$pack/upscale"
if [ "${UPSCALE_PACK_TESTS:-1}" != 0 ]; then
  strip -o "$pack/gpu-tests" "$tests"
  xz -T0 -6 "$pack/gpu-tests"
fi
# The PyTorch reference builds its model with spandrel (pure Python), which the GPU machine
# lacks; torch, numpy, safetensors and einops are there.
python3 -m pip download -q --no-deps --only-binary=:all: -d "$pack" spandrel==0.4.2
git rev-parse HEAD > "$pack/commit"
for base in ${UPSCALE_BASES:-}; do
  label=${base%%=*} file=${base#*=}
  if [ "$base" = "$label" ]; then
    # A commit: build its binary in a worktree (this checkout's was packed above).
    file=$(mktemp -d)/upscale
    tree=$(mktemp -d)
    git worktree add -q --detach "$tree" "$label"
    (cd "$tree" && cargo build --release --features cuda --bin upscale)
    cp "$CARGO_TARGET_DIR/release/upscale" "$file"
    git worktree remove --force "$tree"
  fi
  case $file in
    *.xz) cp "$file" "$pack/upscale-$label.xz" ;;
    *) strip -o "$pack/upscale-$label" "$file" && xz -T0 -6 "$pack/upscale-$label" ;;
  esac
done

tracked=$(git ls-files -z | du -cb --files0-from=- | tail -n 1 | cut -f 1)
packed=$(du -cb "$pack" | tail -n 1 | cut -f 1)
total=$(( (tracked + packed) / 1048576 ))
ls -l "$pack"
echo "pack $(( packed / 1048576 )) MiB + tracked files $(( tracked / 1048576 )) MiB = $total MiB (limit $limit_mib)"
[ "$total" -lt "$limit_mib" ] || { echo "over the $limit_mib MiB a GPU call can carry" >&2; exit 1; }
