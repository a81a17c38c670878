"""verify_correctness: run prompts with and without reused K/V and compare, token for token."""
from __future__ import annotations

from typing import Sequence

import torch

from .results import CorrectnessReport, GenerationMode, PromptCheck

VERIFY_SALT = "__kvboost_verify__"  # keeps verification chunks apart from every user tenant

_DEFAULT_PROMPTS = [
    "You are a careful assistant for a logistics company. Shipments leave the Rotterdam hub on Mondays and "
    "Thursdays; express parcels are sorted by weight class, then by destination region. Damaged goods are "
    "photographed on arrival, logged with a case number and returned within ten working days. Customers may "
    "change a delivery address until the parcel reaches the regional depot. Question: when can a customer no "
    "longer change the delivery address? Answer:",
    "def moving_average(values, window):\n    \"\"\"Return the simple moving average of values over window.\"\"\"\n"
    "    if window <= 0:\n        raise ValueError('window must be positive')\n    out = []\n    total = 0.0\n"
    "    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n            total -= "
    "values[i - window]\n        if i + 1 >= window:\n            out.append(total / window)\n    return out\n\n"
    "# Explain what moving_average returns for an empty list:\n",
    "The history of the printing press begins with movable type in East Asia and continues with Gutenberg's "
    "press in Mainz around 1440. Cheaper books spread literacy, standardised spelling and accelerated the "
    "exchange of scientific ideas across Europe. Summarise the main consequence in one sentence:",
]


def _preamble(engine, n_tokens: int) -> str:
    text = "Reference notes. "
    sentence = "Each section below is part of the shared context that the assistant must keep in mind. "
    while len(engine.encode(text)) < n_tokens:
        text += sentence
    return text


def verify_correctness(engine, prompts: Sequence[str] | None = None, max_new_tokens: int = 32) -> CorrectnessReport:
    """For each prompt: BASELINE vs generation over K/V loaded from the store (>= 2 reused chunks).

    Prompts shorter than two chunks get a neutral preamble so stored chunks are really exercised.
    Greedy decoding; identical means the same token ids. The report is truthy only if all are identical.
    """
    prompts = list(prompts) if prompts is not None else list(_DEFAULT_PROMPTS)
    need = 2 * engine.config.chunk_size + 1
    checks = []
    for prompt in prompts:
        if len(engine.encode(prompt)) < need:
            prompt = _preamble(engine, need) + "\n" + prompt
        base = engine.generate(prompt, max_new_tokens, mode=GenerationMode.BASELINE, cache_salt=VERIFY_SALT,
                               return_logits=True)
        engine.warm(prompt, cache_salt=VERIFY_SALT)
        engine.forget_workspace()  # force the reuse to come from stored chunks
        reused = engine.generate(prompt, max_new_tokens, mode=GenerationMode.CHUNK_KV_REUSE,
                                 cache_salt=VERIFY_SALT, return_logits=True)
        a, b = base.first_token_logits, reused.first_token_logits
        kl = torch.nn.functional.kl_div(torch.log_softmax(b, -1), torch.log_softmax(a, -1), log_target=True,
                                        reduction="sum").item()
        checks.append(PromptCheck(
            prompt_preview=prompt[-60:].replace("\n", " "),
            identical=base.output_token_ids == reused.output_token_ids,
            reused_chunks=reused.cached_tokens // engine.config.chunk_size,
            cached_tokens=reused.cached_tokens,
            max_logit_diff=(a - b).abs().max().item(),
            baseline_tokens=base.output_token_ids, reused_tokens=reused.output_token_ids,
            first_token_agrees=int(a.argmax()) == int(b.argmax()), first_token_kl=max(0.0, kl)))
    return CorrectnessReport(checks, max_new_tokens)
