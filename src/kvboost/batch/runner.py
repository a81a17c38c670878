"""Continuous batching: rows join at any step and leave when done; decode steps run batched.

Each row owns one batch slot of a KVWorkspace; its K/V sits at buffer columns equal to its token
positions, so RoPE positions stay natural and no row ever has gaps. A decode step writes every
row's new token at that row's own column and attends over the longest row's length, with a 2D
padding mask keeping each row to its own columns.

Every row goes through the engine's KV-cache manager exactly as a single request does (lookup -> place ->
prefill -> decode -> write_back -> record -> Request.result). A row whose plan places content found at
another position (content_reuse) is prefilled by the engine's own single-request path (placement and
repair over the engine workspace, identical to generate()) and its K/V then copied into its slot; from
there it decodes with the batch.

Shared prefix (cascade.py): when every row of the batch starts with the same stored chunk-aligned prefix
of P tokens, its K/V is loaded once into a SharedPrefix ([1, kv_heads, P, d] per layer) and rows hold
only positions [P, length) in their slots: the workspace's first column is position P (KVWorkspace.base),
so the prefix is neither copied into rows nor allocated for them. Attention reads the prefix once per
step for all rows. A row that arrives without that prefix shrinks it to what all rows still share: the
dropped part, prefix[P':P], is copied into every active row's positions [P', P) after the workspace is
rebased to P' (exact; P' may be 0, which is the plain per-row layout). The prefix never grows while rows
are active and is dropped when the batch empties. Models where this cannot be exact (sliding windows,
softcapping...) keep the per-row path.

Speculation (prompt lookup, speculative= on the request or the engine): a row alone verifies its drafts as
generate() does - one forward of its token and up to k drafts over its slot, kept or rolled back by its length.
Beside other rows, a step verifies every row's drafts at once: a ragged step of q tokens per row (each row's token,
then its own drafts, padded to q), under a mask that keeps each query to its own row's columns up to itself. Each
row keeps what its sampler accepts and its length moves by that; padding and rejected drafts leave K/V past the
length, which the next step overwrites. The width q is the batch's (drafting.py: the expected tokens emitted per
second, from every row's acceptance and this runner's measured step costs), so a batch whose drafts do not pay
decodes plainly. Draft-model and seeded sampled speculative requests run apart (rows.runs_apart).
"""
from __future__ import annotations

import threading
import time

import torch
from transformers.cache_utils import Cache

from ..compat import has_sliding_layers
from ..decoding.factory import make_proposer
from ..decoding.speculative import MAX_SPECULATIVE_TOKENS, StepCosts
from ..decoding.speculator import Speculator
from ..errors import InvalidRequestError
from ..kv.manager import Plan
from ..kv.workspace import KVWorkspace
from ..model.cache_arg import cache_kwargs
from ..model.forward import attention_context
from ..model.runner import BATCH_BUCKETS, ModelRunner
from ..request import Request
from ..results import GenerationMode
from ..sampling import SamplingParams, sample_rows
from .cascade import cascade_forward, unsupported_reason
from .drafting import BatchDrafting, RowDrafts
from .prefix import PrefixedRows, SharedPrefix, find_common_chunk_prefix
from .rows import Row, RunsApart, SequenceHandle, runs_apart
from .slot_layer import SlotLayer

# With a runner (CUDA graphs), rows share a prefix through cascade attention only from this length on: a
# shorter one is copied per row so that decode steps replay as graphs. At 1k shared tokens x 16 rows of a 3B
# model the copies add ~0.2 ms of reads per step to ~2 ms of weights, while a graph removes ~30 ms of launches.
CASCADE_MIN_TOKENS = 2048


