"""The engine's resolved plan: which attention, fast path, CPU products, KV design and tiers, and why - decided once,
printed at start-up and reported in cache_stats()["plan"]."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from .config import EngineConfig, Environment
from .model.attention.hf import unsupported_reason as attention_unsupported_reason
from .model.cpu_linear import cpu_linear_reason
from .model.int4.linear import layout_mismatch, weight_formats
from .model.runner import static_path_unsupported_reason

log = logging.getLogger("kvboost")


def environment(model: torch.nn.Module, has_draft_model: bool) -> Environment:
    """What the rules need to know of the model and its device."""
    param = next(model.parameters())
    device = param.device
    triton = "not a CUDA device"
    if device.type == "cuda":
        from .model.attention.backend import select_backend

        config = model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        picked, why = select_backend(device, param.dtype, head_dim, prefer="triton")
        triton = None if picked == "triton" else why
    return Environment(device.type, attention_unsupported_reason(model), triton,
                       static_path_unsupported_reason(model), cpu_linear_reason(model), has_draft_model,
                       ", ".join(weight_formats(model)) or None, layout_mismatch(model, device.type),
                       str(param.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class EnginePlan:
    device: str
    dtype: str
    attention: str
    attention_reason: str
    fast_path: str
    fast_path_reason: str
    cpu_linear: str
    kv_dtype: str  # the workspace's and stored chunks' dtype, and why
    kv_design: str  # the one design: "workspace rows" and where stored chunks live
    long_contexts: str
    speculative: str
    max_batch_size: int

    def lines(self) -> list[str]:
        return [f"device {self.device}, {self.dtype}; up to {self.max_batch_size} requests per step",
                f"attention: {self.attention} ({self.attention_reason})",
                f"fast path: {self.fast_path} ({self.fast_path_reason})",
                f"CPU products: {self.cpu_linear}",
                f"KV: {self.kv_dtype}; {self.kv_design}; {self.long_contexts}",
                f"speculative decoding: {self.speculative}"]

    def as_dict(self) -> dict:
        return asdict(self)


def describe(config: EngineConfig, device: torch.device, dtype: torch.dtype, kv_dtype: str, attention: str,
             attention_reason: str, fast_path: str, fast_path_reason: str, cpu_linear: str, tiers: list[str],
             max_device_tokens: int | None) -> EnginePlan:
    """dtype: the model's; kv_dtype: the K/V's, with why."""
    long = ("contexts over " + f"{max_device_tokens:,}" + " tokens run from host memory, streamed a layer at a time"
            if max_device_tokens is not None else "every context on the device")
    spec = config.speculative or "off"
    if config.speculative == "prompt_lookup":
        spec += f" (up to {config.num_speculative_tokens} drafts)"
    plan = EnginePlan(str(device), str(dtype).removeprefix("torch."), attention, attention_reason, fast_path,
                      fast_path_reason, cpu_linear, kv_dtype, "one workspace row per running request; stored chunks in "
                      + " -> ".join(tiers), long, spec, config.max_batch_size)
    log.info("kvboost plan: %s", "; ".join(plan.lines()))
    return plan
