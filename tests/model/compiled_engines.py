"""A plain engine and a fast_path="compiled" one over the same seeded tiny model, for the compiled-step tests."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost

from ..tiny_models import make_tiny_model


def plain_and_compiled(tokenizer, device: torch.device, **options) -> tuple[KVBoost, KVBoost]:
    """(fast_path="off", fast_path="compiled" with `options`), after a dynamo reset; skips off the CPU."""
    import torch._dynamo

    if device.type != "cpu":
        pytest.skip("fast_path='compiled' is the CPU path (CUDA runs graphs)")
    torch._dynamo.reset()

    def model():
        return make_tiny_model("llama", tokenizer, device=device, max_position_embeddings=4096)

    return KVBoost(model(), tokenizer, fast_path="off", chunk_size=16), \
        KVBoost(model(), tokenizer, fast_path="compiled", chunk_size=16, **options)
