"""How an engine's fast path is chosen (EngineConfig.fast_path -> a ModelRunner and why) and reported
(cache_stats()["fast_path"])."""
from __future__ import annotations

import os

import torch

from ..kv.workspace import KVWorkspace
from .aot_build import AOT_ENV, DecodePackage, package_refusal
from .aot_step import default_package_dir
from .compiled_step import packing_refusal
from .runner import ModelRunner, static_path_unsupported_reason


def fast_path_stats(runner: ModelRunner | None, reason: str, cpu_linear: str) -> dict:
    """cache_stats()["fast_path"]: the runner's mode, why, and its step counts."""
    return {"mode": runner.mode if runner else "off", "reason": reason, "failure": runner.failure if runner else None,
            "decode_kernels": runner.decode_kernels if runner else None,
            "compiled_steps": runner.compiled_steps if runner else [], "cpu_linear": cpu_linear,
            **(runner.stats if runner else {})}


def make_runner(choice: str, model: torch.nn.Module, workspace: KVWorkspace, attention: str,
                verifies: bool = False) -> tuple[ModelRunner | None, str]:
    """The engine's runner for EngineConfig.fast_path, and why (the choice is valid here: config.RULES refused those
    that cannot run). "auto": CUDA graphs on CUDA when the engine attends with the Triton kernels and the model runs
    over a static cache; on a CPU, the batch-1 decode step from a package (cached on disk, else built in the background
    while the engine decodes eagerly: aot_build.py); else the ordinary eager path ("off"). verifies: the engine
    speculates (its verify step is made ready at load, and compiled in compiled mode)."""
    if choice == "off":
        return None, "off"
    device = workspace.device
    backend = attention if attention in ("sdpa", "triton") else None
    if choice == "auto":
        reason = static_path_unsupported_reason(model)
        if device.type == "cpu":
            return _package_runner(model, workspace, backend, reason)
        if device.type != "cuda":
            return None, f"off: auto on {device.type} (CUDA graphs need a GPU)"
        if attention != "triton":
            return None, f"off: the engine attends with {attention!r}, graphs need the Triton kernels"
        if reason is not None:
            return None, f"off: {reason}"
    if choice in ("auto", "graphs"):  # auto: a capture that fails runs eagerly from then on
        return ModelRunner(model, workspace, mode="graphs", backend="triton", fallback_on_failure=choice == "auto",
                           verifies=verifies), "CUDA graphs per bucket" + (" (auto)" if choice == "auto" else "")
    if choice == "compiled":
        refusal = packing_refusal(model)
        kernels = "ATen GEMV" if refusal else "packed GEMV kernels"
        steps = "decode (one request's and a batch's) and verify steps" if verifies else \
            "decode steps (one request's and a batch's)"
        return ModelRunner(model, workspace, mode="compiled", backend=backend, packed_gemv=refusal is None,
                           unpacked_reason=refusal, verifies=verifies), \
            f"static cache, {steps} under torch.compile over {kernels}"
    return ModelRunner(model, workspace, mode="eager", backend=backend, verifies=verifies), "static cache, eager"


def _package_runner(model: torch.nn.Module, workspace: KVWorkspace, backend: str | None,
                    static_unsupported: str | None) -> tuple[ModelRunner | None, str]:
    """auto on a CPU: the batch-1 decode step from its package, everything else on the eager path."""
    directory, choice = default_package_dir(), os.environ.get(AOT_ENV, "1")
    refusal = static_unsupported or package_refusal(model, directory)
    if choice == "0" or refusal is not None:
        return None, f"off: {refusal or AOT_ENV + '=0'}"
    package = DecodePackage(model, workspace.shapes, backend, directory, build=choice != "cached",
                            kv_dtype=workspace.dtype)
    if package.step is None and not package.attempted:  # none cached, none to build: a build that ran says why
        return None, f"off: {package.failure}"
    return ModelRunner(model, workspace, mode="package", backend=backend, package=package), \
        f"{package.description} (auto)"
