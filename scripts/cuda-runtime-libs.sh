# Sourced by the GPU scripts: puts the CUDA 13 runtime libraries that come with PyTorch's pip
# packages on the GPU machine on LD_LIBRARY_PATH (the machine has no system CUDA runtime).
for d in $("${PY:-python3}" -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null); do
  for sub in cu13/lib cudnn/lib cublas/lib cuda_runtime/lib cuda_nvrtc/lib curand/lib; do
    [ -d "$d/$sub" ] && LD_LIBRARY_PATH="$d/$sub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
done
export LD_LIBRARY_PATH
