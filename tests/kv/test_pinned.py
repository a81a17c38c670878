"""kv/pinned.py: host memory page-locked at its exact size (torch's pinning rounds up to a
power of two), unregistered once nothing uses it; every failure falls back to pageable memory, cleared from the
CUDA runtime's error state."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from kvboost.kv import pinned
from kvboost.kv.pinned import CudaRuntime


class _FakeRuntime:
    def __init__(self, register_rc: int = 0):
        self.register_rc = register_rc
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def host_register(self, ptr: int, nbytes: int) -> int:
        self.registered.append((ptr, nbytes))
        return self.register_rc

    def host_unregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_a_tensor_is_registered_at_its_exact_size_and_unregistered_with_its_last_view(monkeypatch):
    runtime = _FakeRuntime()
    monkeypatch.setattr(pinned, "cuda_runtime", lambda: runtime)
    tensor, reason = pinned.pinned_empty((3, 1000, 7), torch.bfloat16)  # 42,000 bytes: not a power of two
    assert reason is None and tensor.shape == (3, 1000, 7) and tensor.dtype == torch.bfloat16
    ptr = tensor.data_ptr()
    assert runtime.registered == [(ptr, 42_000)]
    view = tensor[1]
    del tensor
    gc.collect()
    assert runtime.unregistered == []  # a view still reads the memory
    del view
    gc.collect()
    assert runtime.unregistered == [ptr]


def test_a_refused_registration_gives_pageable_memory_and_says_why(monkeypatch):
    runtime = _FakeRuntime(register_rc=2)  # cudaErrorMemoryAllocation (the process's page-lock limit)
    monkeypatch.setattr(pinned, "cuda_runtime", lambda: runtime)
    tensor, reason = pinned.pinned_empty((10,), torch.float32)
    assert "cudaHostRegister of 40 bytes returned error 2" in reason and tensor.numel() == 10
    del tensor
    gc.collect()
    assert runtime.unregistered == []  # nothing was registered


def test_without_a_cuda_runtime_memory_is_pageable(monkeypatch):
    def missing():
        raise OSError("no CUDA runtime library (libcudart) is loaded in this process")

    monkeypatch.setattr(pinned, "cuda_runtime", missing)
    tensor, reason = pinned.pinned_empty((4, 4), torch.float32)
    assert "libcudart" in reason and not tensor.is_pinned()


def test_a_failed_runtime_call_is_cleared_from_the_error_state():
    """torch's next kernel launch check reads cudaGetLastError: a failure left there would be reported against an
    unrelated op."""
    runtime = CudaRuntime.__new__(CudaRuntime)  # the library replaced by a fake (no libcudart here)
    cleared = []
    runtime.lib = SimpleNamespace(cudaHostRegister=lambda ptr, n, flags: 2 if n > 100 else 0,
                                  cudaGetLastError=lambda: cleared.append(1) or 2)
    assert runtime.host_register(1 << 20, 64) == 0 and cleared == []
    assert runtime.host_register(1 << 20, 4096) == 2 and cleared == [1]


def test_pinned_host_memory_copies_to_the_gpu_and_back(device):
    if device.type != "cuda":
        pytest.skip("page-locking host memory needs CUDA")
    host, reason = pinned.pinned_empty((5, 1001), torch.float32)
    assert reason is None and host.is_pinned()
    host.copy_(torch.arange(5 * 1001, dtype=torch.float32).reshape(5, 1001))
    on_device = host.to(device, non_blocking=True)
    back, _ = pinned.pinned_empty((5, 1001), torch.float32)
    back.copy_(on_device * 2, non_blocking=True)
    torch.cuda.synchronize(device)
    assert torch.equal(back, host * 2)
