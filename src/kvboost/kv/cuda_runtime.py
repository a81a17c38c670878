"""CUDA runtime calls torch does not expose (cudaMemcpy2DAsync, cudaHostRegister / Unregister) through the runtime
torch loaded. A failure is cleared (cudaGetLastError), else torch's next launch check would blame an unrelated op."""
from __future__ import annotations

import ctypes
import functools
import os

HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


def loaded_cudart_path() -> str:
    """The path of the CUDA runtime library already loaded in this process (torch's); OSError where none is."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.rsplit(None, 1)[-1]
            if os.path.basename(name).startswith("libcudart.so"):
                return name
    raise OSError("no CUDA runtime library (libcudart) is loaded in this process")


# The calls this module makes, by name: their argument types (each returns a cudaError_t).
_SIGNATURES = {
    "cudaMemcpy2DAsync": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                          ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p],
    "cudaHostRegister": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint],
    "cudaHostUnregister": [ctypes.c_void_p],
    "cudaGetLastError": [],
}


class CudaRuntime:
    """ctypes entry points of one libcudart; each returns its cudaError_t, a failure cleared."""

    def __init__(self, path: str):
        """AttributeError where the library lacks one of the calls."""
        self.lib = ctypes.CDLL(path)
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def _cleared(self, rc: int) -> int:
        if rc != 0:
            self.lib.cudaGetLastError()
        return rc

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                       stream: int) -> int:
        return self._cleared(self.lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream))

    def host_register(self, ptr: int, nbytes: int) -> int:
        return self._cleared(self.lib.cudaHostRegister(ptr, nbytes, 0))  # 0: cudaHostRegisterDefault

    def host_unregister(self, ptr: int) -> int:
        return self._cleared(self.lib.cudaHostUnregister(ptr))


@functools.cache
def _load() -> CudaRuntime | str:
    """The runtime, or why it cannot be had: looked up once either way."""
    try:
        return CudaRuntime(loaded_cudart_path())
    except (OSError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def cuda_runtime() -> CudaRuntime:
    """The process's runtime (looked up once); OSError / AttributeError where it cannot be had."""
    runtime = _load()
    if isinstance(runtime, str):
        raise OSError(runtime)
    return runtime
