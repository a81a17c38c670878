"""The engine's KV-cache manager built from its config: the chunk store's tiers, and with paged_kv the block pool
(kv/paged_kv.py), its host offload and the streaming of contexts longer than the device holds (kv/streamed_kv.py)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..chunking import Chunker
from ..config import EngineConfig
from ..store.tiered import build_store
from .device_budget import device_kv_budget
from .manager import KVCacheManager
from .paged_kv import build_paged_kv
from .streamed_kv import StreamedKV, device_max_tokens
from .workspace import LayerShape


def build_kv_manager(config: EngineConfig, namespace: str, chunker: Chunker, model: torch.nn.Module,
                     shapes: Sequence[LayerShape], kv_dtype: torch.dtype, device: torch.device,
                     max_context: int | None) -> KVCacheManager:
    paged = config.paged_kv
    device_budget = device_kv_budget(config.device_kv_budget_bytes, device)
    # Unpaged: the store's memory tier is the device's (device_budget) and a host tier holds what it evicts.
    store = build_store(config, namespace, memory_budget_bytes=0 if paged else None,
                        device_budget_bytes=None if paged else device_budget, pin_host=device.type == "cuda")
    blocks = streamed = None
    if paged:
        max_tokens = device_max_tokens(config.device_kv_max_tokens, device, device_budget, shapes, kv_dtype,
                                       max_context)
        blocks = build_paged_kv(chunker, shapes, kv_dtype, device, config.memory_budget_bytes, config.kv_block_size,
                                max_context, slow=store if store.slow_tiers else None,
                                device_budget_bytes=device_budget, device_max_tokens=max_tokens)
        if max_tokens is not None:
            if blocks.host is None:
                raise ValueError("device_kv_max_tokens streams long contexts from host memory: it needs host offload "
                                 "(device_kv_budget_bytes, and a memory_budget_bytes of at least one block)")
            streamed = StreamedKV(blocks, max_tokens)
    return KVCacheManager(config, namespace, chunker, store, model, blocks=blocks, streamed=streamed)
