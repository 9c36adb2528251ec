#!/usr/bin/env bash
# Assemble a CUDA 13.0 toolkit from PyPI wheels, enough to BUILD `upscale --features cuda` on a
# machine without a system CUDA install (and without a GPU). Running the binary needs a real
# NVIDIA driver and the CUDA 13 runtime libraries on the target machine.
#
# usage: scripts/cuda-toolkit-from-pypi.sh PREFIX      then: source PREFIX/env.sh
#
# Versions are pinned to 13.0.x on purpose: a newer nvcc emits PTX that a CUDA 13.0 driver
# (580 series) cannot load, and cudarc 0.19 accepts CUDA API levels up to 13.x only.
set -euo pipefail
prefix=${1:?usage: $0 PREFIX}
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
py=${PYTHON:-python3}

[ -x "$prefix/venv/bin/pip" ] || "$py" -m venv "$prefix/venv"
"$prefix/venv/bin/pip" install -q \
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
  nvidia-cublas==13.1.0.3 nvidia-cuda-nvrtc==13.0.88 nvidia-curand==10.4.0.35
site=$("$prefix/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cu="$site/nvidia/cu13"

home="$prefix/cuda"
rm -rf "$home"
mkdir -p "$home/lib64/stubs"
for d in bin include nvvm; do ln -s "$cu/$d" "$home/$d"; done
# Unversioned names, as `-l<name>` looks for them.
for lib in cudart.so.13 cublas.so.13 cublasLt.so.13 nvrtc.so.13 curand.so.10; do
  ln -s "$cu/lib/lib$lib" "$home/lib64/lib${lib%%.so*}.so"
done

# The driver library comes with the NVIDIA driver, not the toolkit; the linker only needs its
# symbols. Generate a stub exporting every driver entry point cudarc declares, each failing.
cudarc=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -n 1)
if [ -z "$cudarc" ]; then
  echo "cudarc sources not found: run 'cargo fetch' in the project first" >&2
  exit 1
fi
stub=$(mktemp --suffix=.c)
{
  grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$cudarc/src/driver/sys/mod.rs" | awk '{print $4}' | sort -u |
    grep -vxE 'cuGetErrorName|cuGetErrorString' | sed 's/.*/int &(void) { return 34; }/'
  echo 'int cuGetErrorName(int e, const char **s) { *s = "CUDA_ERROR_STUB_LIBRARY"; return 0; }'
  echo 'int cuGetErrorString(int e, const char **s) { *s = "stub CUDA driver: no NVIDIA driver here"; return 0; }'
} > "$stub"
gcc -shared -fPIC -w -Wl,-soname,libcuda.so.1 -o "$home/lib64/stubs/libcuda.so" "$stub"
rm -f "$stub"
ln -s libcuda.so "$home/lib64/stubs/libcuda.so.1"

cat > "$prefix/env.sh" <<ENV
export CUDA_HOME=$home
export PATH=$home/bin:\$PATH
export LIBRARY_PATH=$home/lib64:$home/lib64/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
export CUDARC_CUDA_VERSION=13000
ENV
"$home/bin/nvcc" --version | tail -n 1
echo "source $prefix/env.sh"
