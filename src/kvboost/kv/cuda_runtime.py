"""CUDA runtime calls torch does not expose (cudaMemcpy2DAsync, cudaHostRegister / Unregister) through the runtime
torch loaded. A failure is cleared (cudaGetLastError), else torch's next launch check would blame an unrelated op."""
from __future__ import annotations

import ctypes
import os
import threading

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


_runtime: CudaRuntime | None = None
_runtime_error: str | None = None
_lock = threading.Lock()


def cuda_runtime() -> CudaRuntime:
    """The process's runtime (looked up once); OSError / AttributeError where it cannot be had."""
    global _runtime, _runtime_error
    with _lock:
        if _runtime is None and _runtime_error is None:
            try:
                _runtime = CudaRuntime(loaded_cudart_path())
            except (OSError, AttributeError) as exc:
                _runtime_error = f"{type(exc).__name__}: {exc}"
        if _runtime is None:
            raise OSError(_runtime_error)
        return _runtime
