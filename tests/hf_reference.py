"""Plain Hugging Face references that reuse must reproduce: greedy generate() and full-prefill logits.

Both build their inputs on the model's device, so they run wherever the model lives (--device).
"""
from __future__ import annotations

import torch


def hf_greedy(model, tokenizer, ids: list[int], n: int) -> list[int]:
    """model.generate's greedy continuation of ids (up to n tokens, cut at EOS)."""
    x = torch.tensor([ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    gen = out[0, len(ids):].tolist()
    eos = tokenizer.eos_token_id
    return gen[: gen.index(eos)] if eos in gen else gen


def hf_first_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits of the last prompt position after one full prefill, on the model's device."""
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
