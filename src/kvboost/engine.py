"""InferenceEngine (exported as KVBoost): warm, generate, generate_stream, batch entry points, stats, verify."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .chunking import Chunker, boundary_classes, make_namespace, model_fingerprint
from .compat import check_model_compatibility
from .config import EngineConfig
from .errors import ContextLengthError, InvalidRequestError
from .results import GenerationMode, GenerationResult, RecomputeStrategy, WarmResult
from .reuse.assemble import Assembly, content_state
from .reuse.match import ExactMatch, common_prefix_length, match_exact
from .kv.workspace import KVWorkspace
from .model.forward import forward_tokens, probe_layer_shapes
from .decoding import OutputTracker
from .prompting import Messages, encode_prompt
from .sampling import Sampler, SamplingParams
from .store.base import ChunkMeta, ChunkRecord
from .store.memory import MemoryStore



@dataclass
class _Plan:
    """Where the prompt's K/V comes from: reused positions [0, reuse_len), prefilled after that."""

    reuse_len: int
    exact_tokens: int
    from_workspace: int
    segments_copied: int
    lookup_ms: float
    # Content matches placed (re-positioned) after reuse_len; approximate, so repaired and never stored.
    assembly: "Assembly | None" = None
    content_fallback: str | None = None  # why content matches were found but not used


@dataclass
class _Counters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    lookup_ms: float = 0.0
    chunks_written: int = 0
    by_mode: dict = field(default_factory=dict)


class TextStream:
    """Iterate for text deltas; afterwards `.result` holds the GenerationResult. close() stops generation."""

    def __init__(self, events: Iterator[str]):
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._events)

    def close(self) -> None:
        self._events.close()  # type: ignore[attr-defined]


