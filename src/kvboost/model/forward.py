"""Forward helpers: learn a model's per-layer K/V shapes, run tokens after what a Cache holds."""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..kv.workspace import LayerShape


def probe_layer_shapes(model: torch.nn.Module) -> tuple[list[LayerShape], torch.dtype]:
    """Run one token through the model to learn each layer's cached K/V shape and dtype."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True)
    cache = out.past_key_values
    shapes, dtype = [], None
    for layer in cache.layers:
        if layer.keys is None:
            raise ValueError(f"{type(model).__name__}: a cache layer holds no keys; KV sharing layers are unsupported")
        shapes.append(LayerShape(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]))
        dtype = layer.keys.dtype
    return shapes, dtype


def forward_tokens(model: torch.nn.Module, token_ids: list[int] | torch.Tensor, cache: Cache,
                   logits_to_keep: int = 1) -> torch.Tensor:
    """Run tokens after what the cache holds; returns float32 logits of the last `logits_to_keep` positions.

    Shape: [batch, logits_to_keep, vocab]. Positions follow from the cache length, as in generate().
    """
    device = next(model.parameters()).device
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids.to(device)
    else:  # built where the model lives: no CPU tensor and extra host-to-device copy per decode step
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits.float()
