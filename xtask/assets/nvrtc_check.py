"""Compile ptl's CUDA sources with NVRTC for sm_90 on a machine without a GPU: a syntax and type
check of new kernels before a GPU call (it runs nothing and proves no numbers).

NVRTC and the CUDA headers come from PyPI (no GPU or driver needed), once:

    python3 -m pip download --no-deps -d /tmp/nvrtc 'nvidia-cuda-nvrtc==13.0.*' \
        'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*'
    mkdir -p /tmp/cuda13 && (cd /tmp/cuda13 && for w in /tmp/nvrtc/*.whl; do unzip -qo "$w"; done)

then, from the repository root:

    LD_LIBRARY_PATH=/tmp/cuda13/nvidia/cu13/lib python3 xtask/assets/nvrtc_check.py \
        autograd/src/cuda/ops/*.cu trainer/src/loss/assign_fused.cu

A `.cu` file whose folder holds a `prelude.cuh` is compiled with the prelude in front, as the
backend compiles its kernel units (`cuda/kernel_units.rs`).

`CUDA_WHEELS` names another unpack folder. The options are the ones the backend passes
(`module_cache::nvrtc_flags`): `--gpu-architecture=sm_90 --std=c++17 --include-path=…/include`.
"""
import ctypes
import os
import sys

root = os.environ.get("CUDA_WHEELS", "/tmp/cuda13") + "/nvidia/cu13"
lib = ctypes.CDLL(root + "/lib/libnvrtc.so.13")


def check(path):
    src = open(path, "rb").read()
    prelude = os.path.join(os.path.dirname(path), "prelude.cuh")
    if path.endswith(".cu") and os.path.exists(prelude):
        src = open(prelude, "rb").read() + src
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, path.encode(), 0, None, None) != 0:
        sys.exit(f"{path}: nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", f"--include-path={root}/include".encode()]
    # NVRTC_VERBOSE=1: ptxas's per-kernel registers, spills and shared memory in the log.
    if os.environ.get("NVRTC_VERBOSE") == "1":
        opts.append(b"--ptxas-options=-v")
    status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    print(f"{path}: {'ok' if status == 0 else f'FAILED (nvrtc status {status})'}")
    if log.value.strip():
        print(log.value.decode(errors="replace"))
    return status == 0


sys.exit(0 if all([check(p) for p in sys.argv[1:]]) else 1)
