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

Dynamo keeps compiled graphs per *code object* and lets each hold `recompile_limit` of them (8 in torch 2.13); past
that it runs the function eagerly and only logs. Every runner compiles the same method (ModelRunner._logits), so
with one shared code object a fifth speculating engine in a process (2 graphs each) ran its steps eagerly while
reporting them compiled. So the steps of each model compile a copy of the function with a code object of the
model's own (`own_code`): its graphs are that model's, counted against their own limit, and freed with the model.
Steps over the same model (an engine created again on it, a batch runner's) share that code object and reuse its
graphs: the frozen weights are the same. The limit can still be reached by one model's steps (a step recompiled
for many shapes): the call then raises StepNotCompiled, which the runner turns into an eager run of that kind of
step, counted and reported.
"""
from __future__ import annotations

import inspect
import logging
import os
import types
import weakref
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


class StepNotCompiled(RuntimeError):
    """Dynamo would not compile this call (its code object hit torch._dynamo.config.recompile_limit): run it
    eagerly. Raised before anything ran, so the call has no effect yet."""


# owner (a model) -> the code object its steps compile: dynamo's graphs and recompile limit are per code object
_CODE_OF_OWNER: weakref.WeakKeyDictionary[object, dict[types.CodeType, types.CodeType]] = weakref.WeakKeyDictionary()


def own_code(fn: Callable[..., torch.Tensor], owner: object | None = None) -> Callable[..., torch.Tensor]:
    """`fn` (a function or bound method) over a copy of its code object, so that dynamo's compiled graphs and
    recompile limit are this caller's alone; with `owner` (weakly held), every caller passing the same owner
    gets the same copy (and so shares its graphs)."""
    func = fn.__func__ if inspect.ismethod(fn) else fn
    if owner is None:
        code = func.__code__.replace()
    else:
        code = _CODE_OF_OWNER.setdefault(owner, {}).setdefault(func.__code__, func.__code__.replace())
    copy = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
    return types.MethodType(copy, fn.__self__) if inspect.ismethod(fn) else copy


class CompiledStep:
    def __init__(self, fn: Callable[..., torch.Tensor], packed: bool = True, unpacked_reason: str | None = None,
                 owner: object | None = None):
        """owner: what the compiled graphs belong to (the model whose weights they freeze): steps with the same
        owner share one code object, others never do (None: this step's alone)."""
        self._fn = own_code(fn, owner)
        self.packed = packed
        self.fallback: str | None = None  # why the packed kernels failed to compile (None: they did, or not tried)
        self.unpacked_reason = unpacked_reason  # why they were not asked for
        self._compiled = self._compile()

    def _compile(self) -> Callable[..., torch.Tensor]:
        if self.packed:
            return torch.compile(self._fn, dynamic=None, options=dict(PACKED_GEMM_OPTIONS))
        return torch.compile(self._fn, dynamic=None)

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
