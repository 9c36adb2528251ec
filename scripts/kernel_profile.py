#!/usr/bin/env python3
"""Nsight Compute's per-kernel times (scripts/gpu-profile.sh) as a Markdown table of one forward.

usage: kernel_profile.py KERNELS.csv BENCH.json "BENCH FLAGS"

The profiled process loads the model first (every weight cast to the run's dtype on the GPU:
about 900 small kernels for DRCT-L) and may run a warm-up forward that fills caches. With
`--reps 2` or more, the last forward repeats the one before it launch for launch; the table
counts that last forward alone, and says how many kernels came before it. Without such a
repeat it counts every kernel, and says so.
"""

import csv
import json
import sys
from collections import defaultdict


def launches(path):
    rows = [r for r in csv.DictReader(l for l in open(path) if l.startswith('"'))]
    out = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        out.append((int(r["ID"]), r["Kernel Name"].split("(")[0][:90],
                    float(r["Metric Value"].replace(",", "")) * 1e-9))
    out.sort()
    return [(name, t) for _, name, t in out]


def last_period(names):
    """The length of the longest tail that repeats right before itself, or 0."""
    n = len(names)
    for k in range(n // 2, 0, -1):
        if names[n - k:] == names[n - 2 * k:n - k]:
            return k
    return 0


def main(csv_path, bench_path, flags):
    seq = launches(csv_path)
    k = last_period([name for name, _ in seq])
    # A forward is hundreds of launches; a short period is a repeat inside one, not a forward.
    one = seq[len(seq) - k:] if k >= 50 else seq
    per = defaultdict(lambda: [0, 0.0])
    for name, t in one:
        per[name][0] += 1
        per[name][1] += t
    total = sum(t for _, t in per.values())
    bench = json.load(open(bench_path))
    print(f"bench flags: {flags}\n")
    if one is not seq:
        print(f"one forward: {len(one)} kernels, GPU time {total:.4f} s (the last of "
              f"{bench.get('warmup', 0) + bench.get('reps', 0)} runs; {len(seq) - len(one)} "
              f"kernels before it: the model's load, caches and the earlier runs); plain run "
              f"median {bench.get('median_s')} s per run\n")
    else:
        print(f"every kernel of the process (no forward repeated, so the model's load is "
              f"included): {len(seq)} kernels, GPU time {total:.4f} s; plain run median "
              f"{bench.get('median_s')} s per run\n")
    print("| kernel | launches | GPU s | share |\n|---|---|---|---|")
    for name, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"| `{name}` | {c} | {t:.4f} | {t / total:.1%} |")


if __name__ == "__main__":
    main(*sys.argv[1:4])
