"""Forward helpers: learn a model's per-layer K/V shapes, run tokens after what a Cache holds."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from transformers.cache_utils import Cache

from ..kv.workspace import LayerShape
from .cache_arg import cache_kwargs, returned_cache


def probe_layer_shapes(model: torch.nn.Module) -> tuple[list[LayerShape], torch.dtype]:
    """Run one token through the model to learn each layer's cached K/V shape and dtype."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True)
    cache = returned_cache(out)
    shapes, dtype = [], None
    for layer in cache.layers:
        if layer.keys is None:
            raise ValueError(f"{type(model).__name__}: a cache layer holds no keys; KV sharing layers are unsupported")
        shapes.append(LayerShape(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]))
        dtype = layer.keys.dtype
    return shapes, dtype


ATTENTION_BACKENDS = ("auto", "model", "sdpa", "triton")


def resolve_attention(choice: str, model: torch.nn.Module) -> tuple[str, str]:
    """The attention the engine's own forwards use, and why: "model" (its own), "sdpa" (torch SDPA without cuDNN, which
    plans per new shape) or "triton" (KVBoost's kernels). "auto": triton on CUDA where it runs (graphs need its device
    lengths), else sdpa on CUDA and CPU (GQA without repeated K/V copies); the model's own where it does not dispatch
    through AttentionInterface, and on other devices."""
    device = next(model.parameters()).device
    if choice == "model" or (choice == "auto" and device.type not in ("cuda", "cpu")):
        return "model", "the model's own attention" if choice == "model" else f"auto on {device.type}"
    from .attention.hf import unsupported_reason

    reason = unsupported_reason(model)
    if reason is not None:
        return "model", reason
    if choice == "auto" and device.type == "cpu":
        return "sdpa", "torch SDPA with enable_gqa (auto on cpu)"
    if choice == "triton":
        return "triton", "KVBoost's Triton kernels"
    if choice == "sdpa":
        return "sdpa", "torch SDPA, cuDNN excluded"
    from .attention.backend import select_backend

    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    picked, why = select_backend(device, next(model.parameters()).dtype, head_dim)
    if picked == "triton":
        return "triton", f"auto on cuda: {why}"
    return "sdpa", f"torch SDPA, cuDNN excluded (auto on cuda: {why})"


def attention_context(model: torch.nn.Module, backend: str) -> AbstractContextManager:
    """The block inside which a forward runs with the engine's attention (resolve_attention's choice)."""
    if backend == "model":
        return nullcontext()
    from .attention.hf import kvboost_attention

    return kvboost_attention(model, backend=backend)


def forward_tokens(model: torch.nn.Module, token_ids: list[int] | torch.Tensor, cache: Cache,
                   logits_to_keep: int = 1, attention: str = "model") -> torch.Tensor:
    """float32 logits [batch, logits_to_keep, vocab] of tokens run after what the cache holds (engine lock held)."""
    device = next(model.parameters()).device
    if isinstance(token_ids, torch.Tensor):
        ids = torch.atleast_2d(token_ids.to(device))
    else:  # built where the model lives: no CPU tensor and extra host-to-device copy per decode step
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    with attention_context(model, attention):
        out = model(input_ids=ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits.float()
