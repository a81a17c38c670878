"""InferenceEngine (exported as KVBoost): the request lifecycle, short enough to read in one screen.

    request(...)  -> Request           the keyword API, validated once (request.py)
    prefill(req)                       kv.lookup -> kv.place -> forward (or repair) over the workspace
    decode loop                        sample, feed the tracker, one forward per token
    finish                             kv.write_back of the exact part, kv.record, req.result(...)

Batches and the server run the same steps through batch.BatchRunner, over the same KV-cache manager.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

# Imported for their registrations in transformers' attention interfaces before the runner compiles a step: compile
# guards on that registry's size, and a later registration (first batch / paged forward) would compile it again.
from .batch import cascade as _cascade  # noqa: F401
from .chunking import Chunker, boundary_classes, make_namespace, model_fingerprint
from .compat import check_model_compatibility
from .config import EngineConfig
from .decoding.factory import make_draft_engine, make_speculator, speculation_stats
from .decoding.speculative import SpecCounts, StepCosts
from .errors import InvalidRequestError
from .kv.build import build_kv_manager
from .kv.manager import Plan
from .kv.workspace import KVWorkspace
from .loading import eos_token_ids
from .model.attention import paged_hf as _paged_hf  # noqa: F401  (registration, see above)
from .model.cpu_linear import install_cpu_linear
from .model.fast_path import fast_path_stats, make_runner
from .model.forward import forward_tokens, probe_layer_shapes, resolve_attention
from .model.streamed_sequence import StreamedSequence
from .model.table_runner import make_table_runner
from .model.table_sequence import TableSequence, use_table_forward
from .prompting import Messages
from .request import Request
from .request_factory import RequestFactory
from .results import GenerationMode, GenerationResult, RecomputeStrategy, WarmResult
from .sampling import SamplingParams
from .streaming import finish_streamed, streamed_prefill, streamed_warm


@dataclass
class Prefill:
    """The prompt's K/V is in the engine's workspace (or, paged_attention="table", the plan's block table): `cache`
    holds it, `logits` pick the first new token."""

    plan: Plan
    cache: Cache | TableSequence
    logits: torch.Tensor  # [vocab] float32, last prompt position


class TextStream:
    """Iterate for text deltas; afterwards `.result` holds the GenerationResult. close() stops generation."""

    def __init__(self) -> None:
        self._events: Iterator[str] = iter(())
        self.result: GenerationResult | None = None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._events)

    def close(self) -> None:
        close = getattr(self._events, "close", None)
        if close is not None:
            close()


class InferenceEngine:
    def __init__(self, model, tokenizer, chunk_size: int = 128, max_chunks: int | None = None,
                 recompute_overlap: int = 16, recompute_strategy: RecomputeStrategy | str = RecomputeStrategy.SELECTIVE,
                 recompute_ratio: float = 0.15, kv_cache_bits: int = 16, disk_cache_dir: str | None = None,
                 device: str | None = None, *, strict: bool = True, draft_model=None, **options):
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
        self.attention, self.attention_reason = resolve_attention(self.config.attention_backend, model)
        self.cpu_linear = install_cpu_linear(self.config.cpu_linear, model)  # before any timed forward
        text_config = model.config.get_text_config()
        self.max_context: int | None = getattr(text_config, "max_position_embeddings", None)
        self.fingerprint = model_fingerprint(model)
        self.namespace = make_namespace(self.fingerprint, kv_dtype, self.config.chunk_size,
                                        self.config.kv_cache_bits, self.config.chunk_boundary_window)
        window = self.config.chunk_boundary_window
        # The token classes are computed once per tokenizer (cached), so split() only indexes a table.
        self.chunker = Chunker(self.config.chunk_size, self.namespace, window,
                               boundary_classes(tokenizer) if window else None)
        self.kv = build_kv_manager(self.config, self.namespace, self.chunker, model, shapes, kv_dtype, self.device,
                                   self.max_context)
        # paged_attention="table": single requests run over their block table, not the workspace (table_sequence).
        self.table_forward = use_table_forward(self.config.paged_attention, model)
        self.workspace = KVWorkspace(shapes, kv_dtype, self.device, max_positions=self.max_context)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.requests = RequestFactory(self.config, model, tokenizer, self.max_context, self.eos_token_ids)
        # Decode steps and short suffixes in fixed-size buckets (CUDA graphs on a GPU): model/runner.py.
        self.runner, self.fast_path_reason = make_runner(self.config.fast_path, model, self.workspace,
                                                         self.attention, verifies=self.config.speculative is not None)
        self.table_runner = make_table_runner(self.runner, model, self.kv.blocks.pool) if self.table_forward else None
        # Serializes every forward over the model and the workspaces (single requests, batch steps, warm).
        self.lock = threading.RLock()
        self._warm_up()
        # Speculative decoding with a draft model: the draft runs in an engine of its own (its own workspace and
        # prefix reuse), used only under this engine's lock.
        self.draft = make_draft_engine(self, draft_model) if draft_model is not None else None
        if self.config.speculative == "draft" and self.draft is None:
            raise ValueError("speculative='draft' needs draft_model= (a path, hub id or loaded model sharing the "
                             "tokenizer)")
        self.spec_counts = SpecCounts()  # summed over finished requests: cache_stats()["speculative"]
        self.spec_costs: dict[str, StepCosts] = {}  # measured step costs per method, shared by requests

    def _warm_up(self) -> None:
        """Compile the Triton kernels and capture the runner's graphs at load, so that no request, the first
        included, pays for either (a Triton compile costs ~0.5-1 s per kernel variant on an H100)."""
        ahead = self.runner is not None and self.runner.mode in ("graphs", "compiled")  # capture / compile
        if self.attention != "triton" and not ahead:
            return
        with self.lock, torch.inference_mode():
            if self.attention == "triton":
                n = (self.runner.max_tokens if self.runner else 256) + 1  # past every bucket: the eager path
                forward_tokens(self.model, [0] * n, self.workspace.make_cache(0), attention=self.attention)
            if ahead:
                self.runner.warm_up()
                if self.table_runner is not None and self.table_runner.mode == "graphs":
                    self.table_runner.warm_up()
            self.workspace.resident_ids, self.workspace.resident_tag = [], None  # scratch K/V, nothing resident

    @property
    def paged_backend(self) -> str | None:
        """The attention preference of forwards over a block table: the engine's Triton choice, else automatic."""
        return "triton" if self.attention == "triton" else ("sdpa" if self.attention == "sdpa" else None)

    @property
    def draft(self) -> InferenceEngine | None:
        """The draft model's engine (speculative="draft"), or None."""
        return self._draft

    @draft.setter
    def draft(self, engine: InferenceEngine | None) -> None:
        self._draft = engine
        self.requests.has_draft = engine is not None  # requests for speculative="draft" are refused without one

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | None = None, strict: bool = True, *,
                        dtype: str | torch.dtype | None = None, device: str | None = None,
                        trust_remote_code: bool = False, revision: str | None = None, **kwargs) -> InferenceEngine:
        """Load a model (the embedded SmolLM2-135M-Instruct when no name is given) and wrap it."""
        from .loading import load_model_and_tokenizer

        hf = {"trust_remote_code": trust_remote_code}
        if revision:
            hf["revision"] = revision
        model, tokenizer = load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=device, **hf)
        return cls(model, tokenizer, strict=strict, **kwargs)

    @property
    def store(self):
        """The chunk store (every tier) behind the KV-cache manager."""
        return self.kv.store

    # ---- requests (request_factory.py) ---------------------------------------------------------------
    def encode(self, prompt: str | Messages | None = None, messages: Messages | None = None,
               add_generation_prompt: bool = True, input_ids: Sequence[int] | None = None,
               chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids for a raw prompt (used as-is), chat messages (chat template) or the caller's own ids."""
        return self.requests.encode(prompt, messages, add_generation_prompt, input_ids, chat_template_kwargs)

    def check_prompt_length(self, n_prompt: int, param: str = "prompt") -> None:
        self.requests.check_prompt_length(n_prompt, param)

    def tenant(self, cache_salt: str | None) -> str | None:
        return self.requests.tenant(cache_salt)

    def make_request(self, ids: Sequence[int], params: SamplingParams, prompt_text: str | None = None,
                     **options) -> Request:
        """A validated Request from token ids (RequestFactory.make_request)."""
        return self.requests.make_request(ids, params, prompt_text, **options)

    @property
    def grammars(self):
        """The GrammarCompiler (compiled output formats, LRU-cached)."""
        return self.requests.grammars

    def speculation(self, *args, **kwargs):
        """A request's SpeculativeParams resolved against EngineConfig, None when off (RequestFactory)."""
        return self.requests.speculation(*args, **kwargs)

    def request(self, prompt: str | Messages | None = None, max_new_tokens: int = 64, **options) -> Request:
        """The keyword API as a Request (RequestFactory.request): one of prompt, messages or input_ids; mode,
        temperature, top_p, top_k, do_sample, stop, seed, cache_salt, content_reuse, return_logits,
        response_format, regex, grammar, logprobs, speculative, num_speculative_tokens, prompt_lookup_*_ngram."""
        return self.requests.request(prompt, max_new_tokens, **options)

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompt: str | Messages | None = None, max_new_tokens: int = 64, **options) -> GenerationResult:
        """Generate for one prompt; options as request() (RequestFactory.request lists them all)."""
        return self.run(self.request(prompt, max_new_tokens, **options))

    def generate_stream(self, prompt: str | Messages | None = None, max_new_tokens: int = 64,
                        **options) -> TextStream:
        """Validate now (bad input raises here, not mid-iteration), generate lazily while iterated.

        content_reuse: also reuse stored chunks found at other positions (re-positioned and repaired with the
        engine's recompute_strategy; approximate). None follows EngineConfig.content_reuse (default off).
        """
        return self.stream(self.request(prompt, max_new_tokens, **options))

    def run(self, request: Request) -> GenerationResult:
        stream = self.stream(request)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, request: Request) -> TextStream:
        stream = TextStream()
        stream._events = self._generate(request, stream)
        return stream

    def _generate(self, request: Request, stream: TextStream) -> Iterator[str]:
        sampler = request.sampler(self.device)
        tracker = request.tracker(self.tokenizer, self.eos_token_ids)
        with self.lock, torch.inference_mode():
            pre = self.prefill(request)
            plan, cache = pre.plan, pre.cache
            first_logits = pre.logits.clone() if request.return_logits else None
            burst = [sampler(pre.logits)]  # tokens sampled and not yet shown; the last one has no K/V yet
            ttft_ms = (time.perf_counter() - request.t_start) * 1e3
            length = len(request.ids)  # tokens whose K/V the workspace holds: it grows only after a forward
            spec = None
            try:
                if request.speculative is not None:
                    spec = make_speculator(self, request, sampler, cache, request.ids + burst)
                while True:
                    delta = "".join(_feed(tracker, burst))
                    if delta:
                        yield delta  # a speculative step's kept tokens arrive as one burst
                    if tracker.finished:
                        break
                    if spec is None:
                        burst = [sampler(self._decode_step(burst[-1], cache, length))]
                    else:
                        burst = spec.step(burst[-1], length, tracker.max_new_tokens - len(tracker.tokens))
                    length += len(burst)  # the fed token and the kept drafts; rejected drafts' K/V is past it
            finally:
                # The cache learns its length (the runner wrote decode K/V behind it; a verify wrote rejected
                # drafts past it; a forward that raised part-way left layers longer): K/V exists for exactly
                # the prompt and each output token run to produce the next one.
                self.set_cache_length(cache, length)
                fed = (request.ids + tracker.tokens)[:length]
                self.finish(request, plan, fed)
                if isinstance(cache, StreamedSequence):
                    finish_streamed(self.kv, cache)
                if spec is not None:
                    spec.close(request.ids + tracker.tokens)
        self.kv.record(request.mode, len(request.ids), plan)
        if spec is not None:
            self.spec_counts.merge(spec.counts)
        stream.result = request.result(plan, tracker, ttft_ms, first_logits, sampler, spec.counts if spec else None)

    def prefill(self, request: Request) -> Prefill:
        """Put the prompt's K/V into the engine's workspace: reuse what the plan finds, prefill (or repair) the
        rest. The caller holds self.lock under torch.inference_mode()."""
        ids, ws = request.ids, self.workspace
        if self.kv.streams(len(ids) + request.params.max_new_tokens):  # longer than the device holds
            plan, seq, logits = streamed_prefill(self.kv, self.model, self.attention, ids, request.salt,
                                                 request.mode, request.approximate, request.params.max_new_tokens)
            return Prefill(plan, seq, logits)
        if self.table_forward:  # the stored prefix stays in its blocks; the workspace is not touched
            plan = self.kv.lookup(ids, request.salt, request.mode, request.approximate)
            seq = TableSequence(self.model, self.kv.sequence_table(plan), self.paged_backend, self.table_runner)
            return Prefill(plan, seq, seq.forward(ids[plan.reuse_len:], plan.reuse_len))
        plan = self.kv.lookup(ids, request.salt, request.mode, request.approximate, self._resident(request.salt))
        # From here until the forward succeeds the workspace holds no trustworthy prefix: writes past the plan's
        # resident part may overwrite what the previous request left.
        ws.resident_tag = None
        ws.ensure_capacity(len(ids) + request.params.max_new_tokens, keep=plan.resident)
        self.kv.place(plan, ws, ids)
        if plan.needs_repair:
            from .reuse.repair import repair_forward

            cfg = self.config
            assert plan.assembly is not None
            repaired = repair_forward(self.model, ws, ids, plan.reuse_len, plan.assembly.mask(len(ids)),
                                      plan.assembly.seams, cfg.recompute_strategy, cfg.recompute_ratio,
                                      cfg.recompute_overlap)
            logits, plan.recomputed_tokens = repaired.logits, repaired.recomputed
            cache = ws.make_cache(len(ids))
        elif self.runner is not None and self.runner.fits(len(ids) - plan.reuse_len):
            logits = self.runner.forward(ids[plan.reuse_len:], plan.reuse_len).clone()
            cache = ws.make_cache(len(ids))
        else:
            cache = ws.make_cache(plan.reuse_len)
            logits = forward_tokens(self.model, ids[plan.reuse_len:], cache, attention=self.attention)[0, -1]
        self._claim(request, plan, ids)
        return Prefill(plan, cache, logits)

    def _decode_step(self, token: int, cache: Cache, length: int) -> torch.Tensor:
        """Logits [vocab] after feeding `token` at position `length` (the runner's captured step when there is
        one; the cache's layer lengths then catch up once, when decoding ends)."""
        if isinstance(cache, TableSequence):
            return cache.forward([token], length)
        if self.runner is not None:
            return self.runner.forward([token], length)
        return forward_tokens(self.model, [token], cache, attention=self.attention)[0, -1]

    def forward_at(self, tokens: list[int], cache: Cache, start: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions [start, start + n) after the K/V of [0, start): float32 logits [vocab] of the
        last token, or [n, vocab] of every one (all_logits: a speculative verify), overwriting what lay past start.
        The caller holds the lock; the cache's length is right only after set_cache_length (the runner's isn't)."""
        if isinstance(cache, TableSequence):
            return cache.forward(tokens, start, all_logits)
        if self.runner is not None and self.runner.fits(len(tokens)):
            if all_logits and len(tokens) > 1:  # one token (no drafts) is the decode step: verify pads to 16
                return self.runner.verify(tokens, start)
            return self.runner.forward(tokens, start)[None] if all_logits else self.runner.forward(tokens, start)
        self.set_cache_length(cache, start)
        logits = forward_tokens(self.model, tokens, cache, logits_to_keep=len(tokens) if all_logits else 1,
                                attention=self.attention)[0]
        return logits if all_logits else logits[-1]

    @staticmethod
    def set_cache_length(cache: Cache | TableSequence, length: int) -> None:
        """Every layer of a workspace cache holds `length` positions (rolls back what lies past it)."""
        if isinstance(cache, TableSequence):
            return cache.set_length(length)
        for layer in cache.layers:
            layer.set_length(length)

    def _resident(self, salt: str | None) -> list[int]:
        ws = self.workspace
        return ws.resident_ids if ws.resident_tag == self.kv.tag(salt) else []

    def _claim(self, request: Request, plan: Plan, fed: list[int]) -> None:
        """Record which exact K/V the workspace now holds: after a placed (approximate) position every later
        token attended to approximate K/V, so only the exact prefix may be trusted by the next request."""
        exact = fed[: plan.reuse_len] if plan.needs_repair else fed
        self.workspace.resident_ids, self.workspace.resident_tag = list(exact), self.kv.tag(request.salt)

    def finish(self, request: Request, plan: Plan, fed: list[int]) -> None:
        """The workspace holds the K/V of `fed` (prompt + output) for `request`: claim it, write back its chunks.
        (paged_attention="table": the plan's table holds it; its blocks become stored chunks, nothing is copied.)"""
        if plan.streamed:  # its host blocks become host chunks
            if request.uses_cache and self.config.write_back:
                assert plan.table is not None
                self.kv.write_back_streamed(plan.table, fed, request.salt)
            return
        if self.table_forward:
            if request.uses_cache and self.config.write_back:
                self.kv.write_back_table(self.kv.sequence_table(plan), fed, request.salt)
            return
        self._claim(request, plan, fed)
        if request.uses_cache and self.config.write_back:
            self.kv.write_back(self.workspace.resident_ids, request.salt, self.workspace)

    # ---- storing ahead of requests ------------------------------------------------------------------
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
        self.check_prompt_length(len(ids))
        new, existing = self.warm_ids(ids, self.tenant(cache_salt))
        warnings = []
        if len(ids) < self.config.chunk_size:
            warnings.append(f"text is {len(ids)} tokens, shorter than one chunk ({self.config.chunk_size}); "
                            "it is stored as a partial chunk")
        return WarmResult(new, existing, len(ids), (time.perf_counter() - t0) * 1e3, warnings)

    def warm_ids(self, ids: Sequence[int], salt: str | None = None,
                 cut_ids: Sequence[int] | None = None) -> tuple[int, int]:
        """Compute and store the K/V of token ids; returns (chunks stored, chunks already there). cut_ids: a
        longer sequence that starts with ids, whose chunks these are (see KVCacheManager.write_back)."""
        ids = list(ids)
        with self.lock, torch.inference_mode():
            if self.kv.streams(len(ids) + 1):  # longer than the device holds: kept in host blocks
                return streamed_warm(self.kv, self.model, self.attention, ids, salt)
            ws = self.workspace
            # One more position than ids, so that every id may be reused (the last one needs no logits here).
            plan = self.kv.lookup(ids + [0], salt, GenerationMode.CHUNK_KV_REUSE, resident=self._resident(salt))
            ws.resident_tag = None
            ws.ensure_capacity(len(ids) + 1, keep=plan.resident)
            self.kv.place(plan, ws, ids)
            cache = ws.make_cache(plan.reuse_len)
            if plan.reuse_len < len(ids):
                forward_tokens(self.model, ids[plan.reuse_len:], cache, attention=self.attention)
            ws.resident_ids, ws.resident_tag = ids, self.kv.tag(salt)
            return self.kv.write_back(ids, salt, ws, cut_ids=cut_ids)

    # ---- batches ------------------------------------------------------------------------------
    def generate_batch(self, prompts: Sequence[str | Messages] | None = None, max_new_tokens: int = 64, *,
                       input_ids: Sequence[Sequence[int]] | None = None, max_batch_size: int | None = None,
                       **options) -> list[GenerationResult]:
        """Generate for many prompts (or token-id sequences) at once: a shared prefix is computed or loaded
        once, decode steps run batched. Options as request() (mode, temperature, top_p, top_k, do_sample, stop,
        seed, cache_salt, content_reuse), applied to every row. Results come back in input order; outputs and
        reuse counts equal generate()'s one at a time."""
        return self.run_batch(self.requests.batch(prompts, input_ids, max_new_tokens, options), max_batch_size)

    def generate_many(self, prompts: Sequence[str | Messages] | None = None, max_new_tokens: int = 64, *,
                      input_ids: Sequence[Sequence[int]] | None = None, max_batch_size: int | None = None,
                      **options) -> list[GenerationResult]:
        """Like generate_batch, but prompts are grouped by shared prefix chunks and each group runs as one
        batch, so unrelated prompts never pad each other out. Results come back in input order."""
        from .batch import group_by_prefix

        requests = self.requests.batch(prompts, input_ids, max_new_tokens, options)
        groups = group_by_prefix([str(i) for i in range(len(requests))], [r.ids for r in requests],
                                 self.config.chunk_size, chunker=self.chunker)
        results: list[GenerationResult | None] = [None] * len(requests)
        for members in groups.values():
            t0 = time.perf_counter()  # each group's TTFT counts from when its batch starts
            for i in members:
                requests[i].t_start = t0
            for i, r in zip(members, self.run_batch([requests[i] for i in members], max_batch_size)):
                results[i] = r
        return results  # type: ignore[return-value]

    def run_batch(self, requests: list[Request], max_batch_size: int | None = None) -> list[GenerationResult]:
        """Run requests together through the continuous-batching runner until all are done. Speculative requests
        (a verify is per sequence) and contexts longer than device_kv_max_tokens (streamed from host memory) run
        apart, one at a time through the single-request path; results keep order."""
        from .batch import BatchRunner, runs_apart

        plain = [r for r in requests if runs_apart(self, r) is None]
        runner = BatchRunner(self, max_batch_size=max_batch_size or max(1, len(plain)))
        handles = {id(r): runner.add(r) for r in plain}
        while runner.has_work():
            runner.step()
        for h in handles.values():
            if h.error is not None:
                raise h.error
        return [handles[id(r)].result if id(r) in handles else self.run(r) for r in requests]

    # ---- introspection ------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        fast = fast_path_stats(self.runner, self.fast_path_reason, self.cpu_linear, self.table_runner)
        return dict(self.kv.stats(), workspace_bytes=self.workspace.nbytes, fast_path=fast,
                    paged_attention=("table" if self.table_forward else "workspace") if self.kv.blocks else None,
                    speculative=speculation_stats(self.config, self.spec_counts, self.spec_costs))

    def clear_cache(self) -> None:
        """Forget every stored chunk and the workspace's resident prefix."""
        with self.lock:
            self.kv.clear()
            self.workspace.resident_ids, self.workspace.resident_tag = [], None

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until chunks written behind to the disk / Redis tiers have landed (bounded; False on timeout).
        Not needed for correctness: a chunk still queued is served from the queue, and exit flushes."""
        return self.kv.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush (bounded) and release the disk and Redis tiers: call it when done with the engine (process exit
        flushes on its own)."""
        return self.kv.close(timeout_s)

    def forget_workspace(self) -> None:
        """Make the next request load its reuse from the store instead of the resident workspace prefix."""
        with self.lock:
            self.workspace.resident_ids, self.workspace.resident_tag = [], None

    def verify_correctness(self, prompts: Sequence[str] | None = None, max_new_tokens: int = 32, *,
                           approximate: bool = False):
        """Exact reuse vs baseline, token for token; approximate: reuse elsewhere, by first-token agreement and KL."""
        from .verify import verify_correctness

        return verify_correctness(self, prompts, max_new_tokens, approximate=approximate)


def _feed(tracker, tokens: list[int]) -> Iterator[str]:
    """Text deltas of tokens fed in order, up to the one that finishes the output (the rest are dropped)."""
    for token in tokens:
        yield tracker.feed(token)
        if tracker.finished:
            return
