#!/usr/bin/env bash
# Everything a GPU session must prove and measure, in one command on the GPU machine (which has
# no Rust and no network), from the repository root, with the folder scripts/gpu-pack.sh made:
#
#   scripts/gpu-run.sh PACK OUTDIR [proof|check|bench|matrix|ab|all|steps STEP...]   on the GPU machine (default: all)
#   scripts/gpu-run.sh --smoke PACK OUTDIR [part]        any machine, CPU, tiny shapes (CI)
#
# proof: the one call for a session with a few minutes of device time. The issue's evidence in
#   the order it is needed (the CUDA tests; a probe that, if our kernels fail on the GPU,
#   picks the fallback every later step runs with; precision parity; the speed switches
#   (UPSCALE_CUDA_PINNED, UPSCALE_PAD_CHANNELS off, 8 and 64 against the default 16: each
#   held to the CPU, then timed); the side by side with PyTorch, eager and torch.compile,
#   and the matmul peak for utilisation; SwinIR-M and HAT-L against the same; the
#   sanitizers; folder runs; ESRGAN, Compact, SPAN and DAT; DRCT-L at 1080p; a
#   kernel-by-kernel profile; cudarc's event tracking on; a round of before/after against
#   the earlier builds in the pack, if any; streams; the start-up cost of the driver
#   compiling PTX, with our SASS and without; rows of the precision x batch matrix), each
#   step given at most
#   what is left of UPSCALE_PROOF_BUDGET_S seconds (default 520) and skipped, with a line
#   saying so, when its least useful time is no longer left. Give the device call about 80 s
#   more than the budget (a 10-minute call for the default).
# check: device facts, the measured matmul peaks, the CUDA test binary (and our kernels under
#   compute-sanitizer), bf16 and fp16 against fp32 (PSNR) on tests/photos, DRCT-L bf16 on
#   1920x1080 with the automatic tile.
# bench: DRCT-L x4 960x540 and DRCT x4 640x480 against the PyTorch reference, eager and
#   torch.compile, on the same GPU in the same run; DRCT-L's GEMMs at their real shapes and
#   the body's memory floor (benches/gemm_shapes.py); the speed switches; streams 1/2/4 on one image and on a folder (GPU utilisation sampled by
#   nvidia-smi).
# matrix: precision x batch x attention for DRCT-L, and tile 512.
# ab: the earlier builds in the pack (scripts/gpu-pack.sh with UPSCALE_BASES) against upscale,
#   in turns, on the side-by-side shapes (not part of all).
# rest: the steps of all that proof does not run (the GEMM shapes, streams 4, the whole
#   matrix): CI's smoke runs proof and rest, which together run every step once.
# steps STEP...: the probe, then the named steps (a function of this script and its arguments,
#   one argument each: steps "conv_family 3" "sanitizers 120 90") under proof's budget; for a
#   second call on a machine still warm from the first, with what the first left out.
# Each part is planned to finish inside one 10-minute call. With only minutes of device time,
# run proof alone; with more, check first (if it fails, fix that before measuring anything).
# Every step's output goes to OUTDIR/logs/<step>.log (packed into OUTDIR/logs.tar.gz on the
# GPU machine, which returns few files); each measurement is one JSON line in
# OUTDIR/results.jsonl; OUTDIR/summary.md tabulates them. A failing step is recorded and the
# run goes on. With --smoke, PACK may name a folder holding a CPU build's `upscale`.
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=0
if [ "${1:-}" = --smoke ]; then
  smoke=1
  shift
fi
pack=${1:?usage: $0 [--smoke] PACK OUTDIR [proof|check|bench|matrix|ab|rest|all]}
out=${2:?usage: $0 [--smoke] PACK OUTDIR [proof|check|bench|matrix|ab|rest|all]}
part=${3:-all}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results="$out/results.jsonl"
logs="$out/logs"
mkdir -p "$logs"
: > "$results"
PY=${PYTHON:-python3}
export UPSCALE_REPO=$PWD

unpack() { # PACK/NAME(.xz) -> an executable path
  if [ -f "$pack/$1.xz" ]; then
    if command -v xz >/dev/null; then
      xz -dc "$pack/$1.xz" > "$work/$1"
    else
      "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$pack/$1.xz" "$work/$1"
    fi
    chmod +x "$work/$1" && echo "$work/$1"
  elif [ -x "$pack/$1" ]; then
    echo "$pack/$1"
  fi
}
up=$(unpack upscale)
tests=$(unpack gpu-tests)
[ -n "$up" ] || { echo "no upscale binary in $pack" >&2; exit 2; }

if [ "$smoke" = 1 ]; then
  device=cpu
else
  device=cuda
  # shellcheck source=scripts/cuda-runtime-libs.sh
  . scripts/cuda-runtime-libs.sh
  # candle's kernels (and ours in earlier builds, or with UPSCALE_CUDA_OFF=sass) ship as PTX,
  # which the driver compiles for the GPU when a process first loads them (about 8 s of
  # ptxas for our attention kernels): every process of this run must find the driver's
  # compile cache, so only the first pays.
  if [ -z "${CUDA_CACHE_PATH:-}" ] && ! { mkdir -p "$HOME/.nv/ComputeCache" && [ -w "$HOME/.nv/ComputeCache" ]; } 2>/dev/null; then
    export CUDA_CACHE_PATH="$work/cuda-cache"
  fi
  export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-1073741824}
