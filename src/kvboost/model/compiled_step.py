"""CompiledStep: the CPU decode step under torch.compile, its matrix-vector products as packed GEMV kernels.

A batch-1 decode step on CPU is a chain of matrix-vector products whose cost is reading every weight once. ATen's
GEMV (MKL) streams SmolLM2's weight shapes at 9-19 GB/s on this project's 2-core CPU, where a plain read of the
same memory runs at ~23 GB/s. Inductor's C++ GEMM template (`max_autotune_gemm_backends="CPP"`) reads a weight
that it has re-packed into its own blocked layout at compile time, which needs the weights to be compile-time
constants: the step is compiled with `freezing`. Measured on the embedded model (1,016-token prompt, 2 threads):
~28 ms per decode step against ~58 ms compiled over ATen's GEMV.

What freezing costs, and why it is acceptable for an opt-in CPU mode:
* the packed weights are a second copy of the Linear weights (the eager forwards - prefills, batched rows,
  verifies - keep reading the model's own parameters);
* the step reads the weights as they were when it compiled (at load): changing the model's weights afterwards
  needs a new engine;
* a frozen graph is not kept in inductor's on-disk cache, so every load compiles (about a minute here).
Where the host lacks the memory for that copy (packing_refusal), the step runs ATen's kernels and says why.

Dynamo reads `freezing` while it traces (to keep parameters as attributes, not inputs), before torch.compile's
`options` are applied, so the flag is set around every call of the step - a recompile is frozen too - rather than
for the whole process. Where the template cannot compile (a CPU without the vector ISA it needs, a dtype it does
not take), the step is compiled again over ATen's kernels and the reason is kept in `fallback`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

PACKED_GEMM_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}
# Host memory the packing needs, over the Linear weights' bytes: the packed copy stays, and compiling holds
# transient copies (measured on the embedded model: resident memory +1.7x the weights over ATen's compiled step).
PACKING_MEMORY_FACTOR = 2.0


def available_host_bytes() -> int | None:
    """Memory the OS can give this process now (MemAvailable on Linux, free pages elsewhere); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def linear_weight_bytes(model: torch.nn.Module) -> int:
    weights = {id(m.weight): m.weight for m in model.modules()
               if isinstance(m, torch.nn.Linear) and isinstance(m.weight, torch.Tensor)}
    return sum(w.numel() * w.element_size() for w in weights.values())


def packing_refusal(model: torch.nn.Module, available: int | None = None) -> str | None:
    """Why the decode step should not pack `model`'s weights here (None: it may): too little host memory for a
    second copy. Unknown free memory does not refuse (the packed copy is the documented cost of the mode)."""
    available = available_host_bytes() if available is None else available
    need = int(PACKING_MEMORY_FACTOR * linear_weight_bytes(model))
    if available is not None and available < need:
        return f"packing needs ~{need / 2**30:.2f} GiB of free host memory, {available / 2**30:.2f} GiB available"
    return None


class CompiledStep:
    def __init__(self, fn: Callable[..., torch.Tensor], packed: bool = True, unpacked_reason: str | None = None):
        self._fn = fn
        self.packed = packed
        self.fallback: str | None = None  # why the packed kernels failed to compile (None: they did, or not tried)
        self.unpacked_reason = unpacked_reason  # why they were not asked for
        self._compiled = self._compile()

    def _compile(self) -> Callable[..., torch.Tensor]:
        if self.packed:
            return torch.compile(self._fn, dynamic=None, options=dict(PACKED_GEMM_OPTIONS))
        return torch.compile(self._fn, dynamic=None)

    def __call__(self, *args) -> torch.Tensor:
        if not self.packed:
            return self._compiled(*args)
        from torch._dynamo.exc import BackendCompilerFailed
        from torch._inductor import config as inductor_config
        from torch._inductor.exc import InductorError

        try:
            with inductor_config.patch(freezing=True):
                return self._compiled(*args)
        except (InductorError, BackendCompilerFailed) as exc:  # the template could not compile here: ATen's
            # kernels (an error of the model's own fails this second compile too, and propagates from it)
            self.fallback = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log.warning("kvboost: packed GEMV kernels unavailable (%s); the decode step compiles over ATen's",
                        self.fallback)
            self.packed = False
            self._compiled = self._compile()
            return self._compiled(*args)

    @property
    def description(self) -> str:
        if self.packed:
            return "packed GEMV kernels (inductor C++ template, frozen weights)"
        if self.fallback:
            return f"ATen GEMV (packed kernels failed: {self.fallback})"
        return "ATen GEMV" + (f" ({self.unpacked_reason})" if self.unpacked_reason else "")