class BatchRunner:
    def __init__(self, engine, max_batch_size: int = 16, shared_prefix_attention: bool | None = None):
        """shared_prefix_attention: None follows engine.config.shared_prefix_attention (default on); models
        for which it cannot be exact keep the per-row path, and `shared_prefix_off_reason` says why."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if shared_prefix_attention is None:
            shared_prefix_attention = engine.config.shared_prefix_attention
        if not isinstance(shared_prefix_attention, bool):
            raise TypeError(f"shared_prefix_attention must be a bool or None, got {shared_prefix_attention!r}")
        self.engine = engine
        self.kv = engine.kv
        reason = unsupported_reason(engine.model) if shared_prefix_attention else "disabled"
        self.shared_prefix_attention = reason is None
        self.shared_prefix_off_reason = reason
        self.prefix: SharedPrefix | None = None  # the batch's shared prefix K/V, when there is one
        # Ragged rows share one query offset in the mask; a sliding window computed from it would be wrong
        # for the shorter rows, so models with sliding-window layers decode one row at a time.
        self.max_batch_size = 1 if has_sliding_layers(engine.model) else max_batch_size
        shapes = engine.workspace.shapes
        # Where the engine has a runner (CUDA graphs on a GPU), decode steps run through one over this batch's
        # workspace, whose rows are rounded up to a batch bucket so that every row count has a step.
        rows = max_batch_size
        if engine.runner is not None:  # (compiled steps take 2 rows or more: a lone row runs beside a free slot)
            rows = next((b for b in BATCH_BUCKETS if b >= max(max_batch_size, engine.runner.least_rows)),
                        max_batch_size)
        self.ws = KVWorkspace(shapes, engine.kv_dtype, engine.device, batch_size=rows,
                              max_positions=engine.max_context)
        self.steps: ModelRunner | None = None
        if engine.runner is not None:
            # One verify bucket: a row alone verifies its drafts through it (k + 1 <= 16 tokens).
            self.steps = ModelRunner(engine.model, self.ws, mode=engine.runner.mode, backend=engine.runner.backend,
                                     buckets=(MAX_SPECULATIVE_TOKENS + 1,), verifies=engine.runner.verifies,
                                     fallback_on_failure=engine.runner.fallback_on_failure,
                                     reports_to=engine.runner)
        # What a plain step and a verify cost here, per method, for the rows' AdaptiveK (this runner's steps are
        # not the engine's single-request ones, so they are measured apart).
        self.spec_costs: dict[str, StepCosts] = {}
        # Beside other rows, prompt-lookup rows verify their drafts in ragged steps (drafting.py), which need a 4D
        # mask: None where the attention in use takes none (flash attention through the model's own).
        self.drafting = BatchDrafting()
        self.ragged_mask = ragged_mask_kind(engine)
        self._pending: list[Row] = []
        self._active: list[Row] = []  # _active[i].slot == i
        self._lock = threading.Lock()

    # ---- public ---------------------------------------------------------------------------------
    def add(self, request: Request | list[int], params: SamplingParams | None = None, prompt_text: str | None = None,
            cache_salt: str | None = None, mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
            t_start: float | None = None, content_reuse: bool | None = None) -> SequenceHandle:
        """Queue a Request (built by engine.make_request); token ids plus options are accepted as a shorthand."""
        if not isinstance(request, Request):
            request = self.engine.make_request(request, params if params is not None else SamplingParams(),
                                               prompt_text, mode=mode, cache_salt=cache_salt,
                                               content_reuse=content_reuse, t_start=t_start)
        else:
            request.check_context(self.engine.max_context)
        apart = runs_apart(self.engine, request)
        if apart is not None:
            raise InvalidRequestError(f"{apart.reason}: run it with generate()/generate_stream() (engine.run_batch "
                                      "and a batching server run it on its own)", apart.param)
        handle = SequenceHandle(request.prompt_text, len(request.ids))
        row = Row(handle, request, request.sampler(self.engine.device),
                   request.tracker(self.engine.tokenizer, self.engine.eos_token_ids))
        with self._lock:
            self._pending.append(row)
        return handle

    def runs_apart(self, request: Request) -> RunsApart | None:
        """Why add() would refuse this request as a row (None: it takes it); see the module's runs_apart."""
        return runs_apart(self.engine, request)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._pending or self._active)

    def active_count(self) -> int:
        return len(self._active)

    def kv_bytes(self) -> dict[str, int]:
        """K/V bytes live now: `shared` (the prefix, once), `rows` (each row's own columns), and `allocated`
        (the workspace buffers: every slot's columns from the prefix's end to the capacity, used or not)."""
        per_token = sum(s.kv_heads * (s.head_dim_k + s.head_dim_v) for s in self.ws.shapes) * self.ws.dtype.itemsize
        p = self.prefix.length if self.prefix is not None else 0
        return {"shared": self.prefix.nbytes if self.prefix is not None else 0,
                "rows": sum(r.length - p for r in self._active) * per_token, "allocated": self.ws.nbytes}

    def step(self) -> None:
        with self.engine.lock, torch.inference_mode():
            self._drop_cancelled()
            if not self._active and self.steps is not None and self.max_batch_size > 1:
                self.steps.prepare_batched_verify()  # compiled before any step is timed (a scratch step: no rows)
            self._admit()
            if self._active:
                self._decode()
            if not self._active:
                self.prefix = None

    # ---- admission: prefill new rows -------------------------------------------------------------
    def _admit(self) -> None:
        with self._lock:
            room = self.max_batch_size - len(self._active)
            waiting = list(self._pending)
            new, self._pending = self._pending[:room], self._pending[room:]
        if not new:
            return
        self._compute_shared_prefixes(waiting)
        self._share_prefix(new)
        need = max([r.length for r in self._active] + [len(r.ids) + r.tracker.max_new_tokens for r in new])
        self.ws.ensure_capacity(need, keep=max([r.length for r in self._active], default=0))
        for row in new:
            row.slot = len(self._active)
            try:
                self._prefill(row)
            except Exception as exc:  # one bad row must not take the batch down
                self._fail(row, exc)
                continue
            self._active.append(row)
            if row.request.speculative is not None:
                row.spec = self._speculator(row)
            self._after_sample(row)

    def _compute_shared_prefixes(self, rows: list[Row]) -> None:
        """A prefix that several new rows share but the store lacks is computed once, not once per row."""
        engine = self.engine
        size = engine.config.chunk_size
        groups: dict[tuple, list[Row]] = {}
        for r in rows:
            if r.mode is not GenerationMode.BASELINE and len(r.ids) > size:
                groups.setdefault((r.salt, tuple(r.ids[:size])), []).append(r)
        for group in groups.values():
            if len(group) >= 2:
                common = find_common_chunk_prefix([r.ids for r in group], size, engine.chunker)
                if common:
                    # Cut as part of the full prompt, so the stored chunks are the ones its rows look up (with a
                    # boundary window, ids[:common] alone could be cut differently near its end).
                    engine.warm_ids(group[0].ids[:common], group[0].salt, cut_ids=group[0].ids)

    # ---- the shared prefix ----------------------------------------------------------------------
    def _share_prefix(self, new: list[Row]) -> None:
        """Make self.prefix the longest stored chunk-aligned prefix that every active and new row shares."""
        if not self._active:
            self.prefix = None
        target = self._shared_length(new)
        if self.prefix is not None and target < self.prefix.length:
            self._shrink_prefix(target)
        if self.prefix is None and target > 0:
            self.prefix = self._load_prefix(new[0], target)
        # Rows hold positions from the prefix's end on; below it they read the prefix.
        self.ws.rebase(self.prefix.length if self.prefix is not None else 0,
                       keep=max([r.length for r in self._active], default=0))

    def _shared_length(self, new: list[Row]) -> int:
        if not self.shared_prefix_attention:
            return 0
        rows = self._active + new
        if any(r.mode is GenerationMode.BASELINE for r in rows) or len({r.salt for r in rows}) != 1:
            return 0
        # ids[:-1]: every row keeps at least its last prompt token after the prefix for its own prefill.
        # With a boundary window, n is a cut of every row (its cuts below len - 1 are cuts of its full ids too),
        # which _prefill relies on: it looks up the row's chunks from the first one starting at n.
        n = find_common_chunk_prefix([r.ids[:-1] for r in rows], self.engine.config.chunk_size, self.engine.chunker)
        if self.steps is not None and n < CASCADE_MIN_TOKENS:
            return 0  # rows copy a short prefix, so their decode steps run through the runner (graphs)
        # Never grows while rows rely on it (their columns below a larger P were never written).
        return min(n, self.prefix.length) if self.prefix is not None else n

    def _load_prefix(self, row: Row, target: int) -> SharedPrefix | None:
        """Assemble prefix K/V from the store, once for the whole batch (None if the store lacks it)."""
        # The row's own chunks (cut as in its full ids: split(ids[:target]) could cut its last chunks elsewhere
        # under a boundary window), whole chunks only, so n is a cut of every row too.
        plan = self.kv.lookup(row.ids, row.salt, GenerationMode.PREFIX_CACHE)
        n = min(target, plan.reuse_len)
        return SharedPrefix.from_segments(row.ids[:n], row.salt, plan.segments, self.engine.device) if n else None

    def _shrink_prefix(self, n: int) -> None:
        """Keep the first n prefix tokens shared; every active row gets its own copy of the rest."""
        prefix = self.prefix
        assert prefix is not None
        self.ws.rebase(n, keep=max([r.length for r in self._active], default=0))
        dropped_k = [k[0, :, n:] for k in prefix.keys]
        dropped_v = [v[0, :, n:] for v in prefix.values]
        for row in self._active:
            self.ws.write(dropped_k, dropped_v, n, row=row.slot)
        self.prefix = prefix.truncated(n)

    def _forward(self, cache: Cache, keep: int = 1, **inputs) -> torch.Tensor:
        model = self.engine.model
        # The shared prefix needs cascade attention; otherwise rows use the engine's attention (resolve_attention).
        if self.prefix is not None:
            ctx = cascade_forward(model, cache)
        else:
            ctx = attention_context(model, self.engine.attention)
        with ctx:
            return model(**cache_kwargs(cache), use_cache=True, logits_to_keep=keep, **inputs).logits

    # ---- prefill ---------------------------------------------------------------------------------
    def _prefill(self, row: Row) -> None:
        request, shared = row.request, self.prefix.length if self.prefix is not None else 0
        # Chunks inside the shared prefix need no lookup: their K/V is already in self.prefix.
        plan = self.kv.lookup(request.ids, request.salt, request.mode, request.approximate, skip_before=shared)
        if plan.has_content:
            plan, logits = self._prefill_with_content(row, shared)
        else:
            self.kv.place(plan, self.ws, request.ids, row=row.slot)
            slots = slice(row.slot, row.slot + 1)
            cache = Cache(layers=[SlotLayer(self.ws, i, slots, plan.reuse_len, plan.reuse_len, self.prefix)
                                  for i in range(len(self.ws.shapes))])
            ids = torch.tensor([request.ids[plan.reuse_len:]], device=self.engine.device)
            logits = self._forward(cache, input_ids=ids)[0, -1]
        row.plan = plan
        row.length = len(request.ids)
        row.next_token = row.sampler(logits.float())
        row.ttft_ms = (time.perf_counter() - request.t_start) * 1e3

    def _prefill_with_content(self, row: Row, shared: int) -> tuple[Plan, torch.Tensor]:
        """Content placed at new positions is repaired layer by layer over one contiguous row: the engine's
        single-request prefill does exactly what generate() does; the row's own positions are copied over."""
        pre = self.engine.prefill(row.request)
        keys, values = self.engine.workspace.read(shared, len(row.request.ids))
        self.ws.write(keys, values, shared, row=row.slot)
        return pre.plan, pre.logits

    # ---- decode: one token for every active row --------------------------------------------------
    def _decode(self) -> None:
        rows = self._active
        n = len(rows)
        if n == 1 and rows[0].spec is not None:
            return self._speculate(rows[0])
        speculating = n > 1 and self.ragged_mask is not None and any(r.spec is not None for r in rows)
        proposals = self._proposals(rows) if speculating and self.drafting.proposing(n) else None
        if proposals is not None:
            room = self.engine.max_context - max(r.length for r in rows)
            width = self.drafting.width(proposals, room)
            if width > 1:
                return self._verify_rows(rows, proposals, width, room)
        t0 = time.perf_counter()
        if n == 1:  # alone: the row's own forward, without the padding mask a ragged batch needs (as generate())
            logits = self._forward_alone([rows[0].next_token], rows[0].length)
        elif self.prefix is None and self.steps is not None and self.steps.fits_batch(n):
            logits = self.steps.decode_batch([r.next_token for r in rows], [r.length for r in rows])
        else:
            lengths = torch.tensor([r.length for r in rows], device=self.engine.device)
            past = int(lengths.max())
            self.ws.ensure_capacity(past + 1, keep=past)
            mask = torch.arange(past + 1, device=lengths.device)[None, :] <= lengths[:, None]
            cache = Cache(layers=[SlotLayer(self.ws, i, slice(0, n), lengths, past, self.prefix)
                                  for i in range(len(self.ws.shapes))])
            ids = torch.tensor([[r.next_token] for r in rows], device=self.engine.device)
            logits = self._forward(cache, input_ids=ids, attention_mask=mask, position_ids=lengths[:, None])[:, -1]
        for row, token in zip(rows, sample_rows([r.sampler for r in rows], logits)):
            row.length += 1
            row.next_token = token
            if row.spec is not None:
                row.spec.proposer.extend([token])
        if speculating:  # the tokens reached the host: the step is done
            self.drafting.timed_plain(n, time.perf_counter() - t0)
        for row in list(rows):
            self._after_sample(row)

    def _after_sample(self, row: Row) -> None:
        row.emit([row.next_token])
        if row.tracker.finished:
            self._finish(row)

    # ---- speculation alone: the step is the row's own, as in generate() ---------------------------------------
    # Its AdaptiveK weighs drafts against this runner's measured lone plain step (spec_costs).
    def _speculator(self, row: Row) -> Speculator:
        params = row.request.speculative
        assert params is not None
        costs = self.spec_costs.setdefault(params.method, StepCosts())
        proposer = make_proposer(self.engine, row.request, row.ids + [row.next_token], costs)
        # The forward is a bound method, not a closure over the row: a row -> speculator -> row cycle would keep the
        # row's plan, and with it the holds on its blocks, alive until the garbage collector ran.
        spec = Speculator(proposer, row.sampler, params, self._forward_alone, costs)
        self.drafting.prior(spec.adaptive)
        return spec

    def _speculate(self, row: Row) -> None:
        assert row.spec is not None
        drafted, kept = row.spec.counts.draft_tokens, row.spec.counts.accepted_tokens
        out = row.spec.step(row.next_token, row.length, row.tracker.max_new_tokens - len(row.tracker.tokens))
        self.drafting.observed(row.spec.counts.draft_tokens - drafted, row.spec.counts.accepted_tokens - kept)
        row.length += len(out)  # the fed token and the kept drafts; rejected drafts' K/V lies past it
        row.next_token = out[-1]
        row.emit(out)
        if row.tracker.finished:
            self._finish(row)

    def _forward_alone(self, tokens: list[int], start: int) -> torch.Tensor:
        """float32 logits [n, vocab] of `tokens` run at positions [start, start + n) of the batch's only row (slot 0)
        after the K/V of its [0, start): a verify, or without drafts the row's plain step."""
        assert len(self._active) == 1 and self._active[0].slot == 0
        n = len(tokens)
        if self.steps is not None and self.steps.fits_batch(1) and self.steps.fits(n):
            return self.steps.verify(tokens, start) if n > 1 else self.steps.decode_batch(tokens, [start])
        self.ws.ensure_capacity(start + n, keep=start)
        cache = Cache(layers=[SlotLayer(self.ws, i, slice(0, 1), start, start, self.prefix)
                              for i in range(len(self.ws.shapes))])
        ids = torch.tensor([tokens], device=self.engine.device)
        return self._forward(cache, keep=n, input_ids=ids)[0].float()

    # ---- speculation beside other rows: ragged verify steps ---------------------------------------------------
    def _proposals(self, rows: list[Row]) -> list[RowDrafts]:
        """Each row's drafts for a ragged verify (rows without speculation propose none)."""
        proposals = []
        for row in rows:
            if row.spec is None:
                proposals.append(RowDrafts([]))
                continue
            budget = row.tracker.max_new_tokens - len(row.tracker.tokens)  # this step's own token included
            proposals.append(RowDrafts(row.spec.drafts(min(row.spec.params.num_tokens, budget - 1)),
                                       row.spec.adaptive))
        return proposals

    def _verify_rows(self, rows: list[Row], proposals: list[RowDrafts], width: int, room: int) -> None:
        """One forward of `width` tokens per row: each row's token, then its drafts (cut to width - 1), padded with
        its token; each speculating row keeps what its sampler accepts, the others sample their first position.
        Padding and rejected drafts leave K/V past the row's length, which its next step overwrites. With a runner
        (CUDA graphs) the step is its fixed-shape batched verify, the width rounded up to one of its widths (the
        extra positions carry more drafts where rows have them: they cost nothing more there), or cut to the widest
        step there is for that many rows."""
        t0 = time.perf_counter()
        lengths = [r.length for r in rows]
        steps = self.steps if self.prefix is None else None
        fixed = steps.verify_width(len(rows), width) if steps is not None else None
        if fixed is not None and fixed <= room:
            width = fixed
        else:
            steps = None
        drafts = [p.drafts[:width - 1] for p in proposals]
        tokens = [[r.next_token, *d, *[r.next_token] * (width - 1 - len(d))] for r, d in zip(rows, drafts)]
        if steps is not None:
            logits = steps.verify_batch(tokens, lengths)  # [n, width, vocab]
        else:
            logits = self._forward_ragged(tokens, lengths)
        plain = [i for i, r in enumerate(rows) if r.spec is None]
        picks = dict(zip(plain, sample_rows([rows[i].sampler for i in plain], logits[plain, 0]))) if plain else {}
        outs = [[picks[i]] if row.spec is None else row.spec.accept(logits[i, :len(d) + 1], d, batched=True)
                for i, (row, d) in enumerate(zip(rows, drafts))]
        for d, out in zip(drafts, outs):
            self.drafting.observed(len(d), len(out) - 1)
        kept_whole = any(d and len(out) == len(d) + 1 for d, out in zip(drafts, outs))
        self.drafting.timed_verify(len(rows), width, time.perf_counter() - t0, kept_whole)
        for row, out in zip(rows, outs):  # every length first: a row leaving moves the last row's columns up to it
            row.length += len(out)
            row.next_token = out[-1]
        for row, out in list(zip(rows, outs)):
            row.emit(out)
            if row.tracker.finished:
                self._finish(row)

    def _forward_ragged(self, tokens: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """float32 logits [rows, q, vocab] of tokens[i] (q each) run at positions [lengths[i], lengths[i] + q) of
        row i, each query over its own row's columns up to itself."""
        device = self.engine.device
        n, q = len(tokens), len(tokens[0])
        past = max(lengths)
        self.ws.ensure_capacity(past + q, keep=past)
        starts = torch.tensor(lengths, device=device)
        positions = starts[:, None] + torch.arange(q, device=device)  # [rows, q]
        first = self.prefix.length if self.prefix is not None else 0  # key columns hold positions [first, past + q)
        columns = torch.arange(first, past + q, device=device)
        mask = (columns[None, None, :] <= positions[:, :, None])[:, None]  # [rows, 1, q, keys]: may attend
        if self.ragged_mask == "additive" and self.prefix is None:  # the model's own eager attention adds it
            dtype = next(self.engine.model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
        cache = Cache(layers=[SlotLayer(self.ws, i, slice(0, n), starts, past, self.prefix)
                              for i in range(len(self.ws.shapes))])
        ids = torch.tensor(tokens, device=device)
        return self._forward(cache, keep=q, input_ids=ids, attention_mask=mask, position_ids=positions).float()

    # ---- leaving ---------------------------------------------------------------------------------
    def _finish(self, row: Row) -> None:
        request, plan = row.request, row.plan
        assert plan is not None
        fed = (request.ids + row.tracker.tokens)[: row.length]
        if request.uses_cache and self.engine.config.write_back:
            # Only the exact part may be stored under prefix-chain keys (after placed content, every later
            # token attended to approximate K/V). The slot holds no columns below the shared prefix:
            # PrefixedRows reads those from the prefix.
            exact = fed[: plan.reuse_len] if plan.needs_repair else fed
            source = PrefixedRows(self.ws, self.prefix) if self.prefix is not None else self.ws
            self.kv.write_back(exact, request.salt, source, row=row.slot)
        self.kv.record(request.mode, len(request.ids), plan)
        spec = row.spec
        if spec is not None:
            spec.close(request.ids + row.tracker.tokens)
            self.engine.spec_counts.merge(spec.counts)
        row.handle.result = request.result(plan, row.tracker, row.ttft_ms, sampler=row.sampler,
                                           spec=spec.counts if spec is not None else None)
        self._release(row)
        row.handle.finished = True

    def _fail(self, row: Row, exc: Exception) -> None:
        row.handle.error = exc
        if row in self._active:
            self._release(row)
        row.handle.finished = True

    def _drop_cancelled(self) -> None:
        with self._lock:
            for row in [r for r in self._pending if r.handle.cancelled]:
                self._pending.remove(row)
                row.handle.finished = True
        for row in [r for r in self._active if r.handle.cancelled]:
            self._release(row)
            row.handle.finished = True

    def _release(self, row: Row) -> None:
        """Free the row's slot; the last active row moves into it so active slots stay 0..n-1 (only its own
        columns move: those below the shared prefix are not the row's). The row lets go of its plan here, and with
        it the plan's holds on stored blocks, whoever still holds the row (a caller's handle never does)."""
        row.plan, row.spec = None, None
        idx = self._active.index(row)
        last = self._active[-1]
        end = last.length - self.ws.base  # columns hold positions from the shared prefix's end on
        if last is not row:
            for i in range(len(self.ws.shapes)):
                k_buf, v_buf = self.ws.buffers(i)
                k_buf[idx, :, :end].copy_(k_buf[last.slot, :, :end])
                v_buf[idx, :, :end].copy_(v_buf[last.slot, :, :end])
            last.slot = idx
            self._active[idx] = last
        self._active.pop()


def ragged_mask_kind(engine) -> str | None:
    """The 4D mask a ragged verify hands the attention in use: "bool" (KVBoost's attention, cascade, SDPA),
    "additive" (the model's own eager attention), or None where it takes no such mask (flash attention...)."""
    if engine.attention != "model":
        return "bool"
    implementation = getattr(engine.model.config, "_attn_implementation", None)
    return {"sdpa": "bool", "eager": "additive"}.get(implementation)
