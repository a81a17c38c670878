"""The name transformers gives the KV cache in a model call: `cache` from 5.24, `past_key_values` before. A 5.23
forward takes `cache=` silently into **kwargs and runs without it, so the name is read from the installed signature."""
from __future__ import annotations

import inspect
from typing import Any

from transformers import GenerationMixin

# prepare_inputs_for_generation takes the cache under the name this version's forwards take.
_PARAMS = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
CACHE_ARG: str = "cache" if "cache" in _PARAMS else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """`model(..., **cache_kwargs(cache))`: the cache under the installed transformers' name for it."""
    return {CACHE_ARG: cache}


def returned_cache(output: Any) -> Any:
    """The cache a model call returned, from the output field of the same name."""
    return getattr(output, CACHE_ARG)
