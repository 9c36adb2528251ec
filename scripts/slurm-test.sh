#!/usr/bin/env bash
# `upscale --shard auto` under a real Slurm job array, on a one-node cluster started here.
#
# Installs Debian's slurm-wlm and munge (apt) when missing, so it runs as root on Debian or
# Ubuntu. Starts munged, slurmctld and slurmd from a generated key and slurm.conf (one node,
# no cgroups, all state in a temporary folder) and stops them on exit. Then:
#   1. a folder of 28 small images (PNG, JPEG, WebP, TIFF, mixed sizes, one corrupt file) run
#      by `sbatch --array=0-3 --wait` with `--shard auto --json`: each good input has exactly
#      one output, byte-identical to a one-process run; the corrupt file is reported by one
#      shard, which goes on; no temporary file is left;
#   2. the same array again into a fresh folder, with task 2 cancelled (scancel) in the
#      middle of its shard; then task 2 resubmitted alone (`sbatch --array=2`, N given by
#      UPSCALE_SHARD_COUNT): it skips what it finished before, redoes nothing, and the folder
#      ends byte-identical to the one-process run;
#   3. `upscale report` over each phase's logs.
#
# Usage: scripts/slurm-test.sh [BINARY]   (default target/release/upscale; build it first)
# UPSCALE_SLURM_KEEP=1 keeps the work folder for a look afterwards.
# Exit codes: 0 passed; 77 the cluster cannot be had here (not root, or the packages cannot be
# installed), so nothing was tested; anything else a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bin=$(realpath "${1:-target/release/upscale}")
[ -x "$bin" ] || { echo "no binary at $bin: cargo build --release first" >&2; exit 1; }

say() { echo "== $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
unavailable() { echo "slurm-test: cannot run here: $*" >&2; exit 77; }

# --- packages -------------------------------------------------------------------------------
missing=()
for cmd in slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge; do
  command -v "${cmd%%:*}" >/dev/null 2>&1 || missing+=("${cmd#*:}")
done
# Pillow writes the test images; any python3 that has it will do.
py=""
for p in python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c "import PIL" 2>/dev/null; then py=$p; break; fi
done
[ -n "$py" ] || { missing+=(python3-pil); py=/usr/bin/python3; }
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || unavailable "needs root to install ${missing[*]} (or install them first)"
  command -v apt-get >/dev/null 2>&1 || unavailable "no apt-get to install ${missing[*]}"
  say "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update >/dev/null 2>&1 &&
      apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; } ||
    unavailable "apt-get could not install ${missing[*]}"
fi
[ "$(id -u)" = 0 ] || unavailable "slurmd runs jobs as root here: run this script as root"

# --- the cluster ----------------------------------------------------------------------------
w=$(mktemp -d -t upscale-slurm.XXXXXX)
chmod 700 "$w"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "${UPSCALE_SLURM_KEEP:-0}" = 1 ]; then echo "work folder kept: $w"; else rm -rf "$w"; fi
}
trap cleanup EXIT

free_port() {
  local port
  for port in $(seq "$1" $(( $1 + 200 ))); do
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "$port"; return; fi
  done
  fail "no free port from $1"
}
ctld_port=$(free_port 16817)
slurmd_port=$(free_port $(( ctld_port + 1 )))
node=$(hostname -s)
mkdir -p "$w/state" "$w/spool" "$w/logs"

say "munged, slurmctld, slurmd (ports $ctld_port, $slurmd_port, node $node)"
dd if=/dev/urandom of="$w/munge.key" bs=1024 count=1 status=none
chmod 400 "$w/munge.key"
munged --foreground --force --key-file="$w/munge.key" --socket="$w/munge.sock" \
  --pid-file="$w/munged.pid" --log-file="$w/munged.log" --seed-file="$w/munged.seed" \
  >"$w/munged.out" 2>&1 &
pids+=($!)

