"""Wiring speculation into an engine: a request's options, its proposer and Speculator, the draft engine."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidRequestError
from .speculative import SpecCounts, SpeculativeParams, StepCosts, lookup_min_ngram, parse_method
from .speculator import LookupProposer, Proposer

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..request import Request


def resolve_speculation(config: EngineConfig, has_draft: bool, speculative: str | None = "default",
                        num_speculative_tokens: int | None = None, prompt_lookup_max_ngram: int | None = None,
                        prompt_lookup_min_ngram: int | None = None,
                        prediction: Sequence[int] = ()) -> SpeculativeParams | None:
    """A request's speculation ("default" follows config.speculative), None when off; InvalidRequestError if bad.
    prediction (OpenAI's Predicted Outputs) forces prompt lookup; asking for another method beside it is refused."""
    is_default = isinstance(speculative, str) and speculative == "default"
    method = config.speculative if is_default else parse_method(speculative)
    if prediction:
        if not is_default and method != "prompt_lookup":
            raise InvalidRequestError(f"prediction drafts by prompt lookup over the predicted text; it cannot be "
                                      f"combined with speculative={speculative!r}", "prediction")
        method = "prompt_lookup"
    if method is None:
        return None
    if method == "draft" and not has_draft:
        raise InvalidRequestError("speculative='draft' needs an engine loaded with draft_model=", "speculative")
    max_ngram = config.prompt_lookup_max_ngram if prompt_lookup_max_ngram is None else prompt_lookup_max_ngram
    # An unset minimum follows the config's (None: auto), lowered to a requested maximum below it.
    min_ngram = prompt_lookup_min_ngram
    if min_ngram is None and config.prompt_lookup_min_ngram is not None:
        min_ngram = min(config.prompt_lookup_min_ngram, max_ngram)
    k = config.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
    return SpeculativeParams(method, k, max_ngram, min_ngram, tuple(prediction))


def speculation_stats(config: EngineConfig, counts: SpecCounts, costs: dict[str, StepCosts]) -> dict:
    """cache_stats()["speculative"]: the engine's default, draft / acceptance counts, the measured step costs per
    method, and the shortest n-gram prompt lookup drafts from (set, or "auto" and what auto picks now)."""
    auto = config.prompt_lookup_min_ngram is None
    return dict(default=config.speculative, **counts.as_dict(),
                step_costs={m: c.as_dict() for m, c in costs.items()},
                prompt_lookup_min_ngram="auto" if auto else config.prompt_lookup_min_ngram,
                prompt_lookup_min_ngram_now=min(lookup_min_ngram(costs.get("prompt_lookup")) if auto
                                                else config.prompt_lookup_min_ngram, config.prompt_lookup_max_ngram))


def make_proposer(engine, request: Request, context: Sequence[int], costs: StepCosts | None = None) -> Proposer:
    """context: prompt + the tokens emitted so far; costs: the engine's measured step costs for the method."""
    params = request.speculative
    assert params is not None
    if params.method == "draft":
        from .draft import DraftProposer

        if engine.draft is None:
            raise InvalidRequestError("speculative='draft' needs an engine loaded with draft_model=", "speculative")
        return DraftProposer(engine.draft, request, context)
    return LookupProposer(context, params, capacity=request.params.max_new_tokens + params.num_tokens, costs=costs)


def make_draft_engine(engine, draft_model):
    """The draft's own engine: memory tier only, the target's chunking, tenant and attention settings."""
    from .draft import load_draft_model

    cfg = engine.config
    model = load_draft_model(draft_model, engine.model, engine.tokenizer)
    # A quarter of the target's budget, and no host tier (else on CUDA the draft would take 30% of free memory).
    return type(engine)(model, engine.tokenizer, chunk_size=cfg.chunk_size, strict=False, memory_budget_bytes=0,
                        device_kv_budget_bytes=cfg.memory_budget_bytes // 4, cache_salt=cfg.cache_salt,
                        attention_backend=cfg.attention_backend, fast_path=cfg.fast_path)
