"""Page-locked host tensors of exactly the size asked for (torch's pinned allocator locks the next power of two):
allocated pageable and registered with CUDA, unregistered once the device is done; pageable where that fails. Tensors
packed into one such byte buffer are views of it at ALIGN-ed offsets (byte_view).

The CUDA runtime calls torch does not expose (cudaMemcpy2DAsync, cudaHostRegister / Unregister) go through the runtime
torch loaded. A failure is cleared (cudaGetLastError), else torch's next launch check would blame an unrelated op."""
from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections.abc import Sequence

import torch

ALIGN = 64  # bytes: every view of a byte buffer starts aligned for any dtype (and for vectorized copies)


def pinned_empty(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, str | None]:
    """(an uninitialized host tensor, None) page-locked at its exact size, or (a pageable one, why not pinned)."""
    tensor = torch.empty(tuple(shape), dtype=dtype)
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return tensor, "empty"
    try:
        runtime = cuda_runtime()
    except OSError as exc:
        return tensor, str(exc)
    rc = runtime.host_register(storage.data_ptr(), storage.nbytes())
    if rc != 0:
        return tensor, f"cudaHostRegister of {storage.nbytes()} bytes returned error {rc}"
    release = weakref.finalize(storage, _unregister, runtime.host_unregister, storage.data_ptr())
    release.atexit = False  # at exit the CUDA context may be gone already; the process's memory goes with it
    return tensor, None


def _unregister(unregister, ptr: int) -> None:
    if torch.cuda.is_initialized():  # copies still queued on a device may read or write this memory
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)
    unregister(ptr)


def byte_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of uint8 `buffer` from `offset` on, viewed with `like`'s dtype and shape."""
    n = like.numel() * like.element_size()
    return buffer[offset:offset + n].view(like.dtype).view(like.shape)


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
