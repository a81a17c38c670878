"""tests/model: the Triton kernels run in triton's CPU interpreter when no GPU is present.

triton reads TRITON_INTERPRET when a kernel is decorated (@triton.jit at import of kvboost's kernel modules);
tests/conftest.py sets it for the whole session (another directory may import them first). With a GPU the
real kernels run.
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def kernel_device(device) -> torch.device:
    """The device the kernel tests run on; skips where the kernels cannot run there."""
    from kvboost.model.attention.support import triton_available

    if not triton_available():
        pytest.skip("triton is not installed (pip install 'kvboost[gpu]')")
    if device.type == "cuda":
        return device
    if device.type != "cpu":
        pytest.skip(f"triton kernels do not run on {device.type}")
    from triton.runtime.interpreter import InterpretedFunction

    from kvboost.model.attention import prefill

    if not isinstance(prefill._prefill_kernel, InterpretedFunction):
        pytest.skip("kernels are compiled for the GPU here (TRITON_INTERPRET unset when they were imported); "
                    "use --device cuda")
    return device


@pytest.fixture(scope="session")
def aot_cache_dir(tmp_path_factory):
    """A KVBOOST_CACHE_DIR shared by the decode-step package tests: the tiny llama's package is built once."""
    return tmp_path_factory.mktemp("kvboost_cache")
