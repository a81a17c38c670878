"""Request: one generation as every path sees it (single, streamed, batched, served), and its result."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .decoding import OutputTracker
from .errors import ContextLengthError, InvalidRequestError
from .results import GenerationMode, GenerationResult
from .sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    import torch

    from .decoding.grammar import CompiledFormat
    from .decoding.speculative import SpecCounts, SpeculativeParams
    from .kv.manager import Plan


@dataclass
class Request:
    """Validated prompt ids and options; prompt + max_new_tokens fit `max_context`, the model's context length."""

    ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # None: decoded from ids when the result is built (after the first token)
    salt: str | None = None
    mode: GenerationMode = GenerationMode.CHUNK_KV_REUSE
    content_reuse: bool = False
    return_logits: bool = False
    t_start: float = field(default_factory=time.perf_counter)
    format: CompiledFormat | None = None  # the output's grammar (response_format / regex / grammar / tool call)
    speculative: SpeculativeParams | None = None  # resolved against the engine's defaults; None: no speculation

    def __post_init__(self) -> None:
        self.mode = GenerationMode.parse(self.mode)
        if not self.ids:
            raise InvalidRequestError("the prompt has no tokens", "prompt")
        if self.salt is not None and not isinstance(self.salt, str):
            raise InvalidRequestError("cache_salt must be a string", "cache_salt")
        if not isinstance(self.content_reuse, bool):
            raise InvalidRequestError(f"content_reuse must be a bool, got {self.content_reuse!r}", "content_reuse")

    @property
    def uses_cache(self) -> bool:
        return self.mode is not GenerationMode.BASELINE

    @property
    def approximate(self) -> bool:
        """Reuse at another position applies (CHUNK_KV_REUSE only)."""
        return self.content_reuse and self.mode is GenerationMode.CHUNK_KV_REUSE

    def check_context(self, max_context: int | None) -> None:
        """The prompt and every token it may generate must fit in the model's context; refuse, never cut."""
        if max_context is None:
            return
        n = len(self.ids)
        check_prompt_length(n, max_context)
        if n + self.params.max_new_tokens > max_context:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_new_tokens ({self.params.max_new_tokens}) = "
                f"{n + self.params.max_new_tokens} exceeds the model's context of {max_context} tokens; "
                f"ask for at most {max_context - n} new tokens", "max_new_tokens")

    def sampler(self, device) -> Sampler:
        """This sequence's sampler, with a fresh grammar state when the request has a format."""
        constraint = self.format.constraint(self.params.max_new_tokens) if self.format is not None else None
        return Sampler(self.params, device, constraint, prompt_ids=self.ids)

    def tracker(self, tokenizer, eos_token_ids: set[int]) -> OutputTracker:
        return OutputTracker(tokenizer, eos_token_ids, self.params.stop, self.params.max_new_tokens)

    def result(self, plan: Plan, tracker: OutputTracker, ttft_ms: float,
               first_token_logits: torch.Tensor | None = None, sampler: Sampler | None = None,
               spec: SpecCounts | None = None) -> GenerationResult:
        """The one place a GenerationResult is built, for every path."""
        total_ms = (time.perf_counter() - self.t_start) * 1e3
        n = len(self.ids)
        generated = list(tracker.tokens)
        # One entry per sampled token; the final EOS is not an output token, so it is not reported either.
        logprobs = sampler.logprobs[: len(generated)] if sampler and self.params.logprobs is not None else None
        # The tracker's reason, except "length" where the budget forced the output's last tokens (decoding/closing.py).
        forced = sampler is not None and sampler.constraint is not None and sampler.constraint.forced
        return GenerationResult(
            mode=self.mode.value, prompt=self.prompt_text if self.prompt_text is not None
            else tracker.tokenizer.decode(self.ids), output_text=tracker.text, generated_tokens=len(generated),
            ttft_ms=ttft_ms, total_ms=total_ms,
            tokens_per_sec=len(generated) / (total_ms / 1e3) if total_ms > 0 else 0.0,
            kv_reuse_ratio=plan.cached_tokens / n, prompt_tokens=n, cached_tokens=plan.cached_tokens,
            output_token_ids=generated, finish_reason="length" if forced else tracker.finish_reason,
            exact_tokens=plan.reuse_len, approximate_tokens=plan.approximate_tokens,
            recomputed_tokens=plan.recomputed_tokens, lookup_ms=plan.lookup_ms, first_token_logits=first_token_logits,
            logprobs=logprobs, speculative=self.speculative.method if self.speculative else None,
            draft_tokens=spec.draft_tokens if spec else 0, accepted_tokens=spec.accepted_tokens if spec else 0)


def check_prompt_length(n_prompt: int, max_context: int | None) -> None:
    """ContextLengthError unless a prompt of n_prompt tokens leaves a position free in the model's context."""
    if max_context is not None and n_prompt >= max_context:
        raise ContextLengthError(f"prompt is {n_prompt} tokens but the model's context is {max_context} tokens "
                                 "(at least one position must stay free for generation)", "prompt")

