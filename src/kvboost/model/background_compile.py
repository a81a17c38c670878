"""BackgroundCompile: the CPU fast path's compile, run beside the engine instead of before it (fast_path="auto").

Compiling the CPU decode steps (compiled_step.py) takes about a minute for a 135M model, and inductor cannot cache
frozen graphs over packed weights on disk, so an engine that compiled at load would make every user wait that long.
Under "auto" the runner declines its steps (the engine's eager path runs them) until the compiled steps are ready:
once the engine has decoded START_AFTER_STEPS tokens — it is being used for more than a one-off call — a daemon
thread compiles them on a twin of the model, and the runner switches to them at its next step.

The twin shares every parameter and buffer with the model (no weight copy) but has its own modules and configs, with
its attention set to the static steps' for good: the compile thread never touches what the engine's forwards read
(the attention switch writes the configs), and the compiled graphs' guards always find the twin as they traced it.
Its steps run over a small workspace of their own, so the compile writes no K/V the engine holds.
"""
from __future__ import annotations

import atexit
import copy
import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from ..kv.workspace import KVWorkspace
from .attention.static import KVBOOST_STATIC
from .attention.switch import attention_configs
from .compiled_step import CompiledStep

log = logging.getLogger(__name__)

START_AFTER_STEPS = 256  # decode steps the engine runs eagerly before the compile starts
# Models whose Linear weights are smaller stay eager: their step is a few milliseconds of Python, and a compile of
# tens of seconds on a small host takes longer to pay back than most sessions last.
MIN_LINEAR_WEIGHT_BYTES = 32 * 2**20


_RUNNING: weakref.WeakSet[BackgroundCompile] = weakref.WeakSet()
EXIT_JOIN_SECONDS = 10.0


class CompileCancelled(BaseException):
    """Raised inside a background compile's thread when the interpreter exits: the compile stops at its next Python
    step, so no compiler thread is still running while the process finalizes."""


@atexit.register
def _cancel_running() -> None:
    for compile_ in list(_RUNNING):
        compile_.cancel()


def twin_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` over the same parameter and buffer tensors, attending with the static steps' function."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    for config in attention_configs(twin):
        config._attn_implementation_internal = KVBOOST_STATIC
    return twin


class BackgroundCompile:
    def __init__(self, build_runner: Callable[[torch.nn.Module, KVWorkspace], object], model: torch.nn.Module,
                 workspace: KVWorkspace, start_after: int | None = None):
        """build_runner(twin, workspace): a compiled-mode runner over the twin, whose compile_all() compiles its
        steps."""
        self._build_runner, self._model = build_runner, model
        self._shapes, self._dtype, self._device = workspace.shapes, workspace.dtype, workspace.device
        self.start_after = START_AFTER_STEPS if start_after is None else start_after
        self.eager_steps = 0
        self.state = "waiting"  # -> "compiling" -> "ready" | "failed"
        self.error: str | None = None
        self.seconds: float | None = None  # the compile's wall time, once ready
        self.step: CompiledStep | None = None  # the twin's compiled step, once ready
        self._started = 0.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def count_eager_step(self) -> None:
        """One more decode step ran eagerly; the compile starts at the threshold."""
        self.eager_steps += 1
        if self.state == "waiting" and self.eager_steps >= self.start_after:
            self.start()

    def start(self) -> None:
        with self._lock:
            if self.state != "waiting":
                return
            self.state, self._started = "compiling", time.perf_counter()
        log.info("kvboost: compiling the CPU decode steps in the background; decoding eagerly until they are ready")
        self._thread = threading.Thread(target=self._compile, name="kvboost-compile", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def cancel(self, join_seconds: float = EXIT_JOIN_SECONDS) -> None:
        """Stop a running compile (at its next Python step) and wait for its thread, at most join_seconds."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread.ident is None:
            return
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CompileCancelled))
        thread.join(join_seconds)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile ends (started now if it was waiting); True if the compiled steps are ready."""
        self.start()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready

    def _compile(self) -> None:
        try:
            twin = twin_model(self._model)
            runner = self._build_runner(twin, KVWorkspace(self._shapes, self._dtype, self._device))
            with torch.inference_mode():
                runner.compile_all()
            self.step = runner.compiled_step
            self.seconds = time.perf_counter() - self._started
            self.state = "ready"
            log.info("kvboost: compiled CPU decode steps ready after %.0f s", self.seconds)
        except CompileCancelled:
            self.error, self.state = "cancelled", "failed"
        except Exception as exc:  # the engine keeps its eager path; the reason is reported in cache_stats()
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            self.state = "failed"
            log.warning("kvboost: background compile failed (%s); decoding stays eager", self.error)
        finally:
            _RUNNING.discard(self)

    def describe(self) -> str:
        if self.state == "waiting":
            return f"compiles in the background after {self.start_after} eager decode steps ({self.eager_steps} so far)"
        if self.state == "compiling":
            return f"compiling in the background for {time.perf_counter() - self._started:.0f} s; eager until ready"
        if self.state == "ready":
            return f"compiled in the background in {self.seconds:.0f} s"
        return f"background compile failed ({self.error}); eager"
