#!/usr/bin/env bash
# Before/after of one change: two `upscale` binaries (e.g. built from the commit before and
# the commit after, in two worktrees) on the same model and image, alternating rep by rep.
# Prints each rep and the ratio of median wall times (A / B: above 1 means B is faster).
# CPU_TIME=1 times the processes' CPU seconds (user + system, all threads) instead: on a
# machine that other jobs keep busy, wall time mostly measures the queue for the cores.
#
# usage: benches/ab_binaries.sh BIN_A BIN_B MODEL IMAGE [REPS] [extra upscale flags...]
set -euo pipefail
a=${1:?usage: $0 BIN_A BIN_B MODEL IMAGE [REPS] [flags...]}
b=${2:?}
model=${3:?}
image=${4:?}
reps=${5:-5}
shift 5 || shift $#
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ta=(); tb=()
run() {
  local bin=$1 s e
  shift
  if [ -n "${CPU_TIME:-}" ]; then
    /usr/bin/time -f '%U + %S' -o "$work/cpu" \
      "$bin" -m "$model" "$image" -o "$work/out.png" --device cpu --overwrite -q "$@"
    bc -l < "$work/cpu"
    return
  fi
  s=$(date +%s.%N)
  "$bin" -m "$model" "$image" -o "$work/out.png" --device cpu --overwrite -q "$@"
  e=$(date +%s.%N)
  echo "$e - $s" | bc -l
}
for i in $(seq "$reps"); do
  x=$(run "$a" "$@"); y=$(run "$b" "$@")
  ta+=("$x"); tb+=("$y")
  printf 'rep %d: A %.3f s, B %.3f s\n' "$i" "$x" "$y"
done
"$PY" -c 'import statistics, sys
a = [float(v) for v in sys.argv[1].split()]
b = [float(v) for v in sys.argv[2].split()]
ma, mb = statistics.median(a), statistics.median(b)
print("median A %.3f s, median B %.3f s, A/B %.3f" % (ma, mb, ma / mb))' "${ta[*]}" "${tb[*]}"
