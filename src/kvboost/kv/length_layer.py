"""What KVBoost's cache layers share: transformers sizes a step's masks from the positions before it (`length`)."""
from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin


class BufferLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.is_initialized = True  # buffers exist before the first update

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def get_max_length(self) -> int:
        return -1


class LengthLayer(BufferLayer):
    length: int  # positions before the next step

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        # transformers passes the query length (>= 5.2x) or the cache_position tensor (earlier 5.x)
        q = query.shape[0] if hasattr(query, "shape") else int(query)
        return self.length + q, 0

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