class InferenceEngine:
    def __init__(self, model, tokenizer, chunk_size: int = 128, max_chunks: int | None = None,
                 recompute_overlap: int = 16, recompute_strategy: RecomputeStrategy | str = RecomputeStrategy.SELECTIVE,
                 recompute_ratio: float = 0.15, kv_cache_bits: int = 16, disk_cache_dir: str | None = None,
                 device: str | None = None, *, strict: bool = True, **options):
        self.config = EngineConfig.from_kwargs(
            chunk_size=chunk_size, max_chunks=max_chunks, recompute_overlap=recompute_overlap,
            recompute_strategy=recompute_strategy, recompute_ratio=recompute_ratio, kv_cache_bits=kv_cache_bits,
            disk_cache_dir=disk_cache_dir, device=device, **options)
        self.compatibility = check_model_compatibility(model, strict=strict)
        if device is not None:
            model.to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        shapes, kv_dtype = probe_layer_shapes(model)
        self.kv_dtype = kv_dtype
        text_config = model.config.get_text_config()
        self.max_context: int | None = getattr(text_config, "max_position_embeddings", None)
        self.fingerprint = model_fingerprint(model)
        self.namespace = make_namespace(self.fingerprint, kv_dtype, self.config.chunk_size,
                                        self.config.kv_cache_bits, self.config.chunk_boundary_window)
        window = self.config.chunk_boundary_window
        # The token classes are computed once per tokenizer (cached), so split() only indexes a table.
        self.chunker = Chunker(self.config.chunk_size, self.namespace, window,
                               boundary_classes(tokenizer) if window else None)
        self.store = self._build_store()
        self.workspace = KVWorkspace(shapes, kv_dtype, self.device, max_positions=self.max_context)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self._lock = threading.RLock()
        self._counters = _Counters()

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | None = None, strict: bool = True, *,
                        dtype: str | torch.dtype | None = None, device: str | None = None,
                        trust_remote_code: bool = False, revision: str | None = None, **kwargs) -> "InferenceEngine":
        """Load a model (the embedded SmolLM2-135M-Instruct when no name is given) and wrap it."""
        from .loading import load_model_and_tokenizer

        hf = {"trust_remote_code": trust_remote_code}
        if revision:
            hf["revision"] = revision
        model, tokenizer = load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=device, **hf)
        return cls(model, tokenizer, strict=strict, **kwargs)

    def _build_store(self):
        try:
            from .store.tiered import build_store
        except ImportError:  # storage tiers not installed in this build: memory only
            return MemoryStore(self.config.memory_budget_bytes, self.config.max_chunks)
        return build_store(self.config, self.namespace)

    # ---- tokenization -----------------------------------------------------------------------
    def encode(self, prompt: str | Messages | None = None, messages: Messages | None = None,
               add_generation_prompt: bool = True, input_ids: Sequence[int] | None = None) -> list[int]:
        """Token ids for a raw prompt (used as-is), chat messages (rendered by the chat template), or
        input_ids the caller tokenized itself (checked against the model's vocabulary, used as-is)."""
        return encode_prompt(self.tokenizer, self.model.get_input_embeddings().num_embeddings, prompt, messages,
                             add_generation_prompt, input_ids)

    def _check_context(self, n_prompt: int) -> None:
        if self.max_context is not None and n_prompt >= self.max_context:
            raise ContextLengthError(
                f"prompt is {n_prompt} tokens but the model's context is {self.max_context} tokens "
                f"(at least one position must stay free for generation)", "prompt")

    # ---- planning: what K/V is already there --------------------------------------------------
    def _tag(self, salt: str | None) -> str:
        return self.namespace + "|" + (salt or "")

    def _plan(self, ids: list[int], mode: GenerationMode, salt: str | None, capacity: int,
              approximate: bool = False) -> _Plan:
        """Put every reusable position's K/V into the workspace; decide where prefill starts.

        With `approximate` (CHUNK_KV_REUSE only), stored content found after the exact prefix is also placed,
        re-positioned, into the workspace (plan.assembly); the caller must then run reuse.repair over it.
        """
        t0 = time.perf_counter()
        ws = self.workspace
        if mode is GenerationMode.BASELINE:
            ws.ensure_capacity(capacity, keep=0)
            return _Plan(0, 0, 0, 0, (time.perf_counter() - t0) * 1e3)
        token_granular = mode is GenerationMode.CHUNK_KV_REUSE
        chunks = self.chunker.split(ids, salt)
        match: ExactMatch = match_exact(self.store, chunks, token_granular)
        # The workspace still holds the previous request's K/V; the part that agrees with this prompt
        # (same tenant and model namespace) is exact and needs no copy at all.
        resident = common_prefix_length(ws.resident_ids, ids) if ws.resident_tag == self._tag(salt) else 0
        if not token_granular:
            # Whole chunks only: down to the last complete chunk end (cuts move with a boundary window).
            resident = max((c.end for c in chunks if c.complete and c.end <= resident), default=0)
        limit = len(ids) - 1  # the last prompt token always runs: its logits pick the first new token
        reuse_len = min(max(resident, match.length), limit)
        ws.ensure_capacity(capacity, keep=min(resident, reuse_len))
        copied = 0
        for seg in match.segments:
            if seg.end <= resident or seg.start >= reuse_len:
                continue
            ws.write(seg.record.keys, seg.record.values, seg.start, seg.n_tokens)
            copied += 1
        assembly = fallback = None
        if approximate and token_granular:
            # Sink tokens stay fresh: content is never placed before position sink_tokens.
            start = max(reuse_len, self.config.sink_tokens)
            assembly, fallback = content_state(self).assemble(ws, self.store, ids, start, limit, salt)
        return _Plan(reuse_len, reuse_len, min(resident, reuse_len), copied, (time.perf_counter() - t0) * 1e3,
                     assembly, fallback)

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompt: str | Messages | None = None, max_new_tokens: int = 64, *,
                 messages: Messages | None = None, mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, do_sample: bool | None = None,
                 stop: str | Sequence[str] | None = None, seed: int | None = None, cache_salt: str | None = None,
                 return_logits: bool = False, content_reuse: bool | None = None,
                 input_ids: Sequence[int] | None = None) -> GenerationResult:
        stream = self.generate_stream(prompt, max_new_tokens, messages=messages, mode=mode, temperature=temperature,
                                      top_p=top_p, top_k=top_k, do_sample=do_sample, stop=stop, seed=seed,
                                      cache_salt=cache_salt, return_logits=return_logits, content_reuse=content_reuse,
                                      input_ids=input_ids)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def generate_stream(self, prompt: str | Messages | None = None, max_new_tokens: int = 64, *,
                        messages: Messages | None = None, mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, do_sample: bool | None = None,
                        stop: str | Sequence[str] | None = None, seed: int | None = None,
                        cache_salt: str | None = None, return_logits: bool = False,
                        content_reuse: bool | None = None, input_ids: Sequence[int] | None = None) -> TextStream:
        """Validate now (bad input raises here, not mid-iteration), generate lazily while iterated.

        The prompt is one of: a string, chat messages, or input_ids (token ids the caller tokenized itself).

        content_reuse: also reuse stored chunks found at other positions (re-positioned and repaired with the
        engine's recompute_strategy; approximate). None follows EngineConfig.content_reuse (default off).
        """
        t0 = time.perf_counter()
        mode = GenerationMode.parse(mode)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                do_sample=do_sample, seed=seed, stop=list(stop) if isinstance(stop, (list, tuple))
                                else ([stop] if stop else []))
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string", "cache_salt")
        if content_reuse is None:
            content_reuse = self.config.content_reuse
        elif not isinstance(content_reuse, bool):
            raise InvalidRequestError(f"content_reuse must be a bool or None, got {content_reuse!r}", "content_reuse")
        ids = self.encode(prompt, messages, input_ids=input_ids)
        self._check_context(len(ids))
        prompt_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        stream = TextStream(iter(()))
        stream._events = self._run(stream, t0, ids, prompt_text, params, mode, cache_salt, return_logits,
                                   content_reuse)
        return stream

    def _run(self, stream: TextStream, t0: float, ids: list[int], prompt_text: str, params: SamplingParams,
             mode: GenerationMode, salt: str | None, return_logits: bool, content_reuse: bool) -> Iterator[str]:
        max_new = params.max_new_tokens
        if self.max_context is not None:
            max_new = min(max_new, self.max_context - len(ids))
        sampler = Sampler(params, self.device)
        tracker = OutputTracker(self.tokenizer, self.eos_token_ids, params.stop, max_new)
        with self._lock, torch.inference_mode():
            ws = self.workspace
            try:
                plan = self._plan(ids, mode, salt, capacity=len(ids) + max_new, approximate=content_reuse)
            finally:
                # Planning read the resident prefix; from here until this run finishes, the workspace holds
                # no trustworthy prefix (a failure part-way must not leave a half-written one claimed).
                ws.resident_tag = None
            recomputed = 0
            if plan.assembly is not None:
                from .reuse.repair import repair_forward

                cfg = self.config
                repaired = repair_forward(self.model, ws, ids, plan.reuse_len, plan.assembly.mask(len(ids)),
                                          plan.assembly.seams, cfg.recompute_strategy, cfg.recompute_ratio,
                                          cfg.recompute_overlap)
                logits, recomputed = repaired.logits, repaired.recomputed
                cache = ws.make_cache(len(ids))
            else:
                cache = ws.make_cache(plan.reuse_len)
                logits = forward_tokens(self.model, ids[plan.reuse_len:], cache)[0, -1]
            first_logits = logits.clone() if return_logits else None
            token = sampler(logits)
            ttft_ms = (time.perf_counter() - t0) * 1e3
            completed = False
            try:
                while True:
                    delta = tracker.feed(token)
                    if delta:
                        yield delta
                    if tracker.finished:
                        break
                    logits = forward_tokens(self.model, [token], cache)[0, -1]
                    token = sampler(logits)
                completed = True
            finally:
                # K/V exists for every token fed to the model: the prompt and each output that was run to
                # sample the next one. A forward that raised part-way leaves layers at different lengths,
                # so the workspace then claims nothing.
                fed = (ids + tracker.tokens)[: cache.get_seq_length()]
                if plan.assembly is not None:
                    # Everything from the first placed token on attended to approximate K/V: only the exact
                    # prefix may be trusted by the next request or stored under prefix-chain keys.
                    fed = fed[: plan.reuse_len]
                if completed or _consistent(cache):
                    ws.resident_ids, ws.resident_tag = fed, self._tag(salt)
            if mode is not GenerationMode.BASELINE and self.config.write_back:
                self._write_back(fed, salt)
        total_ms = (time.perf_counter() - t0) * 1e3
        self._count(mode, len(ids), plan.reuse_len, plan.lookup_ms)
        approx = plan.assembly.n_tokens if plan.assembly is not None else 0
        generated, text, finish = tracker.tokens, tracker.text, tracker.finish_reason
        stream.result = GenerationResult(
            mode=mode.value, prompt=prompt_text, output_text=text, generated_tokens=len(generated),
            ttft_ms=ttft_ms, total_ms=total_ms,
            tokens_per_sec=len(generated) / (total_ms / 1e3) if total_ms > 0 else 0.0,
            kv_reuse_ratio=(plan.reuse_len + approx) / len(ids), prompt_tokens=len(ids),
            cached_tokens=plan.reuse_len + approx, output_token_ids=list(generated), finish_reason=finish,
            exact_tokens=plan.exact_tokens, approximate_tokens=approx, recomputed_tokens=recomputed,
            lookup_ms=plan.lookup_ms, first_token_logits=first_logits)

    def _count(self, mode: GenerationMode, n_prompt: int, cached: int, lookup_ms: float) -> None:
        c = self._counters
        c.requests += 1
        c.prompt_tokens += n_prompt
        c.cached_tokens += cached
        c.lookup_ms += lookup_ms
        c.by_mode[mode.value] = c.by_mode.get(mode.value, 0) + 1

    # ---- storing ------------------------------------------------------------------------------
    def _write_back(self, seq: list[int], salt: str | None, source: KVWorkspace | None = None,
                    row: int = 0, cut_ids: Sequence[int] | None = None) -> tuple[int, int]:
        """Store every chunk of seq not stored yet (its K/V is in `source` row `row`, by default the engine's
        workspace); returns (new, existing). With cut_ids (a longer sequence that starts with seq), seq is
        cut as part of it: only its chunks that end within seq are stored, as that sequence's own chunks."""
        source = source if source is not None else self.workspace
        new = existing = 0
        size, window = self.config.chunk_size, self.config.chunk_boundary_window
        index = content_state(self).index  # every stored chunk is findable by content at other positions too
        chunks = (self.chunker.split(cut_ids, salt, end=len(seq)) if cut_ids is not None
                  else self.chunker.split(seq, salt))
        for chunk in chunks:
            meta = ChunkMeta(chunk.prefix_key, chunk.parent_key, chunk.content_key, chunk.token_ids, chunk.start)
            if self.store.contains(chunk.prefix_key):
                existing += 1
                index.add(meta, salt)  # e.g. stored by a disk tier in an earlier process
                continue
            keys, values = source.read(chunk.start, chunk.end, row=row)
            record = ChunkRecord(chunk.prefix_key, chunk.parent_key, chunk.content_key, chunk.token_ids,
                                 chunk.start, keys, values)
            if self.store.put(record):
                new += 1
                index.add(meta, salt)
            if chunk.complete:
                # A partial sibling that this complete chunk extends is now dead weight. With a boundary window a
                # shorter sibling may itself be a complete chunk of another sequence (cut earlier) with children
                # of its own; only one shorter than any complete chunk (size - W), or childless, is a remainder.
                n = len(chunk.token_ids)
                for meta in self.store.children(chunk.parent_key):
                    m = len(meta.token_ids)
                    if m < n and chunk.token_ids[:m] == meta.token_ids and (
                            m < size - window or not self.store.children(meta.key)):
                        self.store.delete(meta.key)
                        index.discard(meta.key)
        self._counters.chunks_written += new
        return new, existing

    def warm(self, text: str | None = None, position_offset: int = 0, *, messages: Messages | None = None,
             cache_salt: str | None = None) -> WarmResult:
        """Compute and store the K/V of a prefix (system prompt, few-shot block, document) ahead of requests."""
        t0 = time.perf_counter()
        if position_offset != 0:
            raise InvalidRequestError("position_offset other than 0 is not supported: exact reuse stores a prefix "
                                      "from position 0", "position_offset")
        if messages is not None:
            ids = self.encode(messages=messages, add_generation_prompt=False)
        else:
            ids = self.encode(text)
        self._check_context(len(ids))
        new, existing = self._warm_ids(ids, cache_salt)
        warnings = []
        if len(ids) < self.config.chunk_size:
            warnings.append(f"text is {len(ids)} tokens, shorter than one chunk ({self.config.chunk_size}); "
                            "it is stored as a partial chunk")
        return WarmResult(new, existing, len(ids), (time.perf_counter() - t0) * 1e3, warnings)

    def _warm_ids(self, ids: list[int], salt: str | None, cut_ids: Sequence[int] | None = None) -> tuple[int, int]:
        """Compute and store the K/V of token ids; returns (chunks stored, chunks already there). cut_ids: see
        _write_back (a shared prefix warmed as the chunks its longer prompts have)."""
        with self._lock, torch.inference_mode():
            ws = self.workspace
            try:
                plan = self._plan(ids + [0], GenerationMode.CHUNK_KV_REUSE, salt, capacity=len(ids) + 1)
            finally:
                ws.resident_tag = None  # as in _run: the resident prefix was read; trust nothing until done
            cache = ws.make_cache(plan.reuse_len)
            if plan.reuse_len < len(ids):
                forward_tokens(self.model, ids[plan.reuse_len:], cache)
            ws.resident_ids, ws.resident_tag = list(ids), self._tag(salt)
            return self._write_back(ids, salt, cut_ids=cut_ids)

    # ---- batches ------------------------------------------------------------------------------
    def generate_batch(self, prompts: Sequence[str | Messages] | None = None, max_new_tokens: int = 64, *,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, do_sample: bool | None = None,
                       stop: str | Sequence[str] | None = None, seed: int | None = None,
                       mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE, cache_salt: str | None = None,
                       max_batch_size: int | None = None,
                       input_ids: Sequence[Sequence[int]] | None = None) -> list[GenerationResult]:
        """Generate for many prompts (or token-id sequences) at once: a shared prefix is computed or loaded
        once, decode steps run batched. Results come back in input order; greedy outputs equal generate()'s."""
        t0 = time.perf_counter()
        encoded, texts = self._encode_many(prompts, input_ids)
        return self._run_batch(t0, encoded, texts, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               do_sample=do_sample, stop=stop, seed=seed, mode=mode, cache_salt=cache_salt,
                               max_batch_size=max_batch_size)

    def _run_batch(self, t0: float, encoded: list[list[int]], texts: list[str], max_new_tokens: int, *,
                   temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, do_sample: bool | None = None,
                   stop: str | Sequence[str] | None = None, seed: int | None = None,
                   mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE, cache_salt: str | None = None,
                   max_batch_size: int | None = None) -> list[GenerationResult]:
        from .batch import BatchRunner

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                do_sample=do_sample, seed=seed,
                                stop=list(stop) if isinstance(stop, (list, tuple)) else ([stop] if stop else []))
        mode = GenerationMode.parse(mode)
        for ids in encoded:
            self._check_context(len(ids))
        runner = BatchRunner(self, max_batch_size=max_batch_size or len(encoded))
        handles = [runner.add(ids, params, text, cache_salt, mode, t_start=t0) for ids, text in zip(encoded, texts)]
        while runner.has_work():
            runner.step()
        for h in handles:
            if h.error is not None:
                raise h.error
        return [h.result for h in handles]

    def generate_many(self, prompts: Sequence[str | Messages] | None = None, max_new_tokens: int = 64, *,
                      input_ids: Sequence[Sequence[int]] | None = None, **kwargs) -> list[GenerationResult]:
        """Like generate_batch, but prompts are grouped by shared prefix chunks and each group runs as one
        batch, so unrelated prompts never pad each other out. Results come back in input order."""
        from .batch import group_by_prefix

        encoded, texts = self._encode_many(prompts, input_ids)  # once: each group runs from these ids
        groups = group_by_prefix([str(i) for i in range(len(encoded))], encoded, self.config.chunk_size,
                                 chunker=self.chunker)
        results: list[GenerationResult | None] = [None] * len(encoded)
        for members in groups.values():
            batch = self._run_batch(time.perf_counter(), [encoded[i] for i in members], [texts[i] for i in members],
                                    max_new_tokens, **kwargs)
            for i, r in zip(members, batch):
                results[i] = r
        return results  # type: ignore[return-value]

    def _encode_many(self, prompts, input_ids) -> tuple[list[list[int]], list[str]]:
        """(token ids, prompt text) per prompt, from exactly one of `prompts` and `input_ids`."""
        if (prompts is None) == (input_ids is None):
            raise InvalidRequestError("pass one of prompts or input_ids", "prompts")
        name, items = ("prompts", prompts) if prompts is not None else ("input_ids", input_ids)
        if not isinstance(items, (list, tuple)) or not items:
            raise InvalidRequestError(f"{name} must be a non-empty list", name)
        if input_ids is not None:
            encoded = [self.encode(input_ids=ids) for ids in input_ids]
            return encoded, [self.tokenizer.decode(ids) for ids in encoded]
        encoded = [self.encode(p) for p in prompts]
        return encoded, [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(prompts, encoded)]

    # ---- introspection ------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        c = self._counters
        per_tier = self.store.tier_stats() if hasattr(self.store, "tier_stats") else {"memory": self.store.stats()}
        tiers = {name: t.as_dict() for name, t in per_tier.items()}
        return {
            "requests": c.requests, "prompt_tokens": c.prompt_tokens, "cached_tokens": c.cached_tokens,
            "reuse_ratio": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "avg_lookup_ms": c.lookup_ms / c.requests if c.requests else 0.0,
            "chunks_written": c.chunks_written, "requests_by_mode": dict(c.by_mode), "tiers": tiers,
            "workspace_bytes": self.workspace.nbytes, "chunk_size": self.config.chunk_size,
            "namespace": self.namespace,
        }

    def clear_cache(self) -> None:
        """Forget every stored chunk and the workspace's resident prefix."""
        with self._lock:
            self.store.clear()
            self.workspace.resident_ids, self.workspace.resident_tag = [], None

    def forget_workspace(self) -> None:
        """Make the next request load its reuse from the store instead of the resident workspace prefix."""
        with self._lock:
            self.workspace.resident_ids, self.workspace.resident_tag = [], None

    def verify_correctness(self, prompts: Sequence[str] | None = None, max_new_tokens: int = 32, *,
                           approximate: bool = False):
        """Exact reuse vs baseline, token for token; approximate=True: reuse at another position, judged by
        first-token agreement and KL against full prefill (see verify.verify_correctness)."""
        from .verify import verify_correctness

        return verify_correctness(self, prompts, max_new_tokens, approximate=approximate)


def _consistent(cache) -> bool:
    return len({layer.get_seq_length() for layer in cache.layers}) == 1


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
