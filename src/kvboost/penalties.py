"""Logit adjustments before the token is chosen, applied to the raw logits in this order, before a grammar mask,
temperature, top-k and top-p (log-probabilities stay the model's own):

* repetition_penalty r (transformers / vLLM): a logit of a token seen in prompt or output is divided by r where
  positive, multiplied by r where negative;
* frequency_penalty f, presence_penalty p (OpenAI): logit[j] -= f * c[j] + p * (c[j] > 0), c[j] counting output only;
* logit_bias {token id: b}: b is added."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .sampling import SamplingParams

MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty|: OpenAI's range
MAX_BIAS = 100.0  # |logit_bias value|: OpenAI's range
MAX_BIASED_TOKENS = 300  # OpenAI's limit on logit_bias entries


def check_penalties(frequency: float, presence: float, repetition: float,
                    logit_bias: Mapping[int, float] | None) -> dict[int, float] | None:
    """Validate the four options (InvalidRequestError naming the option); returns logit_bias with int keys."""
    for name, value in (("frequency_penalty", frequency), ("presence_penalty", presence)):
        if not finite_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}", name)
    if not finite_number(repetition) or repetition <= 0:
        raise InvalidRequestError(f"repetition_penalty must be a finite number > 0 (1 = off), got {repetition!r}",
                                  "repetition_penalty")
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise InvalidRequestError("logit_bias must map token ids to numbers in [-100, 100]", "logit_bias")
    if len(logit_bias) > MAX_BIASED_TOKENS:
        raise InvalidRequestError(f"logit_bias may hold at most {MAX_BIASED_TOKENS} tokens", "logit_bias")
    bias: dict[int, float] = {}
    for key, value in logit_bias.items():
        token = _token_id(key)
        if token is None:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if not finite_number(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise InvalidRequestError(f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}",
                                      "logit_bias")
        bias[token] = float(value)
    return bias or None


def finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _token_id(key: object) -> int | None:
    # JSON object keys are strings: OpenAI's logit_bias is {"50256": -100} (ASCII digits only: int("²") fails)
    if isinstance(key, str) and key.isascii() and key.isdecimal():
        return int(key)
    return key if isinstance(key, int) and not isinstance(key, bool) and key >= 0 else None


def penalized(params: SamplingParams) -> bool:
    return bool(params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0
                or params.logit_bias)


class Penalties:
    """One sequence's adjustment state ([vocab] tensors on the logits' device), built on the first choice."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]):
        self.params, self.prompt_ids = params, prompt_ids
        self.counts: torch.Tensor | None = None  # [vocab] float32: each token's count among generated ones
        self.seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output (repetition only)
        self.bias: torch.Tensor | None = None  # [vocab] float32

    def _build(self, vocab: int, device: torch.device) -> None:
        p = self.params
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if p.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = [t for t in self.prompt_ids if 0 <= t < vocab]
            if prompt:
                self.seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]  # ids past the logits' width (padding rows): nothing to bias
            self.bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            if ids:
                self.bias[torch.tensor(ids, device=device)] = torch.tensor(
                    [p.logit_bias[t] for t in ids], dtype=torch.float32, device=device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjusted float32 logits [vocab] (a new tensor; the input is not modified)."""
        if self.counts is None:
            self._build(logits.shape[-1], logits.device)
        p = self.params
        out = logits.float()
        if self.seen is not None:
            r = p.repetition_penalty
            out = torch.where(self.seen, torch.where(out > 0, out / r, out * r), out)
        if p.frequency_penalty or p.presence_penalty:
            out = out - self.counts * p.frequency_penalty - (self.counts > 0).float() * p.presence_penalty
        if self.bias is not None:
            out = out + self.bias
        return out

    def record(self, token: int) -> None:
        """A token was emitted: it counts from the next choice on."""
        if self.counts is not None and 0 <= token < self.counts.shape[0]:
            self.counts[token] += 1
            if self.seen is not None:
                self.seen[token] = True
