"""Attention over K/V kept in another dtype than the model computes in (kv/dtype.py): the query is cast to the K/V's
dtype and the output back to the query's, so the cache is read as stored and never widened."""
from __future__ import annotations

import functools
from collections.abc import Callable


def in_kv_dtype(forward: Callable) -> Callable:
    """Wrap an AttentionInterface function (module, query, key, value, ...) -> (out, weights)."""

    @functools.wraps(forward)
    def wrapper(module, query, key, value, *args, **kwargs):
        if query.dtype == key.dtype:
            return forward(module, query, key, value, *args, **kwargs)
        out, weights = forward(module, query.to(key.dtype), key, value, *args, **kwargs)
        return out.to(query.dtype), weights

    return wrapper
