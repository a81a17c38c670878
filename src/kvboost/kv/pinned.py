"""Page-locked host tensors of exactly the size asked for (torch's pinned allocator locks the next power of two):
allocated pageable and registered with CUDA, unregistered once the device is done; pageable where that fails."""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .cuda_runtime import cuda_runtime


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
