"""Requests over block tables (paged_attention="table") and streamed contexts (device_kv_max_tokens), which run one
at a time outside the scheduler's workspace: their K/V lives in blocks, not in a workspace row.

Transitional: the KV design is the workspace (docs/architecture.md); the block path and this module go together.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .decoding.factory import make_proposer
from .decoding.speculative import StepCosts
from .decoding.speculator import Speculator
from .model.streamed_sequence import StreamedSequence
from .model.table_sequence import TableSequence
from .request import Request
from .results import GenerationResult
from .streaming import finish_streamed, streamed_prefill


def runs_paged(engine, request: Request) -> bool:
    """Whether the request's K/V lives in blocks (a table engine, or a context longer than the device holds)."""
    return engine.table_forward or engine.kv.streams(len(request.ids) + request.params.max_new_tokens)


def generate_paged(engine, request: Request) -> Iterator[str | GenerationResult]:
    """Text deltas, then the GenerationResult, of one request over a block table or a streamed table."""
    sampler = request.sampler(engine.device)
    tracker = request.tracker(engine.tokenizer, engine.eos_token_ids)
    with engine.lock, torch.inference_mode():
        ids = request.ids
        if engine.kv.streams(len(ids) + request.params.max_new_tokens):
            plan, seq, logits = streamed_prefill(engine.kv, engine.model, engine.attention, ids, request.salt,
                                                 request.mode, request.approximate, request.params.max_new_tokens)
        else:
            plan = engine.kv.lookup(ids, request.salt, request.mode, request.approximate)
            seq = TableSequence(engine.model, engine.kv.sequence_table(plan), engine.paged_backend,
                                engine.table_runner)
            logits = seq.forward(ids[plan.reuse_len:], plan.reuse_len)
        first_logits = logits.clone() if request.return_logits else None
        burst = [sampler(logits)]
        ttft_ms = (time.perf_counter() - request.t_start) * 1e3
        length = len(ids)
        spec = None
        try:
            params = request.speculative
            if params is not None:
                costs = engine.spec_costs.setdefault(params.method, StepCosts())
                proposer = make_proposer(engine, request, ids + burst, costs)
                spec = Speculator(proposer, sampler, params, lambda t, s: seq.forward(t, s, True), costs)
            while True:
                delta = "".join(_feed(tracker, burst))
                if delta:
                    yield delta
                if tracker.finished:
                    break
                if spec is None:
                    burst = [sampler(seq.forward([burst[-1]], length))]
                else:
                    burst = spec.step(burst[-1], length, tracker.max_new_tokens - len(tracker.tokens))
                length += len(burst)
        finally:
            seq.set_length(length)
            fed = (request.ids + tracker.tokens)[:length]
            if request.uses_cache and engine.config.write_back:
                if plan.streamed:
                    engine.kv.write_back_streamed(plan.table, fed, request.salt)
                else:
                    engine.kv.write_back_table(engine.kv.sequence_table(plan), fed, request.salt)
            if isinstance(seq, StreamedSequence):
                finish_streamed(engine.kv, seq)
            if spec is not None:
                spec.close(request.ids + tracker.tokens)
    engine.kv.record(request.mode, len(request.ids), plan)
    if spec is not None:
        engine.spec_counts.merge(spec.counts)
    yield request.result(plan, tracker, ttft_ms, first_logits, sampler, spec.counts if spec else None)


def _feed(tracker, tokens: list[int]) -> Iterator[str]:
    """Text deltas of tokens fed in order, up to the one that finishes the output (the rest are dropped)."""
    for token in tokens:
        yield tracker.feed(token)
        if tracker.finished:
            return
