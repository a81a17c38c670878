"""Slot: one row of the engine's KV workspace, and every forward a single sequence runs over it."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers.cache_utils import Cache

from .kv.host_workspace import HostWorkspace
from .kv.manager import Plan
from .kv.workspace import KVWorkspace, RowView
from .model.forward import forward_tokens
from .model.streamed_forward import streamed_forward
from .request import Request
from .results import GenerationMode

if TYPE_CHECKING:
    from .engine import InferenceEngine
    from .model.runner import ModelRunner


class Prefill(NamedTuple):
    """The prompt's K/V is in the slot; `logits` [vocab] float32 pick the first new token."""

    plan: Plan
    logits: torch.Tensor


class Slot:
    def __init__(self, engine: InferenceEngine, ws: RowView | KVWorkspace, runner: ModelRunner | None = None):
        """ws: a scheduler workspace's row or a private one-row workspace. runner: steps over its first row."""
        self.engine, self.ws, self.runner = engine, ws, runner
        self._cache: Cache | None = None  # the eager forwards' cache over the row, its layers' lengths set per call

    @property
    def index(self) -> int:
        return self.ws.index if isinstance(self.ws, RowView) else -1

    @property
    def on_runner(self) -> bool:
        """The row is the one the engine's runner steps run over (the workspace's first, no shared prefix)."""
        runner = self.runner
        return (runner is not None and isinstance(self.ws, RowView) and self.ws.index == 0
                and self.ws.parent is runner.workspace and self.ws.base == 0)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, request: Request, plan: Plan | None = None) -> Prefill:
        """Put the prompt's K/V into the row: reuse what the plan finds (looked up now, or the caller's), prefill (or
        repair) the rest."""
        engine, kv, ws, ids = self.engine, self.engine.kv, self.ws, request.ids
        if plan is None:
            plan = self.lookup(request)
        # Until the forward succeeds the row holds no trustworthy prefix.
        ws.resident_tag = None
        ws.ensure_capacity(len(ids) + request.params.max_new_tokens, keep=plan.resident)
        kv.place(plan, ws, ids)
        if plan.needs_repair:
            from .reuse.repair import repair_forward

            cfg = engine.config
            assert plan.assembly is not None
            repaired = repair_forward(engine.model, ws, ids, plan.reuse_len, plan.assembly.mask(len(ids)),
                                      plan.assembly.seams, cfg.recompute_strategy, cfg.recompute_ratio,
                                      cfg.recompute_overlap)
            logits, plan.recomputed_tokens = repaired.logits, repaired.recomputed
        else:
            logits = self.forward(ids[plan.reuse_len:], plan.reuse_len).clone()
        self.claim(request, plan, ids)
        return Prefill(plan, logits)

    def lookup(self, request: Request) -> Plan:
        """Where the prompt's K/V comes from, given what the row holds resident."""
        return self.engine.kv.lookup(request.ids, request.salt, request.mode, request.approximate,
                                     self.resident(request.salt))

    def warm(self, ids: list[int], salt: str | None, cut_ids: Sequence[int] | None = None) -> tuple[int, int]:
        """Compute and store the K/V of every id; returns (chunks stored, chunks already there)."""
        kv, ws = self.engine.kv, self.ws
        plan = kv.lookup(ids + [0], salt, GenerationMode.CHUNK_KV_REUSE, resident=self.resident(salt))
        ws.resident_tag = None
        ws.ensure_capacity(len(ids) + 1, keep=plan.resident)
        kv.place(plan, ws, ids)
        if plan.reuse_len < len(ids):
            self.forward(ids[plan.reuse_len:], plan.reuse_len)
        ws.resident_ids, ws.resident_tag = list(ids), kv.tag(salt)
        return kv.write_back(ids, salt, ws, cut_ids=cut_ids)

    # ---- forwards -----------------------------------------------------------------------------
    def forward(self, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions [start, start + n) after the K/V of [0, start): float32 logits [vocab] of the last
        token, or [n, vocab] (all_logits). The runner's buffer is overwritten by its next step."""
        runner = self.runner
        if self.on_runner and runner.fits(len(tokens)):
            if all_logits and len(tokens) > 1:  # one token (no drafts) is the decode step
                return runner.verify(tokens, start)
            return runner.forward(tokens, start)[None] if all_logits else runner.forward(tokens, start)
        cache = self.cache(start)
        logits = forward_tokens(self.engine.model, tokens, cache, logits_to_keep=len(tokens) if all_logits else 1,
                                attention=self.engine.attention)[0]
        return logits if all_logits else logits[-1]

    def cache(self, length: int) -> Cache:
        """The row's eager cache with every layer at `length` positions (what lies past it is rolled back)."""
        if self._cache is None:
            self._cache = self.ws.make_cache(length)
        for layer in self._cache.layers:
            layer.set_length(length)
        return self._cache

    # ---- what the row holds -------------------------------------------------------------------
    def resident(self, salt: str | None) -> list[int]:
        """Token ids whose exact K/V (this tenant's) the row holds from position 0."""
        ws = self.ws
        return ws.resident_ids if ws.resident_tag == self.engine.kv.tag(salt) else []

    def claim(self, request: Request, plan: Plan, fed: list[int]) -> None:
        """Record which exact K/V the row now holds (after a placed position only the exact prefix)."""
        exact = fed[: plan.reuse_len] if plan.needs_repair else fed
        self.ws.resident_ids, self.ws.resident_tag = list(exact), self.engine.kv.tag(request.salt)

    def finish(self, request: Request, plan: Plan, fed: list[int]) -> None:
        """The row holds the K/V of `fed` (prompt + output): claim it, write back its new chunks."""
        self.claim(request, plan, fed)
        if request.uses_cache and self.engine.config.write_back:
            self.engine.kv.write_back(self.ws.resident_ids, request.salt, self.ws)

    def forget(self) -> None:
        """The row's contents are no longer this slot's to reuse (another row's columns moved in)."""
        self.ws.resident_ids, self.ws.resident_tag = [], None


class HostSlot:
    """A sequence longer than the device holds, in a host workspace: a Slot's calls, never batched, exact reuse."""

    index = -1

    def __init__(self, engine: InferenceEngine, host: HostWorkspace):
        self.engine, self.host = engine, host

    def prefill(self, request: Request) -> Prefill:
        engine, kv, host, ids = self.engine, self.engine.kv, self.host, request.ids
        plan = kv.lookup(ids, request.salt, request.mode)
        if request.approximate:
            limit = engine.long_contexts.max_device_tokens
            plan.content_fallback = (f"the context exceeds device_kv_max_tokens={limit}: streamed from host memory "
                                     "with exact reuse only")
        host.ensure_capacity(len(ids) + request.params.max_new_tokens)
        kv.place(plan, host, ids)
        host.set_length(plan.reuse_len)
        return Prefill(plan, self.forward(ids[plan.reuse_len:], plan.reuse_len).clone())

    def warm(self, ids: list[int], salt: str | None, cut_ids: Sequence[int] | None = None) -> tuple[int, int]:
        kv, host = self.engine.kv, self.host
        plan = kv.lookup(ids + [0], salt, GenerationMode.CHUNK_KV_REUSE)
        host.ensure_capacity(len(ids) + 1)
        kv.place(plan, host, ids)
        host.set_length(plan.reuse_len)
        if plan.reuse_len < len(ids):
            self.forward(ids[plan.reuse_len:], plan.reuse_len)
        return kv.write_back(ids, salt, host, cut_ids=cut_ids)

    def forward(self, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        return streamed_forward(self.engine.model, self.host, tokens, start, all_logits, self.engine.attention)

    def finish(self, request: Request, plan: Plan, fed: list[int]) -> None:
        self.host.set_length(len(fed))
        if request.uses_cache and self.engine.config.write_back:
            self.engine.kv.write_back(fed, request.salt, self.host)

    def forget(self) -> None:
        """The sequence is over: its host (and device-resident) memory goes."""
        self.engine.long_contexts.count(self.host)
        self.host.release()
