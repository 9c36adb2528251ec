#!/usr/bin/env bash
# The library's tests built for 64-bit ARM (aarch64: Apple Silicon under Linux, Graviton) and
# run under qemu's user-mode emulator: correctness of the code paths ARM takes (our element-wise
# kernels compiled generically, the `gemm` crate's products), not speed. Needs the Rust target
# and, on Debian, qemu-user, gcc-aarch64-linux-gnu and libc6-dev-arm64-cross. About half an
# hour on 2 cores; extra arguments go to the test binary (a name filter, --skip ...).
#
# usage: scripts/aarch64-test.sh [TEST FILTER...]
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add aarch64-unknown-linux-gnu >/dev/null
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-aarch64} \
  cargo test --release --target aarch64-unknown-linux-gnu --lib -- "$@"