fi
have_torch=0
if "$PY" -c 'import torch' 2>/dev/null; then
  have_torch=1
  wheel=$(ls "$pack"/spandrel-*.whl 2>/dev/null | head -n 1)
  if [ -n "$wheel" ]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$work/site" "$wheel" >/dev/null 2>&1 &&
      export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi

record() { # STEP JSON-OBJECT-OR-TEXT [extra JSON fields]
  local step=$1 body=$2 extra=${3:-}
  case $body in
    \{*) ;;
    *) body=$("$PY" -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$body") ;;
  esac
  echo "{\"step\":\"$step\",${extra:+$extra,}\"result\":$body}" >> "$results"
}

# A deadline (the proof part's): every limit below is cut to the time left before it.
deadline=
left() { echo $(( deadline - $(date +%s) )); }
cap() { # SECONDS -> SECONDS, or what is left before the deadline if that is less
  if [ -n "$deadline" ] && [ "$(left)" -lt "$1" ]; then
    local l
    l=$(left)
    echo $(( l > 1 ? l : 1 ))
  else
    echo "$1"
  fi
}
# fits STEP SECONDS [extra JSON fields]: whether at least SECONDS are left for STEP; if not, a
# line says it was skipped, so the summary shows what the budget left out.
fits() {
  if [ -z "$deadline" ] || [ "$(left)" -ge "$2" ]; then
    return 0
  fi
  record "$1" "skipped: needs ${2} s, $(left) s of the budget left" "${3:-}"
  return 1
}

# run STEP SECONDS CMD...: the command's output to OUTDIR/STEP.log, its status recorded.
run() {
  local step=$1 limit
  limit=$(cap "$2")
  shift 2
  local t0 t1 status
  t0=$(date +%s.%N)
  timeout "$limit" "$@" >> "$logs/$step.log" 2>&1
  status=$?
  t1=$(date +%s.%N)
  echo "{\"step\":\"$step\",\"status\":$status,\"wall_s\":$(awk "BEGIN {print $t1 - $t0}")}" >> "$results"
  return $status
}

# bench STEP LABEL MODEL ARGS...: one `upscale bench --json` line into the results.
bench() {
  local step=$1 label=$2 model=$3
  shift 3
  local line attn_arg=()
  # The probe's attention unless the step names one.
  [[ " $* " == *" --attention "* ]] || attn_arg=(--attention "$attn")
  line=$(timeout "$(cap 240)" "$up" bench -m "$model" --device "$device" --json "${peak[@]}" "${attn_arg[@]}" "$@" 2>> "$logs/$step.log" | tail -n 1)
  if [ -n "$line" ]; then
    record "$step" "$line" "\"label\":\"$label\",\"args\":\"$*\""
  else
    record "$step" "failed: $*" "\"label\":\"$label\""
  fi
}

# Models: random weights of the published shapes (seeded, the same file for both programs)
# where PyTorch is there to make them; the smallest golden fixture otherwise (smoke).
models() {
  if [ "$smoke" = 1 ] || [ "$have_torch" = 0 ]; then
    drct=tests/golden/x2_w8_b2.safetensors
    drct_l=$drct
    drct_scale=2
  else
    drct_scale=4
    drct="$work/drct.safetensors"
    drct_l="$work/drct-l.safetensors"
    [ -f "$drct" ] || "$PY" benches/torch_drct.py make-weights "$drct" --preset drct --scale 4 --seed 0 >> "$logs/weights.log" 2>&1
    [ -f "$drct_l" ] || "$PY" benches/torch_drct.py make-weights "$drct_l" --preset drct-l --scale 4 --seed 0 >> "$logs/weights.log" 2>&1
  fi
}

# Sizes: the GPU run's, or tiny ones for the smoke run.
if [ "$smoke" = 1 ]; then
  s1080=40x72 s540=24x40 s480=24x32 t256=16 t512=24 ov=4 reps=1
else
  s1080=1080x1920 s540=540x960 s480=480x640 t256=256 t512=512 ov=32 reps=5
fi
peak=()

# The GPU's bf16/fp16/tf32 matmul rate, measured once per OUTDIR; bench gets --peak_tflops.
measure_peak() {
  if [ ! -f "$out/peak.json" ]; then
    if [ "$have_torch" = 1 ] && [ "$smoke" = 0 ]; then
      run peak 120 "$PY" benches/matmul_peak.py --json "$out/peak.json"
      [ -f "$out/peak.json" ] && record peak "$(cat "$out/peak.json")"
    else
      record peak "skipped: needs PyTorch and a GPU"
    fi
  fi
  if [ -f "$out/peak.json" ]; then
    peak=(--peak_tflops "$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["bf16_tflops"])' "$out/peak.json")")
  fi
}

facts() {
  echo "== facts"
  { nvidia-smi || true; nvidia-smi -q -d CLOCK,MEMORY,POWER || true; uname -a; nproc; } > "$logs/facts.log" 2>&1
  record facts "$(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi ($device run)")"
  # Which build every number below belongs to.
  record build "$(cat "$pack/commit" 2>/dev/null || echo "unknown (no commit file in the pack)")"
  # What the binary says it was built for; a library it cannot load shows here first.
  record binary "$("$up" --version 2>&1 | sed -n 2p)"
}

