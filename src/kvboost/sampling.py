"""Next-token choice and stopping: greedy, temperature, top-k, top-p, seeds, EOS and stop strings; penalties and
logit bias (penalties.py), a grammar mask (decoding/constraint.py) and log-probabilities where a request asks."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import InvalidRequestError
from .penalties import Penalties, check_penalties, finite_number, penalized

if TYPE_CHECKING:
    from .decoding.constraint import TokenConstraint

MAX_TOP_LOGPROBS = 20  # as OpenAI


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off; else drop tokens below min_p x the most likely one's probability
    do_sample: bool | None = None  # None: sample exactly when temperature > 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: off; k >= 0: each token's log-probability and its k best alternatives
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: over the tokens generated so far
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    repetition_penalty: float = 1.0  # transformers' / vLLM's, > 0 (1 = off): over prompt + output
    logit_bias: dict[int, float] | None = None  # OpenAI's: {token id: bias in [-100, 100]}

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        n, t, k, seed = self.max_new_tokens, self.temperature, self.top_k, self.seed
        for name, wanted, ok in (  # in this order: the first that fails is the one reported
                ("max_new_tokens", "a positive int", isinstance(n, int) and not isinstance(n, bool) and n > 0),
                ("temperature", "a finite number >= 0", finite_number(t) and t >= 0),
                ("top_p", "in (0, 1]", finite_number(self.top_p) and 0.0 < self.top_p <= 1.0),
                ("min_p", "in [0, 1]", finite_number(self.min_p) and 0.0 <= self.min_p <= 1.0),
                ("top_k", "an int >= 0", isinstance(k, int) and k >= 0),
                ("seed", "an int", seed is None or isinstance(seed, int) and not isinstance(seed, bool))):
            if not ok:
                raise InvalidRequestError(f"{name} must be {wanted}, got {getattr(self, name)!r}", name)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings", "stop")
        if len(self.stop) > 16:
            raise InvalidRequestError("at most 16 stop strings", "stop")
        k = self.logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be None or an int in [0, {MAX_TOP_LOGPROBS}], got {k!r}",
                                      "logprobs")
        self.logit_bias = check_penalties(self.frequency_penalty, self.presence_penalty, self.repetition_penalty,
                                          self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.do_sample is False or self.temperature == 0.0


@dataclass
class TokenLogprob:
    """A chosen token's log-probability under the model's own distribution (log-softmax of the raw logits: before
    temperature, top-k/p and any grammar mask, as vLLM reports by default) and the `top` best alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Sampler:
    """Picks tokens from float32 logits [vocab]; a seeded sampler is reproducible on its own generator. Penalties
    (penalties.py), then the constraint's mask, which it advances by each pick, so every path honours a format alike."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu",
                 constraint: TokenConstraint | None = None, prompt_ids: Sequence[int] = ()):
        self.params, self.constraint = params, constraint
        self.penalties = Penalties(params, prompt_ids) if penalized(params) else None
        self.logprobs: list[TokenLogprob] = []
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    @property
    def plain(self) -> bool:
        """Nothing but the choice itself: no mask, no penalties, no log-probabilities."""
        return self.constraint is None and self.penalties is None and self.params.logprobs is None

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token. With a constraint, logits are masked in place (the caller's row is spent)."""
        # Log-probabilities are of the model's own distribution: taken before the mask changes the row.
        logp = torch.log_softmax(logits.float(), dim=-1) if self.params.logprobs is not None else None
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        if self.params.greedy:
            token = int(torch.argmax(logits).item())
        else:
            probs = self.probabilities(logits)
            # Sample on the CPU generator so a seed means the same tokens on every device.
            token = int(torch.multinomial(probs.cpu(), 1, generator=self.generator).item())
        if logp is not None:  # the token's entry, and its `logprobs` best alternatives
            best = torch.topk(logp, self.params.logprobs) if self.params.logprobs else None
            top = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
            self.logprobs.append(TokenLogprob(token, float(logp[token]), top))
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.penalties is not None:
            self.penalties.record(token)
        return token

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        scores = logits.float() / max(p.temperature, 1e-5)
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # Drop tokens once the mass before them already reaches top_p; the best token always stays.
            drop = probs.cumsum(dim=-1) - probs >= p.top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
        if p.min_p > 0.0:  # after top-k / top-p, as vLLM applies it
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return torch.softmax(scores, dim=-1)


def sample_rows(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """The next token of each row of float32 logits [rows, vocab]; greedy rows share one argmax and copy."""
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy and s.plain]
    picks: dict[int, int] = {}
    if greedy:
        chosen = logits if len(greedy) == len(samplers) else logits[greedy]
        picks = dict(zip(greedy, chosen.argmax(dim=-1).tolist()))
    return [picks[i] if i in picks else s(logits[i]) for i, s in enumerate(samplers)]


def find_stop(text: str, stops: list[str]) -> int:
    """Index where the earliest stop string begins in text, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def held_back_length(text: str, stops: list[str]) -> int:
    """How many trailing characters could still grow into a stop string, so a stream must not emit them yet."""
    return max((partial_suffix(text, s) for s in stops), default=0)


def partial_suffix(text: str, marker: str, whole: bool = False) -> int:
    """How many trailing characters of text are a proper prefix of marker (whole: or all of it): could become it."""
    for k in range(min(len(marker) - (0 if whole else 1), len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
