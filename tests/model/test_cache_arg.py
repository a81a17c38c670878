"""The cache keyword KVBoost passes to model calls is the one the installed transformers reads.

The wrong name is no error on transformers 5.23: `cache=` lands in the forward's **kwargs and the model runs
without the cache. So a suffix forward over a prefix's cache must give the full prompt's logits.
"""
from __future__ import annotations

import inspect

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

from kvboost.model.cache_arg import CACHE_ARG, cache_kwargs, returned_cache

from ..tiny_models import make_tiny_model


def test_the_name_is_the_installed_forwards_own(tokenizer):
    model = make_tiny_model("qwen2", tokenizer)
    assert CACHE_ARG in inspect.signature(type(model).forward).parameters
    # 5.24 renamed it; the old name is removed in 5.40, so from then on only "cache" can be right.
    assert CACHE_ARG == ("cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values")


def test_a_forward_over_the_cache_continues_the_prefix(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    ids = torch.tensor([tokenizer.encode("one two three four five six seven eight")], device=device)
    with torch.inference_mode():
        full = model(input_ids=ids).logits[0, -1]
        cache = DynamicCache(config=model.config)
        first = model(input_ids=ids[:, :-3], **cache_kwargs(cache), use_cache=True)
        assert returned_cache(first) is cache
        rest = model(input_ids=ids[:, -3:], **cache_kwargs(cache), use_cache=True).logits[0, -1]
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(rest, full, atol=1e-5, rtol=1e-5)
