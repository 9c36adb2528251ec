#!/usr/bin/env bash
# How cost grows with input size on the CPU: benches/cpu_vs_torch.sh (whole-process upscale
# against PyTorch's warm forward, alternating reps) for each square input size, in fp32 and
# bf16, then one table of seconds per output megapixel (DRCT x4 shape, random weights).
#
# usage: benches/cpu_scaling.sh [REPS] [SIZES...]      (default: 3 reps; 64 128 256)
# needs: what benches/cpu_vs_torch.sh needs (PYTHON=... with torch and spandrel)
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
shift || true
SIZES=("${@:-64 128 256}")
read -r -a SIZES <<< "${SIZES[*]}"
rows=()
for size in "${SIZES[@]}"; do
  for precision in fp32 bf16; do
    line=$(PRECISION=$precision benches/cpu_vs_torch.sh "$REPS" drct "$size" | tail -n 1)
    echo "$line"
    rows+=("$line")
  done
done
printf '%s\n' "${rows[@]}" > "${TMPDIR:-/tmp}/cpu_scaling.jsonl"
"${PYTHON:-python3}" - "${TMPDIR:-/tmp}/cpu_scaling.jsonl" <<'PYEOF'
import json, sys
print("| input | output MP | precision | upscale s | upscale s/MP | PyTorch s | PyTorch s/MP | ratio |")
print("|---|---|---|---|---|---|---|---|")
for line in open(sys.argv[1]):
    r = json.loads(line)
    n = r["input"][0]
    mp = (4 * n) ** 2 / 1e6
    ours, theirs = r["upscale_median_s"], r["pytorch_median_s"]
    print(f"| {n}x{n} | {mp:.3f} | {r['precision']} | {ours:.3f} | {ours / mp:.2f} | "
          f"{theirs:.3f} | {theirs / mp:.2f} | {r['ratio_pytorch_over_upscale']:.2f} |")
PYEOF
