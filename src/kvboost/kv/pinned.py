"""Page-locked host tensors of exactly the size asked for.

torch's pinned allocations (`pin_memory=True`) go through its caching host allocator, which rounds every request
up to the next power of two and page-locks all of it: a 20 GiB host pool of blocks would lock 32 GiB of the host's
RAM (the same was reported of vLLM's CPU offload and fixed in SGLang's host caches this way). Here the tensor is
allocated pageable and registered with CUDA at its exact size (cudaHostRegister, as torch.distributed's checkpoint
stager does); it is unregistered when the last tensor over its memory is freed, after the device has finished
what it had queued (an asynchronous copy may still read or write it).

Where registration is impossible (no CUDA runtime, the page-lock limit of the process) the tensor is pageable:
copies then block, and are otherwise the same. `pinned_empty` says which it gave.
"""
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
