"""Page-locked host tensors of exactly the size asked for (torch's pinned allocator locks the next power of two):
allocated pageable and registered with CUDA, unregistered once the device is done; pageable where that fails. Tensors
packed into one such byte buffer are views of it at ALIGN-ed offsets (byte_view)."""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .cuda_runtime import cuda_runtime

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
