"""Small RAG-shaped prompts for the tiny models: documents warmed alone, then used at other positions."""
from __future__ import annotations

import torch

from kvboost.model.cache_arg import cache_kwargs, returned_cache

from ..prompts import words

CHUNK = 16


def documents(n: int = 3, n_words: int = 40) -> list[str]:
    return [words(n_words + 7 * i, seed=100 + i) for i in range(n)]


def rag_prompt(docs: list[str], order: list[int], question: str = "Question: which word came first?") -> str:
    return "Intro: read these notes.\n\n" + "\n\n".join(docs[i] for i in order) + "\n\n" + question


def full_forward(model, ids: list[int]):
    """(last-position float logits, the cache of a plain full forward; every layer keeps every position), on the
    model's device."""
    from transformers import DynamicCache

    with torch.inference_mode():
        # No config: every layer is a full layer, sliding ones too, so all positions stay comparable.
        out = model(torch.tensor([ids], device=model.device), **cache_kwargs(DynamicCache()), use_cache=True)
    return out.logits[0, -1].float(), returned_cache(out)
