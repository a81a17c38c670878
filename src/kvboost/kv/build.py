"""The engine's KV-cache manager built from its config: the chunk store's tiers behind one manager. On a GPU the
memory tier is the device's (device_kv_budget_bytes) and a host tier holds what it evicts (store/host.py)."""
from __future__ import annotations

import torch

from ..chunking import Chunker
from ..config import EngineConfig
from ..store.tiered import build_store
from .device_budget import device_kv_budget
from .manager import KVCacheManager


def build_kv_manager(config: EngineConfig, namespace: str, chunker: Chunker, model: torch.nn.Module,
                     device: torch.device) -> KVCacheManager:
    store = build_store(config, namespace, device_budget_bytes=device_kv_budget(config.device_kv_budget_bytes, device),
                        pin_host=device.type == "cuda")
    return KVCacheManager(config, namespace, chunker, store, model)