# Four CPUs on the node whatever the machine has (config_overrides), so that all four array
# tasks run at once, as on four nodes.
cat >"$w/slurm.conf" <<EOF
ClusterName=upscale-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$w/munge.sock
StateSaveLocation=$w/state
SlurmdSpoolDir=$w/spool
SlurmctldPidFile=$w/slurmctld.pid
SlurmdPidFile=$w/slurmd.pid
SlurmctldLogFile=$w/slurmctld.log
SlurmdLogFile=$w/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MailProg=/bin/true
NodeName=$node NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=test Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$w/slurm.conf
for _ in $(seq 50); do [ -S "$w/munge.sock" ] && break; sleep 0.1; done
[ -S "$w/munge.sock" ] || { cat "$w/munged.out" "$w/munged.log" 2>/dev/null; fail "munged did not start"; }
slurmctld -D -i -f "$w/slurm.conf" >"$w/slurmctld.out" 2>&1 &
pids+=($!)
slurmd -D -f "$w/slurm.conf" -N "$node" >"$w/slurmd.out" 2>&1 &
pids+=($!)
for _ in $(seq 120); do
  state=$(sinfo -h -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.5
done
[ "$state" = idle ] || { tail -n 20 "$w"/slurm*.log "$w"/slurm*.out; fail "node not idle (state '$state')"; }
say "cluster up after $(( $(date +%s) - start )) s"

# --- the images -----------------------------------------------------------------------------
# Names sort as numbered, so file i goes to shard i mod 4. Shard 2's images are larger, so
# that its task is still working when phase 2 cancels it.
"$py" - "$w/in" <<'EOF'
import sys, pathlib
from PIL import Image
root = pathlib.Path(sys.argv[1]); root.mkdir()
exts = ["png", "jpg", "webp", "tiff"]
for i in range(28):
    w, h = (96, 72) if i % 4 == 2 else (16 + 4 * (i % 5), 12 + 3 * (i % 3))
    img = Image.new("RGB", (w, h))
    img.putdata([((x * 7 + i * 13) % 256, (y * 11 + x * 3) % 256, (x * y + i) % 256)
                 for y in range(h) for x in range(w)])
    ext = exts[i % 4] if i % 4 != 2 else exts[(i // 4) % 4]
    path = root / f"img{i:02d}.{ext}"
    img.save(path, **({"quality": 90} if ext in ("jpg", "webp") else {}))
# The corrupt file takes slot 5 (shard 1): a PNG cut in half.
path = root / "img05.png"
for p in root.glob("img05.*"):
    p.unlink()
Image.new("RGB", (20, 15), (200, 10, 10)).save(path)
data = path.read_bytes(); path.write_bytes(data[: len(data) // 2])
EOF
ls "$w/in" | sed -n '1,3p;$p' | tr '\n' ' '; echo "($(ls "$w/in" | wc -l) files)"

# The one-process run that every shard's output must match.
say "one process, no shard"
t=$(date +%s)
"$bin" "$w/in" -o "$w/ref" --device cpu --json >"$w/ref.jsonl" 2>"$w/ref.err" || true
echo "one-process run: $(( $(date +%s) - t )) s"

cat >"$w/job.sh" <<EOF
#!/bin/bash
exec "$bin" "$w/in" -o "\$OUT" --device cpu --shard auto --json -v
EOF
chmod +x "$w/job.sh"

check() {
  # check OUT_DIR LOG_GLOB...: the folder against ref, and the corrupt file reported once.
  "$py" - "$w" "$@" <<'EOF'
import sys, json, pathlib, filecmp
w = pathlib.Path(sys.argv[1]); out = w / sys.argv[2]; logs = sys.argv[3:]
ref = {p.relative_to(w / "ref") for p in (w / "ref").rglob("*") if p.is_file()}
got = {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
temps = [p for p in got if ".upscale-tmp-" in p.name]
assert not temps, f"temporaries left: {temps}"
good = {p for p in pathlib.Path(w / "in").iterdir() if p.name != "img05.png"}
assert len(ref) == len(good) == 27, (len(ref), len(good))
assert got == ref, f"outputs differ from the one-process run's: {sorted(got ^ ref)}"
for p in sorted(ref):
    assert filecmp.cmp(w / "ref" / p, out / p, shallow=False), f"{p} differs"
errors, oks = [], []
for log in logs:
    for line in open(log):
        r = json.loads(line)
        if r.get("status") == "error": errors.append((log, r["input"]))
        if r.get("status") == "ok": oks.append(r["input"])
assert [e[1].endswith("img05.png") for e in errors] == [True], f"corrupt file reports: {errors}"
assert len(oks) == len(set(oks)), "an image was written twice"
print(f"{len(got)} outputs byte-identical to the one-process run; img05.png reported once"
      f" ({pathlib.Path(errors[0][0]).name}); no temporary")
EOF
}

# --- phase 1: the whole array ---------------------------------------------------------------
say "phase 1: sbatch --array=0-3 --wait, --shard auto"
t=$(date +%s)
# The task with the corrupt file exits 1, so --wait does too.
OUT=$w/out1 sbatch --array=0-3 --wait --quiet --cpus-per-task=1 \
  -o "$w/logs/p1_%a.jsonl" -e "$w/logs/p1_%a.err" "$w/job.sh" || true
echo "array run: $(( $(date +%s) - t )) s"
for k in 0 1 2 3; do
  grep -q "Slurm (SLURM_ARRAY_TASK_ID=$k of array 0-3 (4 tasks)): shard $k/4" "$w/logs/p1_$k.err" ||
    { cat "$w/logs/p1_$k.err"; fail "task $k did not log its shard"; }
done
check out1 "$w"/logs/p1_?.jsonl
"$py" - "$w"/logs/p1_?.jsonl <<'EOF'
import sys, json
for log in sys.argv[1:]:
    s = [json.loads(l) for l in open(log) if '"summary"' in l][0]
    print(f"  shard {s['shard']}: {s['done']} done, {s['failed']} failed, {s['skipped']} skipped")
    assert s["done"] + s["failed"] == 7, s
EOF
"$bin" report "$w"/logs/p1_?.jsonl | sed 's/^/  report: /' || true

# --- phase 2: a task cancelled midway, then resubmitted alone -------------------------------
say "phase 2: the array again, task 2 cancelled midway"
job=$(OUT=$w/out2 sbatch --array=0-3 --parsable --cpus-per-task=1 \
  -o "$w/logs/p2_%a.jsonl" -e "$w/logs/p2_%a.err" "$w/job.sh")
job=${job%%;*}
shard2=(02 06 10 14 18 22 26)
done2() { local n=0 f; for i in "${shard2[@]}"; do for f in "$w/out2/img$i".*; do [ -e "$f" ] && n=$((n + 1)); done; done; echo $n; }
for _ in $(seq 1200); do [ "$(done2)" -ge 2 ] && break; sleep 0.1; done
before_cancel=$(done2)
scancel "${job}_2"
for _ in $(seq 600); do [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break; sleep 0.2; done
[ -z "$(squeue -h -j "$job")" ] || fail "array $job still running"
kept=$(done2)
echo "task 2 cancelled with $before_cancel of its 7 outputs written ($kept after it stopped)"
[ "$kept" -lt 7 ] || fail "task 2 finished before it was cancelled: make its images larger"
grep -q '"summary"' "$w/logs/p2_2.jsonl" && fail "the cancelled task wrote a summary"
"$py" -c 'import os, sys, json; d = sys.argv[1]; json.dump({n: [os.stat(os.path.join(d, n)).st_size, os.stat(os.path.join(d, n)).st_mtime_ns] for n in os.listdir(d) if not n.startswith(".")}, open(sys.argv[2], "w"))' "$w/out2" "$w/before_rerun.json"
find "$w/out2" -name '.*upscale-tmp-*' >"$w/temps_after_cancel.txt"
[ -s "$w/temps_after_cancel.txt" ] && echo "note: the cancelled task left $(wc -l <"$w/temps_after_cancel.txt") temporary (a run removes those of its outputs after 10 minutes)"

say "phase 2: sbatch --array=2 alone, UPSCALE_SHARD_COUNT=4"
OUT=$w/out2 sbatch --array=2 --wait --quiet --cpus-per-task=1 --export=ALL,UPSCALE_SHARD_COUNT=4 \
  -o "$w/logs/p2_rerun.jsonl" -e "$w/logs/p2_rerun.err" "$w/job.sh" ||
  { cat "$w/logs/p2_rerun.err"; fail "the resubmitted task failed"; }
grep -q "SLURM_ARRAY_TASK_ID=2 of array 2-2 (1 tasks)): shard 2/4" "$w/logs/p2_rerun.err" ||
  { cat "$w/logs/p2_rerun.err"; fail "the resubmitted task did not take shard 2/4"; }
# Temporaries the killed task left are the only ones allowed (they are not a final name).
find "$w/out2" -name '.*upscale-tmp-*' | sort | comm -23 - <(sort "$w/temps_after_cancel.txt") |
  grep . && fail "temporaries left by the re-run"
find "$w/out2" -name '.*upscale-tmp-*' -delete
check out2 "$w"/logs/p2_?.jsonl "$w/logs/p2_rerun.jsonl"
"$py" - "$w" "$kept" <<'EOF'
import sys, json, pathlib
w = pathlib.Path(sys.argv[1]); kept = int(sys.argv[2])
lines = [json.loads(l) for l in open(w / "logs/p2_rerun.jsonl")]
summary = [l for l in lines if l.get("summary")][0]
redone = [l["input"] for l in lines if l.get("status") == "ok"]
first = [json.loads(l)["input"] for l in open(w / "logs/p2_2.jsonl") if '"ok"' in l]
assert summary["skipped"] == kept, (summary, kept)
assert summary["done"] == 7 - kept and summary["failed"] == 0, summary
assert not set(redone) & set(first), f"redone: {set(redone) & set(first)}"
# Files written before the cancel were not touched (same mtime and size).
import os
for name, stat in json.load(open(w / "before_rerun.json")).items():
    st = os.stat(w / "out2" / name)
    assert [st.st_size, st.st_mtime_ns] == stat, f"{name} was rewritten"
print(f"re-run: {summary['skipped']} skipped (written before the cancel, untouched), "
      f"{summary['done']} done, none redone")
EOF
"$bin" report --json "$w"/logs/p2_?.jsonl "$w/logs/p2_rerun.jsonl" >"$w/report.json" || true
"$py" - "$w/report.json" <<'EOF'
import sys, json
r = json.load(open(sys.argv[1]))
assert r["unfinished_logs"] and r["unfinished_logs"][0].endswith("p2_2.jsonl"), r
assert r["missing_shards"] == {} and r["redone"] == [] and r["done"] == 27, r
assert [f["input"].endswith("img05.png") for f in r["failed"]] == [True], r
print(f"report: {r['done']} done, {r['skipped']} skipped, failed {[f['input'] for f in r['failed']]}, "
      f"no shard missing, unfinished log {r['unfinished_logs']}")
EOF

say "passed in $(( $(date +%s) - start )) s"
