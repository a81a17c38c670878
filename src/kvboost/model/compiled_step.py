"""CompiledStep: the CPU decode step under torch.compile, its matrix-vector products as packed GEMV kernels.

A batch-1 CPU decode step costs reading every weight once, and ATen's GEMV streams small models' weight shapes well
below memory bandwidth. Inductor's C++ GEMM template reads weights re-packed at compile time, which needs them as
constants: the step is compiled with `freezing`. Costs, acceptable for an opt-in CPU mode: a second copy of the Linear
weights; weights changed after load need a new engine; every load compiles (frozen graphs are not cached on disk). Where
the host lacks memory for the copy (packing_refusal) or the template cannot compile, the step runs over ATen's kernels
and says why (`fallback`). `freezing` is set around every call, since dynamo reads it while tracing.

Dynamo keeps graphs per code object, up to `recompile_limit`, then silently runs eagerly. So each model's steps compile
a copy of the function with a code object of its own (`own_code`), shared by steps over the same model; reaching the
limit raises StepNotCompiled, which the runner turns into a counted, reported eager run.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import types
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

PACKED_GEMM_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}
# Host memory the packing needs, over the Linear weights' bytes: the packed copy stays, and compiling holds transient
# copies.
PACKING_MEMORY_FACTOR = 2.0


def available_host_bytes() -> int | None:
    """Memory the OS can give this process now (MemAvailable on Linux, free pages elsewhere); None if unknown."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def linear_weight_bytes(model: torch.nn.Module) -> int:
    weights = {id(m.weight): m.weight for m in model.modules()
               if isinstance(m, torch.nn.Linear) and isinstance(m.weight, torch.Tensor)}
    return sum(w.numel() * w.element_size() for w in weights.values())


def packing_refusal(model: torch.nn.Module, available: int | None = None) -> str | None:
    """Why the decode step should not pack `model`'s weights here (None: it may): too little host memory for a second
    copy. Unknown free memory does not refuse."""
    available = available_host_bytes() if available is None else available
    need = int(PACKING_MEMORY_FACTOR * linear_weight_bytes(model))
    if available is not None and available < need:
        return f"packing needs ~{need / 2**30:.2f} GiB of free host memory, {available / 2**30:.2f} GiB available"
    return None


class StepNotCompiled(RuntimeError):
    """Dynamo would not compile this call (its code object hit torch._dynamo.config.recompile_limit): run it
    eagerly. Raised before anything ran, so the call has no effect yet."""


# owner (a model) -> the code object its steps compile: dynamo's graphs and recompile limit are per code object
_CODE_OF_OWNER: weakref.WeakKeyDictionary[object, dict[types.CodeType, types.CodeType]] = weakref.WeakKeyDictionary()


def own_code(fn: Callable[..., torch.Tensor], owner: object | None = None) -> Callable[..., torch.Tensor]:
    """`fn` over a copy of its code object, so dynamo's graphs and recompile limit are this caller's alone; callers
    passing the same `owner` (weakly held) share one copy."""
    func = fn.__func__ if inspect.ismethod(fn) else fn
    code = func.__code__.replace() if owner is None else \
        _CODE_OF_OWNER.setdefault(owner, {}).setdefault(func.__code__, func.__code__.replace())
    copy = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
    return types.MethodType(copy, fn.__self__) if inspect.ismethod(fn) else copy


class CompiledStep:
    def __init__(self, fn: Callable[..., torch.Tensor], packed: bool = True, unpacked_reason: str | None = None,
                 owner: object | None = None):
        """owner: the model whose weights the graphs freeze; steps with the same owner share one code object (None: this
        step's alone)."""
        self._fn = own_code(fn, owner)
        self.packed = packed
        self.fallback: str | None = None  # why the packed kernels failed to compile (None: they did, or not tried)
        self.unpacked_reason = unpacked_reason  # why they were not asked for
        self._compiled = self._compile()

    def _compile(self) -> Callable[..., torch.Tensor]:
        return torch.compile(self._fn, dynamic=None, options=dict(PACKED_GEMM_OPTIONS) if self.packed else None)

    def __call__(self, *args) -> torch.Tensor:
        """The compiled function's result; StepNotCompiled where dynamo would run it eagerly instead."""
        from torch._dynamo import config as dynamo_config
        from torch._dynamo.exc import FailOnRecompileLimitHit

        try:
            with dynamo_config.patch(fail_on_recompile_limit_hit=True):
                return self._call(*args)
        except FailOnRecompileLimitHit as exc:
            raise StepNotCompiled(f"this model's steps hold torch._dynamo.config.recompile_limit "
                                  f"({dynamo_config.recompile_limit}) compiled graphs already") from exc

    def _call(self, *args) -> torch.Tensor:
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
