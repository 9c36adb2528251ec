#!/usr/bin/env bash
# Where the GPU time of one `upscale bench` goes: every kernel's duration (Nsight Compute, one
# metric, so one replay per kernel), summed by kernel name, against the run's wall time.
#
#   scripts/gpu-profile.sh PACK OUTDIR PRESET [upscale bench flags...]     (PRESET: drct | drct-l)
#   UPSCALE_BIN=upscale-COMMIT profiles an earlier build of the pack instead (gpu-pack.sh's
#   UPSCALE_BASES), for a kernel-by-kernel before/after in the same session.
#
# On the GPU machine, from the repository root, with the folder scripts/gpu-pack.sh made.
# Writes OUTDIR/kernels.csv (ncu's raw rows) and OUTDIR/profile.md (the table), then profiles
# the first five window-attention launches (a group's five blocks: every head-dim variant of
# the released models) with Nsight Compute's throughput, occupancy and stall sections, to
# OUTDIR/attention.csv and OUTDIR/attention.md: what bounds the kernel.
set -uo pipefail
cd "$(dirname "$0")/.."
pack=${1:?usage: $0 PACK OUTDIR PRESET [bench flags...]}
out=${2:?}
preset=${3:?}
shift 3
PY=${PYTHON:-python3}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=scripts/cuda-runtime-libs.sh
. scripts/cuda-runtime-libs.sh
# The weights are made with spandrel (pure Python), which the GPU machine lacks.
wheel=$(ls "$pack"/spandrel-*.whl 2>/dev/null | head -n 1)
[ -n "$wheel" ] && "$PY" -m pip install -q --no-index --no-deps --target "$work/site" "$wheel" >/dev/null 2>&1 &&
  export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
  "$pack/${UPSCALE_BIN:-upscale}.xz" "$work/upscale"
chmod +x "$work/upscale"
"$PY" benches/torch_drct.py make-weights "$work/w.safetensors" --preset "$preset" --scale 4 --seed 0 >/dev/null
bench=("$work/upscale" bench -m "$work/w.safetensors" --device cuda --json "$@")
"${bench[@]}" > "$out/bench_plain.json"
ncu --metrics gpu__time_duration.sum --csv --print-units base --log-file "$out/kernels.csv" \
  "${bench[@]}" > "$out/bench_under_ncu.json"
"$PY" scripts/kernel_profile.py "$out/kernels.csv" "$out/bench_plain.json" "$*" > "$out/profile.md"
cat "$out/profile.md"

ncu --kernel-name regex:window_attention --launch-count 5 --section SpeedOfLight \
  --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --csv --page details --print-units base \
  --log-file "$out/attention.csv" "${bench[@]}" > /dev/null
"$PY" - "$out/attention.csv" > "$out/attention.md" <<'PYEOF'
import csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
kernel = None
for r in rows:
    name = f'{r["Kernel Name"].split("(")[0]} (block {r.get("Block Size", "?")}, grid {r.get("Grid Size", "?")})'
    if r.get("ID") != kernel:
        kernel = r.get("ID")
        print(f"\n### `{name}`\n\n| section | metric | value |\n|---|---|---|")
    unit = r.get("Metric Unit", "")
    print(f'| {r["Section Name"]} | {r["Metric Name"]} | {r["Metric Value"]} {unit} |')
PYEOF
cat "$out/attention.md"
