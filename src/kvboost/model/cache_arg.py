"""The name transformers gives the KV cache in a model call: `cache` from 5.24, `past_key_values` before.

transformers 5.24 renamed the forward argument and the output field; the old argument name still works there,
with a FutureWarning on every call, until 5.40 removes it. The new name cannot simply be used everywhere: a
5.23 forward takes `cache=` into its **kwargs without complaint and runs without the cache (wrong logits, no
error). So every model call in KVBoost passes its cache through `cache_kwargs`, which uses the installed
version's name, decided once here by reading transformers' own signature (not by catching its warnings).
"""
from __future__ import annotations

import inspect
from typing import Any

from transformers import GenerationMixin


def _installed_name() -> str:
    # prepare_inputs_for_generation builds the forward kwargs of every model generate() runs: the name it takes
    # for the cache is the name that version's forwards take (deprecate_kwarg keeps the signature via wraps).
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


CACHE_ARG: str = _installed_name()


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """`model(..., **cache_kwargs(cache))`, `model.generate(..., **cache_kwargs(cache))`: the cache under the
    installed transformers' name for it."""
    return {CACHE_ARG: cache}


def returned_cache(output: Any) -> Any:
    """The cache a model call returned: its output field carries the same name as the argument (reading the old
    name on 5.24+ logs a deprecation line)."""
    return getattr(output, CACHE_ARG)
