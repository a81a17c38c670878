"""verify_correctness: run prompts with and without reused K/V and compare, token for token."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def verify_correctness(engine, prompts: Sequence[str] | None = None, max_new_tokens: int = 32, *,
                       approximate: bool = False) -> CorrectnessReport:
    """For each prompt: BASELINE vs generation over K/V loaded from the store (>= 2 reused chunks; short prompts get a
    preamble); identical = the same greedy token ids. approximate=True runs verify_approximate instead."""
    if approximate:
        return verify_approximate(engine, prompts, max_new_tokens)
    prompts = list(prompts) if prompts is not None else list(_DEFAULT_PROMPTS)
    # Two complete chunks: with a boundary window W a chunk may hold chunk_size + W tokens.
    need = 2 * (engine.config.chunk_size + engine.config.chunk_boundary_window) + 1
    checks = []
    for prompt in prompts:
        if len(engine.encode(prompt)) < need:
            prompt = _preamble(engine, need) + "\n" + prompt
        checks.append(_check(engine, prompt, prompt, max_new_tokens))
    return CorrectnessReport(checks, max_new_tokens)


def _check(engine, prompt: str, warmed: str, max_new_tokens: int, content_reuse: bool | None = None) -> PromptCheck:
    """BASELINE against generation over the stored K/V of `warmed`. With content reuse, cached_tokens counts what was
    verified: the re-positioned tokens."""
    base = engine.generate(prompt, max_new_tokens, mode=GenerationMode.BASELINE, cache_salt=VERIFY_SALT,
                           return_logits=True)
    engine.warm(warmed, cache_salt=VERIFY_SALT)
    engine.forget_workspace()  # force the reuse to come from stored chunks
    reused = engine.generate(prompt, max_new_tokens, mode=GenerationMode.CHUNK_KV_REUSE, cache_salt=VERIFY_SALT,
                             return_logits=True, content_reuse=content_reuse)
    a, b = base.first_token_logits, reused.first_token_logits
    # KL(full prefill || reused): how much probability mass the reused distribution misplaces.
    kl = torch.nn.functional.kl_div(torch.log_softmax(b, -1), torch.log_softmax(a, -1), log_target=True,
                                    reduction="sum").item()
    return PromptCheck(
        prompt_preview=prompt[-60:].replace("\n", " "),
        identical=base.output_token_ids == reused.output_token_ids,
        reused_chunks=sum(stop <= reused.cached_tokens for _, stop, _ in engine.chunker.spans(engine.encode(prompt))),
        cached_tokens=reused.approximate_tokens if content_reuse else reused.cached_tokens,
        max_logit_diff=(a - b).abs().max().item(),
        baseline_tokens=base.output_token_ids, reused_tokens=reused.output_token_ids,
        first_token_agrees=int(a.argmax()) == int(b.argmax()), first_token_kl=max(0.0, kl))


_SHIFT = ("Unrelated material comes first in this request, so the text after it sits at other positions than "
          "when it was cached. ")


@dataclass
class ApproximateReport(CorrectnessReport):
    """verify_approximate's result: truthy when every first token agrees with full prefill and every first-token
    KL(full || reused) is at most max_kl (identical continuations are reported, not required)."""

    max_kl: float = 0.1

    @property
    def first_token_agreement(self) -> float:
        return sum(c.first_token_agrees for c in self.checks) / len(self.checks) if self.checks else 0.0

    @property
    def max_first_token_kl(self) -> float:
        return max((c.first_token_kl for c in self.checks), default=0.0)

    def __bool__(self) -> bool:
        return bool(self.checks) and all(c.first_token_agrees and c.first_token_kl <= self.max_kl
                                         and c.cached_tokens > 0 for c in self.checks)

    def summary(self) -> str:
        same = sum(c.identical for c in self.checks)
        return (f"approximate reuse: first-token agreement {self.first_token_agreement:.0%}, max first-token KL "
                f"{self.max_first_token_kl:.3g} (limit {self.max_kl:g}); {same}/{len(self.checks)} greedy "
                f"continuations identical to full prefill")


def verify_approximate(engine, prompts: Sequence[str] | None = None, max_new_tokens: int = 32) -> ApproximateReport:
    """Reuse at another position, against full prefill: each prompt is warmed alone, then sent after unrelated text, so
    it is found by content, re-rotated and repaired. A prompt not reused at all fails: nothing was verified."""
    prompts = list(prompts) if prompts is not None else list(_DEFAULT_PROMPTS)
    checks = [_check(engine, _SHIFT + "\n\n" + p, p, max_new_tokens, content_reuse=True) for p in prompts]
    return ApproximateReport(checks, max_new_tokens)
