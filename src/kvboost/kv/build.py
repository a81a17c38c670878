"""The engine's KV-cache manager built from its config: the chunk store's tiers behind one manager."""
from __future__ import annotations

import torch

from ..chunking import Chunker
from ..config import EngineConfig
from ..store.tiered import build_store
from .manager import KVCacheManager


def build_kv_manager(config: EngineConfig, namespace: str, chunker: Chunker, model: torch.nn.Module) -> KVCacheManager:
    return KVCacheManager(config, namespace, chunker, build_store(config, namespace), model)
