"""The decode-step package of one model (aot_step.py), made ready without blocking the engine.

A package in the disk cache loads at once. Otherwise a child process (`python -m kvboost.model.aot_build`, so no user
script is re-imported) builds it on one thread while the engine decodes eagerly on the others; a watcher thread then
loads it, and the runner uses it from the next step. A lock file beside the package (holding the builder's pid) makes
one build per package across processes: a second engine waits for the running build instead of starting another. The
build outlives its engine's process, so a short run (a demo, a script) still leaves the package for the next one; it
writes atomically and removes its job, log and lock files. One build runs at a time per process. OpenMP thread counts
are per calling thread, so the thread that steps the engine gives up its core itself (`share_cores`).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .aot_step import AotDecodeStep, build_package, default_package_dir, package_key
from .compiled_step import packing_refusal

log = logging.getLogger(__name__)

# "0": no package (auto on a CPU decodes eagerly); "cached": a cached package loads, none is built; else (the
# default) a missing package is built in the background.
AOT_ENV = "KVBOOST_AOT"
# Free disk a build needs, in the model's bytes: the package holds its weights twice (packed and as given), and the
# child reads the model from a temporary file.
DISK_FACTOR = 3.5
_BUILD_LOCK = threading.Lock()  # one build at a time: each takes a core
_building = 0  # builds this process runs or waits for
_unspawned: set[Path] = set()  # job and lock files of builds not started yet: removed at exit
POLL_S = 0.5
_local = threading.local()  # per stepping thread: its thread count before a build took a core


def package_refusal(model: torch.nn.Module, directory: Path) -> str | None:
    """Why the decode step should not run from a package here (None: it may). Quantized layers (model/int4) run their
    CPU kernels inside the package."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"the decode-step package is built for float32 CPU models, this one is {param.dtype} on {param.device}"
    refusal = packing_refusal(model)
    if refusal is not None:
        return refusal
    probe = next((p for p in (directory, *directory.parents) if p.exists()), None)
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    need = int(DISK_FACTOR * sum(t.numel() * t.element_size() for t in tensors.values()))
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
                 build: bool = True, kv_dtype: torch.dtype = torch.float32):
        """build: start a build when no package is cached (or wait for the one running); kv_dtype: the workspace's."""
        directory = default_package_dir() if directory is None else directory
        self.threads = torch.get_num_threads()  # the engine's: the build runs on one, for this many
        self.embedding = model.get_input_embeddings()  # looked up outside the package
        self.path = directory / f"{package_key(model, backend, self.threads, kv_dtype)}.pt2"
        self.lock = self.path.with_suffix(".lock")
        self.step: AotDecodeStep | None = None
        self.failure: str | None = None
        self.building = False
        self.attempted = False  # a build started here (it may have ended, even failed, by the time anyone looks)
        self.spawn_error = ""
        if self.path.exists():
            self._load()
        elif build:
            self._start(model, shapes, backend, kv_dtype)
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
            self.step = AotDecodeStep(self.path, self.embedding)
        except Exception as exc:  # a package this torch cannot load: decode eagerly
            self.fail(f"loading {self.path} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    def fail(self, why: str) -> None:
        self.step, self.failure = None, why
        log.warning("kvboost: %s; decode steps run eagerly", why)

    def _start(self, model: torch.nn.Module, shapes: list, backend: str | None, kv_dtype: torch.dtype) -> None:
        global _building
        # The child needs the module itself, so the job is a pickle; it lives in a private (0700) directory of this
        # user's, only until the child has loaded it, and is never read from the shared cache directory.
        job = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            mine = _take_lock(self.lock)
            if mine:
                job = Path(tempfile.mkdtemp(prefix="kvboost-aot-")) / "job.pt"
                _unspawned.update((job, self.lock))
                torch.save({"model": model, "shapes": shapes, "backend": backend, "threads": self.threads,
                            "kv_dtype": kv_dtype}, job)
        except Exception as exc:  # a model that does not pickle, a cache directory that cannot be written
            _forget(job, self.lock)
            self.failure = f"the decode-step package cannot be built: {type(exc).__name__}: {exc}"
            return
        self.building = self.attempted = True
        _building += 1
        log.info("kvboost: %s the decode-step package %s in the background (%s=0 turns this off)",
                 "building" if mine else "waiting for another process building", self.path, AOT_ENV)
        if not mine:
            threading.Thread(target=self._wait_for_other, daemon=True, name="kvboost-aot-wait").start()
        elif _BUILD_LOCK.acquire(blocking=False):  # spawned now: a process that exits at once still gets its build
            threading.Thread(target=self._watch, args=(job, self._spawn(job)), daemon=True,
                             name="kvboost-aot-build").start()
        else:  # after this process's running build
            threading.Thread(target=self._queued, args=(job,), daemon=True, name="kvboost-aot-queue").start()

    def _spawn(self, job: Path) -> subprocess.Popen | None:
        try:
            with open(self.path.with_suffix(".log"), "w") as out:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
                child = subprocess.Popen([sys.executable, "-m", __name__, str(job), str(self.path)], env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            self.lock.write_text(str(child.pid))
            _unspawned.difference_update((job, self.lock))  # the child's now: it removes them
            return child
        except Exception as exc:
            _forget(job, self.lock)
            self.spawn_error = f"{type(exc).__name__}: {exc}"
            return None

    def _queued(self, job: Path) -> None:
        _BUILD_LOCK.acquire()
        self._watch(job, self._spawn(job))

    def _watch(self, job: Path, child: subprocess.Popen | None) -> None:
        """Wait for the child, then load its package; releases _BUILD_LOCK."""
        try:
            if child is None:
                return self._finish(self.spawn_error)
            code = child.wait()
            _forget(job, self.lock if _lock_holder(self.lock) == child.pid else None)
            self._finish(f"exit {code}")
        finally:
            _BUILD_LOCK.release()

    def _wait_for_other(self) -> None:
        while _holder_alive(self.lock):
            time.sleep(POLL_S)
        self._finish(f"the process that held {self.lock} ended")

    def _finish(self, outcome: str) -> None:
        global _building
        log_path = self.path.with_suffix(".log")
        try:
            if self.path.exists():
                self._load()
            else:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
                self.fail(f"building the decode-step package failed ({outcome}: {(tail or ['no output'])[0][:200]}; "
                          f"log {log_path})")
        finally:
            self.building = False
            _building -= 1


def _lock_holder(lock: Path) -> int | None:
    try:
        return int(lock.read_text() or 0)
    except (OSError, ValueError):
        return None


def _holder_alive(lock: Path) -> bool:
    pid = _lock_holder(lock)
    if not pid:
        return lock.exists()  # being written
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def _take_lock(lock: Path) -> bool:
    """Create `lock` holding this process's pid; False where a live process holds it (a stale one is taken over)."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _holder_alive(lock):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _forget(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            _remove(path)
            _unspawned.discard(path)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    if path.name == "job.pt":  # and its private directory
        with contextlib.suppress(OSError):
            path.parent.rmdir()


@atexit.register
def _remove_unspawned() -> None:
    """Builds still queued at exit leave no job or lock file (one already running goes on and finishes)."""
    _forget(*list(_unspawned))


def _main(job: str, path: str) -> None:
    lock, log_path = Path(path).with_suffix(".lock"), Path(path).with_suffix(".log")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the cleanup below runs
    try:
        torch.set_num_threads(1)
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1
        spec = torch.load(job, weights_only=False, mmap=True)  # our own job: see DecodePackage._start
        _remove(Path(job))
        with torch.no_grad():
            build_package(spec["model"], spec["shapes"], spec["backend"], Path(path), spec["threads"], spec["kv_dtype"])
        log_path.unlink(missing_ok=True)  # a failed build keeps its log
    finally:
        _remove(Path(job))
        if _lock_holder(lock) == os.getpid():
            lock.unlink(missing_ok=True)


if __name__ == "__main__":
    _main(*sys.argv[1:3])