cuda_tests() { # [SECONDS]
  echo "== CUDA tests"
  if [ -n "$tests" ]; then
    # Our kernels themselves, whatever the probe (which `steps` runs first) turned off.
    run tests "${1:-300}" env -u UPSCALE_CUDA_OFF "$tests" tests::gpu:: --test-threads=1 --nocapture
    record tests "$(grep -E '^test result|passed|FAILED|panicked' "$logs/tests.log" | tail -n 20)"
  else
    record tests "no test binary in the pack"
  fi
}

sanitizers() { # [memcheck seconds] [racecheck seconds]
  echo "== memcheck of our kernels"
  if [ -n "$tests" ] && [ "$smoke" = 0 ] && command -v compute-sanitizer >/dev/null; then
    if fits memcheck 60; then
      # Our kernels themselves, whatever the probe turned off for the measurements.
      run memcheck "${1:-240}" env -u UPSCALE_CUDA_OFF compute-sanitizer --tool memcheck --error-exitcode 1 "$tests" \
        fused_kernel_matches_the_cpu_in_f32 tensor_core_kernel_matches_the_cpu_in_bf16_and_f16 \
        cuda_blend_kernel_matches_the_host_accumulator tests::gpu::rowwise:: tests::gpu::epilogue:: \
        --test-threads=1
      record memcheck "$(grep -E 'ERROR SUMMARY|test result' "$logs/memcheck.log" | tail -n 4)"
    fi
    # Shared-memory hazards of the two attention kernels (the CPU check's ThreadSanitizer run
    # sees missing barriers; this sees what the warps really do).
    if fits racecheck 60; then
      run racecheck "${2:-180}" env -u UPSCALE_CUDA_OFF compute-sanitizer --tool racecheck --error-exitcode 1 "$tests" \
        fused_kernel_matches_the_cpu_in_f32 tensor_core_kernel_matches_the_cpu_in_bf16_and_f16 \
        --test-threads=1
      record racecheck "$(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|test result' "$logs/racecheck.log" | tail -n 4)"
    fi
  else
    record memcheck "skipped: needs the CUDA test binary and compute-sanitizer"
  fi
}

parity() { # ATTENTION...: bf16 and fp16 against fp32 on tests/photos with each attention kernel
  echo "== precision parity on tests/photos"
  local ref="$work/ref-fp32" photos=tests/photos p a line
  if [ "$smoke" = 1 ]; then
    photos="$work/photos"
    mkdir -p "$photos"
    cp tests/photos/astronaut.png "$photos/"
  fi
  run psnr_ref 300 "$up" --device "$device" --precision fp32 -q --overwrite "$photos" -o "$ref"
  for p in bf16 fp16; do
    for a in "$@"; do
      line=$(timeout "$(cap 300)" "$up" eval --device "$device" --precision "$p" --attention "$a" --hr "$ref" --lr "$photos" --scale 4 --json 2>> "$logs/psnr.log" | tail -n 1)
      record psnr "${line:-failed}" "\"precision\":\"$p\",\"attention\":\"$a\",\"against\":\"fp32\""
    done
  done
}

