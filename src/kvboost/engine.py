"""InferenceEngine (exported as KVBoost): the public API over one step loop.

Every request is validated once (request_factory.py) and becomes a row of the engine's scheduler (scheduler.py), whose
step() admits rows (prefill through the KV-cache manager), runs one forward for all rows and samples, emits and finishes
them. generate() drains the loop for one row; streams, batches, warm() and the server submit to the same loop.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence

import torch

# Imported for their attention-interface registrations before the runner compiles: a later registration would recompile.
from .batch import cascade as _cascade  # noqa: F401
from .batch.rows import SequenceHandle
from .chunking import Chunker, boundary_classes, make_namespace, model_fingerprint
from .compat import check_model_compatibility
from .config import EngineConfig
from .decoding.factory import make_draft_engine, speculation_stats
from .decoding.speculative import SpecCounts, StepCosts
from .errors import InvalidRequestError
from .kv.dtype import resolve_kv_dtype
from .kv.long_context import LongContexts, device_kv_budget, device_max_tokens
from .kv.manager import KVCacheManager
from .kv.workspace import KVWorkspace, RowView
from .loading import eos_token_ids
from .model.cpu_linear import install_cpu_linear
from .model.fast_path import fast_path_stats, make_runner
from .model.forward import forward_tokens, probe_layer_shapes, resolve_attention
from .model.weight_stream import stream_weights
from .plan import describe, environment
from .prompting import Messages
from .request import Request, check_prompt_length
from .request_factory import RequestFactory
from .results import GenerationMode, GenerationResult, RecomputeStrategy, WarmResult
from .sampling import SamplingParams
from .scheduler import Scheduler
from .slot import HostSlot
from .store.tiered import build_store


class TextStream:
    """Iterate for text deltas; afterwards `.result` holds the GenerationResult. close() stops generation (what was
    computed is still stored). Each read steps the engine's loop until this request has new text."""

    def __init__(self, engine: InferenceEngine, handle: SequenceHandle):
        self.engine, self.handle = engine, handle
        self.result: GenerationResult | None = None
        self._finalizer = weakref.finalize(self, handle.cancel)  # abandoned unread: cancelled, not left running

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        handle = self.handle
        while True:
            deltas = handle.take_deltas()
            if deltas:
                return "".join(deltas)
            if handle.finished:
                if handle.error is not None:
                    raise handle.error
                self.result = handle.result
                raise StopIteration
            self.engine.step()

    def close(self) -> None:
        if not self.handle.finished:
            self.handle.cancel()
            self.engine.step()  # the row leaves now (its K/V is stored), not at some later step


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
        self.weight_stream = None  # decoder layers streamed from host memory (weight_budget_bytes)
        if self.config.weight_budget_bytes is not None:
            target = torch.device(device) if device is not None else next(model.parameters()).device
            self.weight_stream = stream_weights(model, self.config.weight_budget_bytes, target,
                                                self.config.weight_prefetch_depth or 2,
                                                fixed_slots=self.config.fast_path == "graphs")
        elif device is not None:
            model.to(device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # Every combination that cannot run on this model and device is refused here, before anything is built.
        env = environment(model, has_draft_model=draft_model is not None)
        self.config.check(env)
        self.workspace_shapes, model_kv_dtype = probe_layer_shapes(model)
        self.attention, self.attention_reason = resolve_attention(self.config.attention_backend, model)
        self.kv_dtype, kv_dtype_reason = resolve_kv_dtype(self.config.kv_dtype, model_kv_dtype, self.device,
                                                          self.attention, env.quantized)
        self.cpu_linear = install_cpu_linear(self.config.cpu_linear, model)  # before any timed forward
        text_config = model.config.get_text_config()
        self.max_context: int | None = getattr(text_config, "max_position_embeddings", None)
        self.fingerprint = model_fingerprint(model)
        self.namespace = make_namespace(self.fingerprint, self.kv_dtype, self.config.chunk_size,
                                        self.config.kv_cache_bits, self.config.chunk_boundary_window)
        window = self.config.chunk_boundary_window
        # The token classes are computed once per tokenizer (cached), so split() only indexes a table.
        self.chunker = Chunker(self.config.chunk_size, self.namespace, window,
                               boundary_classes(tokenizer) if window else None)
        # On a GPU the memory tier is the device's and a host tier holds what it evicts (store/host.py).
        device_budget = device_kv_budget(self.config.device_kv_budget_bytes, self.device)
        store = build_store(self.config, self.namespace, device_budget_bytes=device_budget,
                            pin_host=self.device.type == "cuda")
        self.kv = KVCacheManager(self.config, self.namespace, self.chunker, store, model)
        # Contexts longer than the device holds keep their K/V in host memory (kv/long_context.py).
        max_tokens = device_max_tokens(self.config.device_kv_max_tokens, self.device, device_budget,
                                       self.workspace_shapes, self.kv_dtype, self.max_context)
        self.long_contexts = LongContexts(max_tokens, self.workspace_shapes, self.kv_dtype, self.device,
                                          self.max_context)
        # The K/V of every running request: one row each (slot.py), rows added as requests run together.
        self.kv_workspace = KVWorkspace(self.workspace_shapes, self.kv_dtype, self.device,
                                        max_positions=self.max_context)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.requests = RequestFactory(self.config, model, tokenizer, self.max_context, self.eos_token_ids)
        # Decode steps and short suffixes in fixed-size buckets (CUDA graphs on a GPU): model/runner.py.
        if self.weight_stream is not None and not self.weight_stream.fixed_slots:  # RULES refused compiled / eager
            self.runner, self.fast_path_reason = None, "off: weights stream from host memory (the eager path)"
        else:
            self.runner, self.fast_path_reason = make_runner(self.config.fast_path, model, self.kv_workspace,
                                                             self.attention,
                                                             verifies=self.config.speculative is not None)
        self.plan = describe(self.config, self.device, model_kv_dtype, kv_dtype_reason, self.attention,
                             self.attention_reason, self.runner.mode if self.runner else "off",
                             self.fast_path_reason, self.cpu_linear, self.kv.store.tier_names(), max_tokens)
        # Serializes every forward over the model and the workspace (steps of the loop, warm).
        self.lock = threading.RLock()
        self._warm_up()
        self.scheduler = Scheduler(self, self.config.max_batch_size, workspace=self.kv_workspace, runner=self.runner)
        # Speculation with a draft model: the draft runs in an engine of its own, under this engine's lock.
        self.draft = make_draft_engine(self, draft_model) if draft_model is not None else None
        self.spec_counts = SpecCounts()  # summed over finished requests: cache_stats()["speculative"]
        self.spec_costs: dict[str, StepCosts] = {}  # measured step costs per method, shared by requests

    def _warm_up(self) -> None:
        """Compile the Triton kernels and capture the runner's graphs at load, so no request pays for either."""
        ahead = self.runner is not None and self.runner.mode in ("graphs", "compiled")  # capture / compile
        with self.lock, torch.inference_mode():
            if self.attention == "triton":
                n = (self.runner.max_tokens if self.runner else 256) + 1  # past every bucket: the eager path
                forward_tokens(self.model, [0] * n, self.workspace.make_cache(0), attention=self.attention)
            if ahead:
                self.runner.warm_up()
            self.kv_workspace.forget_residents()  # scratch K/V, nothing resident

    @property
    def workspace(self) -> RowView:
        """The workspace's first row: what a request running alone holds (and leaves resident for the next)."""
        return self.kv_workspace.row(0)

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
                        trust_remote_code: bool = False, revision: str | None = None, weights: str = "float",
                        **kwargs) -> InferenceEngine:
        """Load a model (the embedded SmolLM2-135M-Instruct when no name is given) and wrap it. weights="int4": its
        Linear layers in INT4 (loading.load_model_and_tokenizer). With weight_budget_bytes the model is loaded into
        host memory and only what the budget keeps resident reaches the device."""
        from .loading import choose_device, load_model_and_tokenizer

        hf = {"trust_remote_code": trust_remote_code}
        if revision:
            hf["revision"] = revision
        streams = kwargs.get("weight_budget_bytes") is not None
        model, tokenizer = load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=device, weights=weights,
                                                    on_host=streams, **hf)
        if streams:
            kwargs["device"] = str(choose_device(device))
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

    # ---- generation: submit to the loop, drain it ---------------------------------------------------
    def generate(self, prompt: str | Messages | None = None, max_new_tokens: int = 64, **options) -> GenerationResult:
        """Generate for one prompt; options as request() (RequestFactory.request lists them all)."""
        return self.run(self.request(prompt, max_new_tokens, **options))

    def generate_stream(self, prompt: str | Messages | None = None, max_new_tokens: int = 64, **options) -> TextStream:
        """Validate now (bad input raises here, not mid-iteration), generate lazily while iterated; options as
        request()."""
        return self.stream(self.request(prompt, max_new_tokens, **options))

    def run(self, request: Request) -> GenerationResult:
        stream = self.stream(request)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, request: Request) -> TextStream:
        return TextStream(self, self.submit(request))

    def submit(self, request: Request, max_rows: int | None = None) -> SequenceHandle:
        """Queue a request as a row of the loop; whoever steps the loop (step(), a stream's reader, the server's
        worker) runs it. max_rows: run it only in steps of at most that many rows."""
        return self.scheduler.add(request, max_rows=max_rows)

    def step(self) -> None:
        """One step of the loop: admit waiting rows, one forward for every running row."""
        with self.lock:
            self.scheduler.step()

    def grow_ahead(self) -> bool:
        """For a loop with idle time (the server's): grow the workspace before a growing conversation needs it."""
        return self.scheduler.grow_ahead()

    # ---- storing ahead of requests ------------------------------------------------------------------
    def warm(self, text: str | None = None, position_offset: int = 0, *, messages: Messages | None = None,
             cache_salt: str | None = None) -> WarmResult:
        """Compute and store the K/V of a prefix (system prompt, few-shot block, document) ahead of requests."""
        t0 = time.perf_counter()
        if position_offset != 0:
            raise InvalidRequestError("position_offset other than 0 is not supported: exact reuse stores a prefix "
                                      "from position 0", "position_offset")
        ids = self.encode(messages=messages, add_generation_prompt=False) if messages is not None else self.encode(text)
        check_prompt_length(len(ids), self.max_context)
        new, existing = self.warm_ids(ids, self.requests.tenant(cache_salt))
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
            # Longer than the device holds: run from host memory; else a free row (running rows are not disturbed).
            host = self.long_contexts.streams(len(ids) + 1)
            slot = HostSlot(self, self.long_contexts.host_workspace()) if host else self.scheduler.lease()
            try:
                return slot.warm(ids, salt, cut_ids)
            finally:
                if host:
                    slot.forget()
                else:
                    self.scheduler.release(slot)

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
        """Run requests together as rows of the loop until all are done; results keep order."""
        handles = [self.submit(r, max_batch_size) for r in requests]
        while not all(h.finished for h in handles):
            self.step()
        for h in handles:
            if h.error is not None:
                raise h.error
        return [h.result for h in handles]

    # ---- introspection ------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        fast = fast_path_stats(self.runner, self.fast_path_reason, self.cpu_linear)
        weights = self.weight_stream.as_dict() if self.weight_stream is not None else {"streamed_layers": []}
        return dict(self.kv.stats(), plan=self.plan.as_dict(), workspace_bytes=self.kv_workspace.nbytes, fast_path=fast,
                    weights=weights, streamed=self.long_contexts.as_dict(),
                    speculative=speculation_stats(self.config, self.spec_counts, self.spec_costs))

    def clear_cache(self) -> None:
        """Forget every stored chunk and what the workspace rows hold resident."""
        with self.lock:
            self.kv.clear()
            self.kv_workspace.forget_residents()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until chunks written behind to the disk / Redis tiers have landed (bounded; False on timeout).
        Not needed for correctness: a chunk still queued is served from the queue, and exit flushes."""
        return self.kv.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush (bounded) and release the disk and Redis tiers: call it when done with the engine (process exit
        flushes on its own)."""
        return self.kv.close(timeout_s)

    def forget_workspace(self) -> None:
        """Make the next request load its reuse from the store instead of what a workspace row holds resident."""
        with self.lock:
            self.kv_workspace.forget_residents()

    def verify_correctness(self, prompts: Sequence[str] | None = None, max_new_tokens: int = 32, *,
                           approximate: bool = False):
        """Exact reuse vs baseline, token for token; approximate: reuse elsewhere, by first-token agreement and KL."""
        from .verify import verify_correctness

        return verify_correctness(self, prompts, max_new_tokens, approximate=approximate)


__all__ = ["InferenceEngine", "TextStream", "GenerationMode"]
