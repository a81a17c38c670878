"""What the engine hands back: result dataclasses and the public enums."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .errors import InvalidRequestError

_PARAM_NAMES = {"GenerationMode": "mode", "RecomputeStrategy": "recompute_strategy"}


class _ParsableEnum(str, Enum):
    @classmethod
    def parse(cls, value):
        """The member for a member or its (case-insensitive) value; InvalidRequestError otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            param = _PARAM_NAMES[cls.__name__]
            raise InvalidRequestError(f"unknown {param} {value!r}; expected one of: {names}", param) from None


class GenerationMode(_ParsableEnum):
    """How much cached K/V a request may use. BASELINE: none (full prefill); PREFIX_CACHE: exact prefix-chain reuse of
    whole chunks; CHUNK_KV_REUSE: exact chain, token-granular tails and (where enabled) content matches with repair."""

    BASELINE = "baseline"
    PREFIX_CACHE = "prefix_cache"
    CHUNK_KV_REUSE = "chunk_kv_reuse"


class RecomputeStrategy(_ParsableEnum):
    """How K/V reused at another position is repaired (exact prefix matches never are)."""

    SELECTIVE = "selective"
    CACHEBLEND = "cacheblend"
    NONE = "none"


@dataclass
class GenerationResult:
    mode: str
    prompt: str
    output_text: str
    generated_tokens: int
    ttft_ms: float
    total_ms: float
    tokens_per_sec: float
    kv_reuse_ratio: float
    prompt_tokens: int
    cached_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (EOS or stop string) | "length"
    exact_tokens: int = 0  # reused from an exact prefix chain
    approximate_tokens: int = 0  # reused from a content match at another position
    recomputed_tokens: int = 0  # reused tokens whose K/V was recomputed by repair
    lookup_ms: float = 0.0  # hashing + matching + assembly, inside ttft_ms
    first_token_logits: object | None = field(default=None, repr=False)  # torch.Tensor when requested
    # sampling.TokenLogprob per output token when logprobs were requested, else None
    logprobs: list | None = field(default=None, repr=False)
    speculative: str | None = None  # "prompt_lookup" | "draft" when the request speculated
    draft_tokens: int = 0  # drafts proposed and verified by the target
    accepted_tokens: int = 0  # drafts the target kept (each saved one decode forward)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def text(self) -> str:
        return self.output_text


@dataclass
class WarmResult:
    """Outcome of warm(); truthy when at least one chunk was stored."""

    chunks_stored: int
    chunks_already_cached: int
    tokens: int
    elapsed_ms: float
    warnings: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.chunks_stored + self.chunks_already_cached > 0

    def __int__(self) -> int:
        return self.chunks_stored


@dataclass
class PromptCheck:
    prompt_preview: str
    identical: bool
    reused_chunks: int
    cached_tokens: int
    max_logit_diff: float
    baseline_tokens: list[int]
    reused_tokens: list[int]
    first_token_agrees: bool = True
    first_token_kl: float = 0.0


@dataclass
class CorrectnessReport:
    """Per-prompt comparison of BASELINE against cached generation; truthy only if all match."""

    checks: list[PromptCheck]
    max_new_tokens: int

    @property
    def all_identical(self) -> bool:
        return bool(self.checks) and all(c.identical for c in self.checks)

    @property
    def max_logit_diff(self) -> float:
        return max((c.max_logit_diff for c in self.checks), default=0.0)

    def __bool__(self) -> bool:
        return self.all_identical

    def summary(self) -> str:
        ok = sum(c.identical for c in self.checks)
        return (f"{ok}/{len(self.checks)} prompts identical to baseline; "
                f"max first-token logit diff {self.max_logit_diff:.2e}")