# The attention kernel and the UPSCALE_CUDA_OFF parts (src/switches/cuda_off.rs) every later
# step runs with: ours, unless the first real runs show one of them broken. Then the first
# fallback that works is taken and exported, so that a short call still measures the rest;
# the CUDA tests' log says which kernel failed.
attn=tensor-core
probe() {
  echo "== probe: the default model on a photo and DRCT-L, GPU against the CPU"
  local dir="$work/probe" cfg a off tried=""
  mkdir -p "$dir/photo" "$dir/small"
  cp tests/photos/coffee.png "$dir/photo/"
  cp tests/fixtures/metrics/resize_quarter_in.png "$dir/small/"
  if ! run probe_ref 120 "$up" --device cpu --precision fp32 -q --overwrite "$dir/photo" -o "$dir/ref-default" ||
    ! run probe_ref 120 "$up" -m "$drct_l" --device cpu --precision fp32 -q --overwrite "$dir/small" -o "$dir/ref-l"; then
    record probe "no CPU reference: every step runs with attention $attn and nothing off"
    return
  fi
  for cfg in tensor-core: tensor-core:sass fused: tensor-core:cublaslt tensor-core:rowwise tensor-core:all fused:all reference:all; do
    a=${cfg%%:*} off=${cfg#*:}
    tried="$tried $cfg"
    fits probe 15 || break
    if probe_ok "$dir" "$a" "$off"; then
      attn=$a
      # Nothing off is no variable at all: the CUDA tests refuse any value.
      if [ -n "$off" ]; then export UPSCALE_CUDA_OFF=$off; else unset UPSCALE_CUDA_OFF; fi
      record probe "{\"attention\":\"$a\",\"cuda_off\":\"$off\",\"tried\":\"${tried# }\"}"
      return
    fi
  done
  record probe "failed: no configuration matched the CPU (tried${tried}); every step runs with attention $attn and nothing off"
}

probe_ok() { # DIR ATTENTION OFF: fp32 within 60 dB and bf16 within 40 dB of the CPU's fp32
  local dir=$1 a=$2 off=$3 p t min
  for p in fp32 bf16; do
    t=60
    [ "$p" = bf16 ] && t=40
    for min in "$(probe_psnr "$p" "$a" "$off" "$dir/ref-default" "$dir/photo" 4)" \
      "$(probe_psnr "$p" "$a" "$off" "$dir/ref-l" "$dir/small" "$drct_scale" -m "$drct_l")"; do
      awk -v v="$min" -v t="$t" 'BEGIN { exit !(v != "nan" && v + 0 >= t) }' || return 1
    done
  done
}

probe_psnr() { # PRECISION ATTENTION OFF HR LR SCALE [MODEL ARGS]: the lowest PSNR-RGB, or nan
  local p=$1 a=$2 off=$3 hr=$4 lr=$5 sc=$6 min
  shift 6
  min=$(UPSCALE_CUDA_OFF=$off timeout "$(cap 60)" "$up" eval "$@" --device "$device" --precision "$p" \
    --attention "$a" --hr "$hr" --lr "$lr" --scale "$sc" --json 2>> "$logs/probe.log" |
    tail -n 1 | "$PY" -c 'import json, sys
try:
    v = [float(i["psnr_rgb"]) for i in json.loads(sys.stdin.read())["images"]]
    print("nan" if not v or any(x != x for x in v) else min(min(v), 999.0))
except Exception:
    print("nan")')
  echo "attention $a, off '$off', $p, ${lr##*/}: lowest PSNR-RGB $min dB" >> "$logs/probe.log"
  echo "$min"
}

auto1080() {
  echo "== DRCT-L bf16 1080p, automatic tile"
  fits auto1080 40 && bench auto1080 drct-l-bf16-auto "$drct_l" --precision bf16 --size "$s1080" --warmup 0 --reps 1
  # Its 530 MB canvas back through page-locked staging buffers (src/tile/device.rs) instead of
  # the driver's pageable copy: the lane stats' transfer seconds, before and after.
  fits auto1080 40 && UPSCALE_CUDA_PINNED=1 bench auto1080 drct-l-bf16-auto-pinned "$drct_l" \
    --precision bf16 --size "$s1080" --warmup 0 --reps 1
}

check() {
  facts
  echo "== matmul peak"
  measure_peak
  cuda_tests
  sanitizers
  models
  probe
  parity fused tensor-core
  auto1080
}

# pytorch_rows STEP MODEL LOG CMD...: a PyTorch reference (CMD prints the JSON lines of
# benches/torch_gpu_reference.py) and, in the same process after it, torch.compile when the
# budget has room for its first call (about a minute: 51 s for DRCT-L on an H200); records
# MODEL-bf16-pytorch and MODEL-bf16-torch-compile from the summary lines in LOG.
pytorch_rows() {
  local step=$1 model=$2 log=$3 line compile=() limit=300
  shift 3
  if fits "$step" "$compile_s" "\"label\":\"$model-bf16-torch-compile\""; then
    compile=(--compile) limit=$(( 300 + compile_s ))
  fi
  timeout "$(cap "$limit")" "$@" "${compile[@]}" > "$log" 2>> "$logs/$step.log"
  # The eager summary is written before the compile starts: kept even if the compile is cut.
  line=$(grep '"summary": true' "$log" | grep -v '"impl": "compile-default"' | tail -n 1)
  record "$step" "${line:-failed}" "\"label\":\"$model-bf16-pytorch\""
  if [ ${#compile[@]} -gt 0 ]; then
    line=$(grep '"summary": true' "$log" | grep '"impl": "compile-default"' | tail -n 1)
    record "$step" "${line:-failed}" "\"label\":\"$model-bf16-torch-compile\""
  fi
}

# side_by_side REPS: DRCT-L x4 960x540 and DRCT x4 640x480 against PyTorch eager and
# torch.compile, bf16, tile 256, batch 4.
compile_s=150 # the least budget left for a torch.compile row: eager, a minute of compiling, reps
side_by_side() {
  echo "== side by side: DRCT-L x4 960x540 and DRCT x4 640x480, bf16, tile 256, batch 4"
  local r=$1 m
  for m in "drct-l $drct_l $s540" "drct $drct $s480"; do
    set -- $m
    fits side 30 || continue
    [ -n "$deadline" ] || bench side "$1-bf16-ours-fused" "$2" --precision bf16 --attention fused --size "$3" --tile "$t256" --tile_overlap "$ov" --tile_batch_size 4 --reps "$r"
    bench side "$1-bf16-ours-$attn" "$2" --precision bf16 --attention "$attn" --size "$3" --tile "$t256" --tile_overlap "$ov" --tile_batch_size 4 --reps "$r"
    if [ "$have_torch" = 1 ] && [ "$smoke" = 0 ]; then
      pytorch_rows side "$1" "$logs/side-$1-pytorch.jsonl" "$PY" benches/torch_gpu_reference.py \
        --device cuda --preset "$1" --weights "$2" --dtype bf16 --height "${3%x*}" --width "${3#*x}" \
        --tile "$t256" --overlap "$ov" --tile-batch 4 --reps "$r"
    else
      record side "skipped: the PyTorch reference needs PyTorch and a GPU" "\"label\":\"$1-bf16-pytorch\""
      record side "skipped: torch.compile needs PyTorch and a GPU" "\"label\":\"$1-bf16-torch-compile\""
    fi
  done
}

# switch_rows STEP VAR VALUE: a speed switch of ours set to VALUE, first held to the CPU's fp32
# as the probe holds ours (fp32 within 60 dB, bf16 within 40 dB), then timed on the
# side-by-side shapes (labels MODEL-bf16-STEPVALUE); side_by_side's rows of the same run are
# the ones without it. Fails when the budget has no room left.
switch_rows() {
  local step=$1 var=$2 value=$3 dir="$work/probe" ok=unchecked
  fits "$step" 40 "\"value\":\"$value\"" || return 1
  export "$var=$value"
  # The probe's CPU references, when it made them.
  if [ -n "$(ls -A "$dir/ref-default" 2>/dev/null)" ] && [ -n "$(ls -A "$dir/ref-l" 2>/dev/null)" ]; then
    ok=false
    probe_ok "$dir" "$attn" "${UPSCALE_CUDA_OFF:-}" && ok=true
  fi
  record "${step}_parity" "{\"value\":\"$value\",\"matches_cpu\":\"$ok\"}"
  if [ "$ok" != false ]; then
    bench "$step" "drct-l-bf16-$step$value" "$drct_l" --precision bf16 --size "$s540" --tile "$t256" \
      --tile_overlap "$ov" --tile_batch_size 4 --reps 3
    fits "$step" 15 && bench "$step" "drct-bf16-$step$value" "$drct" --precision bf16 --size "$s480" \
      --tile "$t256" --tile_overlap "$ov" --tile_batch_size 4 --reps 3
  fi
  unset "$var"
}

# The speed switches against the defaults: UPSCALE_PAD_CHANNELS (src/ops/pad.rs: every linear
# and convolution's channels padded with zeros at load; 16 by default on a GPU in bf16 and
# fp16) off and at 8 and 64, and UPSCALE_CUDA_PINNED (src/tile/device.rs: canvases back
# through page-locked buffers), which no GPU has timed yet.
switches() {
  echo "== speed switches: parity with the CPU, then DRCT-L and DRCT bf16"
  local pad
  switch_rows pinned UPSCALE_CUDA_PINNED 1 || return
  for pad in 0 8 64; do
    switch_rows pad UPSCALE_PAD_CHANNELS "$pad" || return
  done
}

# swin_family REPS: SwinIR-M, HAT-L and Swin2SR (classical) x4 (random weights of the
# released shapes, the same file for both programs) on the DRCT-L side by side's input and tiling, bf16: ours, then
# PyTorch eager and torch.compile (benches/torch_swin_reference.py) while the budget lasts;
# HAT-L also with its overlap kernel and its channel attention in the residual norm off.
swin_family() {
  echo "== SwinIR-M, HAT-L and Swin2SR x4 960x540 bf16: ours, PyTorch eager and torch.compile"
  if [ "$smoke" = 1 ] || [ "$have_torch" = 0 ]; then
    record swin "skipped: the SwinIR, HAT and Swin2SR weights are made with PyTorch"
    return
  fi
  local r=$1 preset weights
  for preset in swinir-m hat-l swin2sr; do
    fits swin 30 "\"label\":\"$preset\"" || return
    weights="$work/$preset.safetensors"
    [ -f "$weights" ] || "$PY" benches/torch_swin_reference.py make-weights "$weights" --preset "$preset" \
      >> "$logs/weights.log" 2>&1 || { record swin "failed: weights" "\"label\":\"$preset\""; continue; }
    bench swin "$preset-bf16-ours-$attn" "$weights" --precision bf16 --size "$s540" --tile "$t256" \
      --tile_overlap "$ov" --tile_batch_size 4 --reps "$r"
    # HAT's overlapping cross-attention through candle's graph instead of our kernel
    # (UPSCALE_CUDA_OCA=0, src/ops/attention/cuda.rs): the before of that kernel, on
    # the same shapes.
    if [ "$preset" = hat-l ] && fits swin 20 "\"label\":\"$preset-oca-off\""; then
      UPSCALE_CUDA_OCA=0 bench swin "$preset-bf16-ours-$attn-oca-off" "$weights" --precision bf16 \
        --size "$s540" --tile "$t256" --tile_overlap "$ov" --tile_batch_size 4 --reps "$r"
    fi
    # HAT's channel attention multiplied and added by candle before the residual norm
    # (UPSCALE_CUDA_OFF=cab, src/switches/cuda_off.rs): the before of folding it into that norm's
    # kernel, on the same shapes; whatever the probe left off stays off.
    if [ "$preset" = hat-l ] && fits swin 20 "\"label\":\"$preset-cab-off\""; then
      UPSCALE_CUDA_OFF="${UPSCALE_CUDA_OFF:+$UPSCALE_CUDA_OFF,}cab" bench swin "$preset-bf16-ours-$attn-cab-off" \
        "$weights" --precision bf16 --size "$s540" --tile "$t256" --tile_overlap "$ov" \
        --tile_batch_size 4 --reps "$r"
    fi
    pytorch_rows swin "$preset" "$logs/swin-$preset-pytorch.jsonl" "$PY" benches/torch_swin_reference.py \
      time --device cuda --preset "$preset" --weights "$weights" --dtype bf16 --height "${s540%x*}" \
      --width "${s540#*x}" --tile "$t256" --overlap "$ov" --tile-batch 4 --reps "$r"
  done
}

# conv_family REPS: ESRGAN x4 (64 filters, 23 blocks: RealESRGAN_x4plus's shape),
# Real-ESRGAN Compact x4 (64 features, 32 convolutions: realesr-general-x4v3's), SPAN x4 (48
# features), DAT x4 (DAT_x4's shape), RealPLKSR x4 (64 features, 28 blocks), the original PLKSR
# x4 (the same widths, DCCM), OmniSR x4 (64 features, 5 groups), Real-CUGAN x4, RCAN x4
# (64 features, 10 groups of 20 blocks), MoSR x4 (64 features, 24 blocks), FDAT x4 (medium,
# transpose+conv) and SAFMN x4 (dim 36, 8 blocks) on DRCT's
# 640x480 input, tile 256, batch 4, bf16: bf16
# and fp16 against our fp32 on tests/photos (the same random weights), ours, then PyTorch eager
# and torch.compile (benches/torch_swin_reference.py) while the budget lasts.
conv_family() {
  echo "== ESRGAN, Compact, SPAN, DAT, RealPLKSR, PLKSR, OmniSR, Real-CUGAN, RCAN, MoSR, FDAT and SAFMN x4 640x480 bf16: parity, ours, PyTorch eager and torch.compile"
  if [ "$smoke" = 1 ] || [ "$have_torch" = 0 ]; then
    record conv "skipped: the ESRGAN, Compact, SPAN, DAT, RealPLKSR, PLKSR, OmniSR, Real-CUGAN, RCAN, MoSR, FDAT and SAFMN weights are made with PyTorch"
    return
  fi
  local r=$1 preset weights p line ref
  for preset in esrgan compact span dat realplksr plksr omnisr realcugan rcan mosr fdat safmn; do
    fits conv 30 "\"label\":\"$preset\"" || return
    weights="$work/$preset.safetensors"
    [ -f "$weights" ] || "$PY" benches/torch_swin_reference.py make-weights "$weights" --preset "$preset" \
      >> "$logs/weights.log" 2>&1 || { record conv "failed: weights" "\"label\":\"$preset\""; continue; }
    ref="$work/ref-fp32-$preset"
    run "conv_ref_$preset" 120 "$up" -m "$weights" --device "$device" --precision fp32 -q --overwrite \
      tests/photos -o "$ref"
    for p in bf16 fp16; do
      line=$(timeout "$(cap 120)" "$up" eval -m "$weights" --device "$device" --precision "$p" --hr "$ref" \
        --lr tests/photos --scale 4 --json 2>> "$logs/conv.log" | tail -n 1)
      record conv_psnr "${line:-failed}" "\"label\":\"$preset\",\"precision\":\"$p\",\"against\":\"fp32\""
    done
    bench conv "$preset-bf16-ours" "$weights" --precision bf16 --size "$s480" --tile "$t256" \
      --tile_overlap "$ov" --tile_batch_size 4 --reps "$r"
    pytorch_rows conv "$preset" "$logs/conv-$preset-pytorch.jsonl" "$PY" benches/torch_swin_reference.py \
      time --device cuda --preset "$preset" --weights "$weights" --dtype bf16 --height "${s480%x*}" \
      --width "${s480#*x}" --tile "$t256" --overlap "$ov" --tile-batch 4 --reps "$r"
  done
}

# The side-by-side shapes and two lanes again with cudarc's event tracking on (its default, and
# ours before engine::lanes::skip_event_tracking): the before/after of leaving it off.
event_tracking() {
  echo "== cudarc event tracking on (before) against off (side by side, streams)"
  local m
  for m in "drct-l $drct_l $s540" "drct $drct $s480"; do
    set -- $m
    fits events 25 || return
    UPSCALE_CUDA_EVENT_TRACKING=1 bench events "$1-bf16-ours-$attn-events-on" "$2" --precision bf16 \
      --attention "$attn" --size "$3" --tile "$t256" --tile_overlap "$ov" --tile_batch_size 4 --reps 3
  done
  fits events 25 || return
  UPSCALE_CUDA_EVENT_TRACKING=1 bench events "drct-l-bf16-b4-s2-events-on" "$drct_l" --precision bf16 \
    --size "$s540" --tile "$t256" --tile_overlap "$ov" --tile_batch_size 4 --streams 2 --reps 3
}

gemm_bounds() {
  echo "== what bounds the body: its GEMMs at their real shapes, and its memory traffic"
  local gemm_args=(--calc-only)
  [ "$have_torch" = 1 ] && [ "$smoke" = 0 ] && gemm_args=()
  if run gemm_shapes 180 "$PY" benches/gemm_shapes.py --preset drct-l "${gemm_args[@]}" --json "$work/gemm.json"; then
    record gemm_shapes "$(cat "$work/gemm.json")"
  fi
}

streams() { # COUNT...: DRCT-L bf16 960x540, batch 4, with that many lanes
  echo "== streams"
  local s
  for s in "$@"; do
    fits streams 25 || break
    bench streams "drct-l-bf16-b4-s$s" "$drct_l" --precision bf16 --size "$s540" --tile "$t256" \
      --tile_overlap "$ov" --tile_batch_size 4 --streams "$s" --reps 3
  done
}

folder_runs() { # "STREAMS IO_THREADS DEFER"...: a folder of 12 photos, GPU utilisation sampled
  echo "== folder runs: lanes, encoder threads, deferred finishing"
  local folder="$work/folder" row s io defer i f label copies=3 photos=(tests/photos/*.png)
  # The CPU smoke runs the steps, not the measurement: two small images.
  [ "$smoke" = 1 ] && copies=1 photos=("${photos[@]:0:2}")
  mkdir -p "$folder"
  for i in $(seq "$copies"); do
    for f in "${photos[@]}"; do cp "$f" "$folder/$(basename "${f%.png}")-$i.png"; done
  done
  for row in "$@"; do
    set -- $row
    s=$1 io=$2 defer=$3
    label="folder_s${s}_io${io}_defer${defer}"
    fits "$label" 30 || break
    local util="$logs/util-$label.csv" sampler=""
    if [ "$smoke" = 0 ] && command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 > "$util" 2>/dev/null &
      sampler=$!
    fi
    UPSCALE_DEFER_FINISH=$defer run "$label" 300 "$up" -m "$drct" --device "$device" --precision bf16 \
      --attention "$attn" --streams "$s" --io_threads "$io" --tile "$t256" --tile_overlap "$ov" \
      --tile_batch_size 4 --overwrite --json "$folder" -o "$work/folder-out-$label"
    if [ -n "$sampler" ]; then
      kill "$sampler" 2>/dev/null
      record "$label" "{\"gpu_util_mean_pct\":$(awk '{s+=$1; n++} END {print (n ? s/n : 0)}' "$util"),\"samples\":$(wc -l < "$util")}"
    fi
    # Images per second and where the lanes' time went, from the run's summary line: the
    # share of the folder's wall time the lanes spent on batches, and the image and canvas
    # transfers with the part of them that ran while another lane computed.
    record "${label}_lanes" "$("$PY" - "$logs/$label.log" <<'PYEOF'
import json, sys
summary = {}
for line in open(sys.argv[1]):
    if line.startswith("{") and '"summary":true' in line:
        summary = json.loads(line)
lanes = summary.get("lane_stats", [])
total = lambda key: round(sum(l.get(key, 0.0) for l in lanes), 4)
wall = summary.get("seconds") or 0.0
busy = total("busy_seconds")
print(json.dumps({"wall_s": wall, "images_per_s": summary.get("images_per_s"), "lanes": len(lanes),
                  "busy_s": busy, "busy_share": round(busy / len(lanes) / wall, 4) if wall and lanes else None,
                  "transfer_s": total("transfer_seconds"),
                  "transfer_overlap_s": total("transfer_overlap_seconds")}))
PYEOF
)"
  done
}

bench_part() {
  models
  probe
  measure_peak
  side_by_side "$reps"
  switches
  swin_family "$reps"
  gemm_bounds
  streams 1 2 4
  folder_runs "1 1 0" "1 4 0" "1 4 1" "2 4 0" "2 4 1"
}

# Where one DRCT-L forward's GPU time goes, kernel by kernel (scripts/gpu-profile.sh), with
# its tables beside the results and its raw files in the logs: `profile STEP [VAR=VALUE...]`
# profiles with those switches set (profile-STEP.md, attention-STEP.md; `profile profile`
# writes profile.md and attention.md).
profile() {
  local step=$1
  shift
  echo "== $step: DRCT-L bf16 256x256, every kernel${*:+, with $*}"
  if [ "$smoke" = 1 ] || ! command -v ncu >/dev/null; then
    record "$step" "skipped: needs Nsight Compute on a GPU"
    return
  fi
  fits "$step" 90 || return
  local dir="$work/$step" suffix=""
  [ "$step" = profile ] || suffix="-$step"
  # Two timed runs after a warm-up: kernel_profile.py counts the last, which repeats the one
  # before it, and leaves the model's load (a cast per weight) and the caches out.
  run "$step" 240 env "$@" scripts/gpu-profile.sh "$pack" "$dir" drct-l --precision bf16 \
    --attention "$attn" --size 256x256 --tile 0 --warmup 1 --reps 2
  local f
  for f in profile attention; do
    [ -f "$dir/$f.md" ] && cp "$dir/$f.md" "$out/$f$suffix.md"
  done
  mkdir -p "$logs/$step"
  cp "$dir"/*.csv "$dir"/*.json "$logs/$step/" 2>/dev/null
  record "$step" "$(head -n 3 "$out/profile$suffix.md" 2>/dev/null | tail -n 1)"
}

# What a user pays at start for the driver compiling PTX: the README command on the GPU with
# the driver's compile cache off, with our SASS (jit_cold: candle's PTX only) and without
# (jit_cold_ptx: ours from PTX too), then with the cache warm (jit_warm).
jit() {
  echo "== start-up: PTX compiled by the driver, with and without its cache and our SASS"
  fits jit 50 || return
  local dir="$work/jit" cmd
  mkdir -p "$dir"
  cmd=("$up" --device "$device" --attention "$attn" -q --overwrite tests/photos/coffee.png)
  run jit_warm 60 "${cmd[@]}" -o "$dir/warm.png"
  run jit_cold 60 env CUDA_CACHE_DISABLE=1 "${cmd[@]}" -o "$dir/cold.png"
  run jit_cold_ptx 60 env CUDA_CACHE_DISABLE=1 UPSCALE_CUDA_OFF="${UPSCALE_CUDA_OFF:+$UPSCALE_CUDA_OFF,}sass" "${cmd[@]}" -o "$dir/cold_ptx.png"
  run jit_warm 60 "${cmd[@]}" -o "$dir/warm.png"
}

# One call, a budget: what the issue needs first comes first, and each later step runs only in
# the time the budget has left.
proof_part() {
  deadline=$(( $(date +%s) + ${UPSCALE_PROOF_BUDGET_S:-520} ))
  facts
  # A hung test must not take more than a third of the budget.
  cuda_tests 180
  models
  probe
  parity tensor-core fused
  measure_peak
  # The issue's side by side with the defaults: DRCT-L and DRCT, then SwinIR-M and HAT-L,
  # each against eager and torch.compile (about a minute of compiling per model).
  side_by_side 3
  swin_family 3
  sanitizers 120 90
  # The switches against the defaults, then the folder pipeline's levers (one encoder
  # thread against four, the output canvas finished on the model thread or the finisher).
  switches
  folder_runs "1 1 0" "1 4 0" "1 4 1" "1 1 1"
  # ESRGAN, Compact, SPAN and DAT: four more torch.compile rows, seldom reached in one call;
  # a second call runs them with `steps "conv_family 3"`.
  conv_family 3
  auto1080
  # The kernel table only: Nsight Compute's attention sections took over two minutes.
  UPSCALE_PROFILE_SECTIONS=0 profile profile
  event_tracking
  # Earlier builds in the pack (UPSCALE_BASES) against this one: one round of before/after.
  ab_part 1
  streams 1 2
  folder_runs "2 4 0" "2 4 1"
  jit
  matrix_rows "bf16 8" "bf16 1" "fp16 4" "fp32 4"
}

# matrix_rows "PRECISION BATCH"...: DRCT-L 960x540, tile 256, with the probe's attention, as
# long as the budget lasts (proof's share of the matrix part; bf16 batch 4 is the side by side).
matrix_rows() {
  echo "== precision x batch, DRCT-L, tile 256"
  local row
  for row in "$@"; do
    set -- $row
    fits matrix 25 || break
    bench matrix "drct-l-$1-b$2-$attn" "$drct_l" --precision "$1" --size "$s540" --tile "$t256" \
      --tile_overlap "$ov" --tile_batch_size "$2" --reps 2
  done
}

matrix_part() {
  models
  measure_peak
  echo "== precision x batch x attention (DRCT-L, tile 256)"
  for p in bf16 fp16 fp32; do
    for b in 1 4 8; do
      for a in fused tensor-core reference; do
        # In fp32 the tensor-core choice runs the fused kernel: nothing new to time.
        [ "$p" = fp32 ] && [ "$a" = tensor-core ] && continue
        bench matrix "drct-l-$p-b$b-$a" "$drct_l" --precision "$p" --attention "$a" --size "$s540" \
          --tile "$t256" --tile_overlap "$ov" --tile_batch_size "$b" --reps 2
      done
    done
  done
  for b in 1 2; do
    bench matrix "drct-l-bf16-t512-b$b-fused" "$drct_l" --precision bf16 --size "$s540" \
      --tile "$t512" --tile_overlap "$ov" --tile_batch_size "$b" --reps 2
  done

}

# Before/after measurements: every earlier build in the pack (upscale-LABEL, packed by
# scripts/gpu-pack.sh from UPSCALE_BASES) and `upscale` take turns on the side-by-side shapes,
# so all of them see the same GPU state.
ab_part() { # [ROUNDS]
  local rounds=${1:-3}
  models
  local bins=() labels=() f label
  for f in "$pack"/upscale-*.xz; do
    [ -e "$f" ] || continue
    label=${f##*/upscale-}
    label=${label%.xz}
    bins+=("$(unpack "upscale-$label")")
    labels+=("$label")
  done
  if [ ${#bins[@]} = 0 ]; then
    record ab "skipped: no earlier build in the pack"
    return
  fi
  bins+=("$up")
  labels+=("$(cut -c1-7 "$pack/commit" 2>/dev/null || echo new)")
  echo "== before/after: ${labels[*]}"
  local round i line m
  for round in $(seq 1 "$rounds"); do
    for m in "drct-l $drct_l $s540" "drct $drct $s480"; do
      set -- $m
      for i in "${!bins[@]}"; do
        fits ab 20 || return
        # Every build names its attention (the first ones defaulted to another): the probe's.
        line=$(timeout "$(cap 240)" "${bins[$i]}" bench -m "$2" --device "$device" --json --precision bf16 \
          --attention "$attn" --size "$3" --tile "$t256" --tile_overlap "$ov" --tile_batch_size 4 --reps 3 \
          2>> "$logs/ab.log" | tail -n 1)
        record ab "${line:-failed}" "\"label\":\"$1-${labels[$i]}\",\"round\":$round"
      done
    done
  done
}

case $part in
  proof) proof_part ;;
  check) check ;;
  bench) bench_part ;;
  matrix) matrix_part ;;
  ab) ab_part ;;
  all) check; bench_part; matrix_part ;;
  rest) models; gemm_bounds; streams 4; matrix_part ;;
  # steps: named steps of this script (a function and its arguments, one word-split argument
  # each), after the probe, under proof's budget: a short second call for what proof skipped.
  steps)
    deadline=$(( $(date +%s) + ${UPSCALE_PROOF_BUDGET_S:-520} ))
    models
    probe
    shift 3
    for step in "$@"; do
      # shellcheck disable=SC2086
      $step
    done
    ;;
  *) echo "unknown part '$part' (proof, check, bench, matrix, ab, rest or all)" >&2; exit 2 ;;
esac
"$PY" scripts/gpu_summary.py "$results" > "$out/summary.md"
cat "$out/summary.md"
# A GPU call brings back only a few files: the step logs travel as one archive.
if [ "$smoke" = 0 ]; then
  tar czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
fi
# Any failed step fails the run (so CI's smoke run catches a script that has rotted), after
# everything else has run and been recorded.
if grep -qE '"status":[1-9]|"result":"failed' "$results"; then
  echo "some steps failed; see $results and the step logs in $out" >&2
  exit 1
fi
