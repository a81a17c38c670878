"""The decode-step package of one model (aot_step.py), made ready without blocking the engine.

A package in the disk cache loads at once. Otherwise a child process (`python -m kvboost.model.aot_build`, so no user
script is re-imported) builds it on one thread while the engine decodes eagerly on the others; a watcher thread then
loads it, and the runner uses it from the next step. One build runs at a time per process; a build still running at
exit is stopped and leaves nothing behind. OpenMP thread counts are per calling thread, so the thread that steps the
engine gives up its core itself (`share_cores`).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from .aot_step import AotDecodeStep, build_package, default_package_dir, package_key
from .compiled_step import linear_weight_bytes, packing_refusal

log = logging.getLogger(__name__)

# "0": no package (auto on a CPU decodes eagerly); "cached": a cached package loads, none is built; else (the
# default) a missing package is built in the background.
AOT_ENV = "KVBOOST_AOT"
# Free disk a build needs, in weights' bytes: the package holds them twice (packed and as given), and the child reads
# the model from a temporary file.
DISK_FACTOR = 3.5
_BUILD_LOCK = threading.Lock()  # one build at a time: each takes a core
_building = 0  # builds running in this process
_local = threading.local()  # per stepping thread: its thread count before a build took a core


def package_refusal(model: torch.nn.Module, directory: Path) -> str | None:
    """Why the decode step should not run from a package here (None: it may)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"the decode-step package is built for float32 CPU models, this one is {param.dtype} on {param.device}"
    refusal = packing_refusal(model)
    if refusal is not None:
        return refusal
    probe = next((p for p in (directory, *directory.parents) if p.exists()), None)
    need = int(DISK_FACTOR * linear_weight_bytes(model))
    if probe is not None and shutil.disk_usage(probe).free < need:
        return f"building the decode-step package needs ~{need / 2**30:.1f} GiB free in {directory}"
    return None


def share_cores() -> None:
    """Called by the thread that steps an engine before each step: one thread fewer while a package builds (the build
    has one core; both slow down several-fold when they fight for it), the count it had once none does."""
    if _building and not hasattr(_local, "threads"):
        _local.threads = torch.get_num_threads()
        torch.set_num_threads(max(1, _local.threads - 1))
    elif not _building and hasattr(_local, "threads"):
        torch.set_num_threads(_local.threads)
        del _local.threads


class DecodePackage:
    """`step` is the loaded package once ready (None before, and for good where `failure` says why)."""

    def __init__(self, model: torch.nn.Module, shapes: list, backend: str | None, directory: Path | None = None,
                 build: bool = True):
        """build: start a build when no package is cached."""
        directory = default_package_dir() if directory is None else directory
        self.path = directory / f"{package_key(model, backend)}.pt2"
        self.step: AotDecodeStep | None = None
        self.failure: str | None = None
        self.building = False
        if self.path.exists():
            self._load()
        elif build:
            self._start(model, shapes, backend)
        else:
            self.failure = f"no decode-step package cached in {directory} ({AOT_ENV}=cached)"

    @property
    def description(self) -> str:
        if self.step is not None:
            return f"batch-1 decode steps from an AOTInductor package (packed GEMV kernels), {self.path}"
        if self.building:
            return f"eager until the decode-step package is built in the background ({self.path})"
        return f"eager: {self.failure}"

    def _load(self) -> None:
        try:
            self.step = AotDecodeStep(self.path)
        except Exception as exc:  # a package this torch cannot load: decode eagerly
            self.fail(f"loading {self.path} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    def fail(self, why: str) -> None:
        self.step, self.failure = None, why
        log.warning("kvboost: %s; decode steps run eagerly", why)

    def _start(self, model: torch.nn.Module, shapes: list, backend: str | None) -> None:
        global _building
        job = self.path.with_name(f"{self.path.stem}.{os.getpid()}.{id(self)}.job.pt")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model, "shapes": shapes, "backend": backend}, job)
        except Exception as exc:  # a model that does not pickle, a cache directory that cannot be written
            job.unlink(missing_ok=True)
            self.failure = f"the decode-step package cannot be built: {type(exc).__name__}: {exc}"
            return
        self.building = True
        _building += 1
        threading.Thread(target=self._build, args=(job,), daemon=True, name="kvboost-aot-build").start()

    def _build(self, job: Path) -> None:
        global _building
        log_path = self.path.with_suffix(".log")
        try:
            with _BUILD_LOCK, open(log_path, "w") as out:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
                child = subprocess.Popen([sys.executable, "-m", __name__, str(job), str(self.path)], env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
                _CHILDREN.add(child)
                code = child.wait()
                _CHILDREN.discard(child)
            if code == 0 and self.path.exists():
                self._load()
                log_path.unlink(missing_ok=True)
            else:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                self.fail(f"building the decode-step package failed (exit {code}: {tail[0][:200]}; log {log_path})")
        except Exception as exc:
            self.fail(f"building the decode-step package failed: {type(exc).__name__}: {exc}")
        finally:
            job.unlink(missing_ok=True)
            self.building = False
            _building -= 1


_CHILDREN: set[subprocess.Popen] = set()


@atexit.register
def _stop_builds() -> None:
    """A build still running at exit is stopped (its process group: the compiler too); it removes its partial file."""
    for child in list(_CHILDREN):
        try:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired, OSError):
            pass


def _main(job: str, path: str) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so build_package's cleanup runs
    torch.set_num_threads(1)
    from torch._inductor import config as inductor_config

    inductor_config.compile_threads = 1
    spec = torch.load(job, weights_only=False, mmap=True)
    Path(job).unlink(missing_ok=True)
    with torch.no_grad():
        build_package(spec["model"], spec["shapes"], spec["backend"], Path(path))


if __name__ == "__main__":
    _main(*sys.argv[1:3])
