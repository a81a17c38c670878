"""Scheduler: every request is a row of one step loop (continuous batching).

add(request) queues a row from any thread; step() admits waiting rows (prefill), runs one forward for every row, then
samples, emits and finishes. Each row owns a slot of the engine's KV workspace (slot.py); a lone row runs through the
engine's runner, rows together through one batched forward. When all rows share a stored chunk-aligned prefix, its K/V
is loaded once (batch/cascade.py) and rows hold only positions past it; the prefix never grows while rows are active.
Speculating rows verify their drafts alone or in one ragged step (batch/speculation.py).
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from .batch.cascade import unsupported_reason
from .batch.forwards import RowForwards
from .batch.prefix import PrefixedRows, SharedPrefix, find_common_chunk_prefix
from .batch.rows import Row, SequenceHandle
from .batch.speculation import RowSpeculation
from .compat import has_sliding_layers
from .kv.host_workspace import bytes_per_position
from .kv.manager import span_prefix
from .kv.workspace import KVWorkspace
from .model.runner import BATCH_BUCKETS, ModelRunner
from .request import Request
from .results import GenerationMode
from .sampling import SamplingParams, sample_rows
from .slot import HostSlot, Prefill, Slot

log = logging.getLogger(__name__)

# With a runner, rows share a prefix through cascade attention only from this length on: a shorter one is copied per row
# so decode steps replay as graphs. On a CPU a lone row's reuse from this length on is attended as its prefix.
CASCADE_MIN_TOKENS = 2048
# On a CPU a row reads its reuse where one stored span holds it from this length on (copying it first costs more).
IN_PLACE_MIN_TOKENS = 512
# Between requests, a workspace whose resident rows fill more than this share of it grows ahead of the next request.
GROW_AHEAD = 0.75


class Scheduler:
    def __init__(self, engine, max_batch_size: int = 16, shared_prefix_attention: bool | None = None,
                 workspace: KVWorkspace | None = None, runner: ModelRunner | None = None):
        """workspace / runner: the engine's own; None builds a separate pair. shared_prefix_attention: None follows the
        engine's config; models where it cannot be exact keep per-row copies (`shared_prefix_off_reason` says why)."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if shared_prefix_attention is not None and not isinstance(shared_prefix_attention, bool):
            raise TypeError(f"shared_prefix_attention must be a bool or None, got {shared_prefix_attention!r}")
        self.engine = engine
        self.kv = engine.kv
        self._shared_choice = shared_prefix_attention  # None: the engine's config, read at each admission
        self._model_refusal = unsupported_reason(engine.model)
        # Ragged rows share one query offset in the mask, so sliding-window models decode one row at a time.
        self.max_batch_size = 1 if has_sliding_layers(engine.model) else max_batch_size
        if workspace is None:
            workspace = KVWorkspace(engine.workspace_shapes, engine.kv_dtype, engine.device,
                                    max_positions=engine.max_context)
            own = engine.runner
            if own is not None:
                runner = ModelRunner(engine.model, workspace, mode=own.mode, backend=own.backend, verifies=own.verifies,
                                     fallback_on_failure=own.fallback_on_failure, reports_to=own, package=own.package)
        self.ws, self.runner = workspace, runner
        self.forwards = RowForwards(engine, self.ws)
        self.speculation = RowSpeculation(self)
        self._pending: list[Row] = []
        self._active: list[Row] = []  # rows in the workspace: _active[i].slot == i
        self._streamed: list[Row] = []  # rows whose K/V lives in host memory (longer than the device holds)
        self._leased: set[int] = set()  # rows lent to a draft sequence or a warm (lease())
        self._lock = threading.Lock()
        self.grows_ahead = True  # off for good after a failed early growth (the request then grows as it needs)

    @property
    def shared_prefix_off_reason(self) -> str | None:
        """Why rows sharing a prefix each hold their own copy (None: they read one shared prefix)."""
        chosen = self.engine.config.shared_prefix_attention if self._shared_choice is None else self._shared_choice
        return self._model_refusal if chosen else "disabled"

    @property
    def prefix(self) -> SharedPrefix | None:
        """The batch's shared prefix K/V, when there is one."""
        return self.forwards.prefix

    @prefix.setter
    def prefix(self, prefix: SharedPrefix | None) -> None:
        self.forwards.prefix = prefix

    # ---- public -------------------------------------------------------------------------------
    def add(self, request: Request | list[int], params: SamplingParams | None = None, prompt_text: str | None = None,
            *, max_rows: int | None = None, **options) -> SequenceHandle:
        """Queue a Request (or token ids, SamplingParams and make_request's options as a shorthand). max_rows: run it
        only in steps of at most that many rows."""
        if not isinstance(request, Request):
            request = self.engine.make_request(request, params if params is not None else SamplingParams(),
                                               prompt_text, **options)
        request.check_context(self.engine.max_context)
        handle = SequenceHandle(request.prompt_text, len(request.ids))
        row = Row(handle, request, request.sampler(self.engine.device),
                  request.tracker(self.engine.tokenizer, self.engine.eos_token_ids), max_rows=max_rows)
        with self._lock:
            self._pending.append(row)
        return handle

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._pending or self._active or self._streamed)

    def active_count(self) -> int:
        return len(self._active) + len(self._streamed)

    def kv_bytes(self) -> dict[str, int]:
        """K/V bytes now: `shared` (the prefix, once), `rows` (each row's own columns), `allocated` (the workspace
        buffers)."""
        per_token = bytes_per_position(self.ws.shapes, self.ws.dtype)
        p = self.prefix.length if self.prefix is not None else 0
        return {"shared": self.prefix.nbytes if self.prefix is not None else 0,
                "rows": sum(r.length - p for r in self._active) * per_token, "allocated": self.ws.nbytes}

    def grow_ahead(self) -> bool:
        """Between requests: grow the workspace now when what its rows hold resident fills more than GROW_AHEAD of
        it, so the next turn of a growing conversation does not pay for the allocation (~0.1-0.3 s on a CPU) inside
        its time to first token. True if it grew."""
        with self.engine.lock:  # steps hold it: no row starts meanwhile
            ws = self.ws
            if not self.grows_ahead or self._pending or self._active or self._streamed or not ws.capacity:
                return False
            if ws.max_positions is not None and ws.capacity >= ws.max_positions:
                return False
            if max((len(r.ids) for r in ws.residents), default=0) <= GROW_AHEAD * ws.capacity:
                return False
            try:
                ws.ensure_capacity(ws.capacity + 1)
            except (RuntimeError, MemoryError) as exc:  # out of memory: the buffers it had are kept
                self.grows_ahead = False
                log.warning("kvboost: growing the workspace ahead of requests failed (%s); it grows when a request "
                            "needs it", exc)
                return False
            return True

    def step(self) -> None:
        """Admit waiting rows, then one forward for every active row. A step that raises fails the rows it ran (each
        handle gets the error) and re-raises; the loop stays usable."""
        with self.engine.lock, torch.inference_mode():
            if self.runner is not None:
                self.runner.before_step()
            self._drop_cancelled()
            if not self._active and len(self._pending) > 1 and self.runner is not None and self.max_batch_size > 1:
                # The batched verify compiles now, not inside a step the drafting policy times.
                self.runner.prepare_batched_verify()
            self._admit()
            try:
                for row in list(self._streamed):
                    self._step_streamed(row)
                if self._active:
                    self._decode()
            except Exception as exc:
                for row in [*self._streamed, *self._active]:
                    self._fail(row, exc)
                raise
            finally:
                if not self._active:
                    self.prefix = None

    def slot(self, index: int) -> Slot:
        return Slot(self.engine, self.ws.row(index), self.runner)

    def _own(self, row: Row) -> Slot | HostSlot:
        """Where the row's K/V lives from position 0: its host workspace, else its workspace row."""
        return row.host if row.host is not None else self.slot(row.slot)

    def lease(self) -> Slot:
        """A row no request uses, lent until release() (a draft sequence, a warm): the first row when free, else the
        next free one."""
        if self.ws.base:  # rows share a prefix now (no row holds positions from 0): a private one-row workspace
            return Slot(self.engine, self._private_workspace())
        busy = set(range(len(self._active))) | self._leased
        index = next(i for i in range(len(busy) + 1) if i not in busy)
        self.ws.ensure_rows(index + 1)
        self._leased.add(index)
        return self.slot(index)

    def _private_workspace(self) -> KVWorkspace:
        return KVWorkspace(self.ws.shapes, self.ws.dtype, self.ws.device, max_positions=self.ws.max_positions)

    def release(self, slot: Slot) -> None:
        self._leased.discard(slot.index)

    # ---- admission: prefill new rows ------------------------------------------------------------
    def _admit(self) -> None:
        with self._lock:
            room = self.max_batch_size - len(self._active) - len(self._streamed)
            waiting = list(self._pending)
            new: list[Row] = []
            for row in self._pending:
                if len(new) >= room:
                    break
                running = [*self._active, *self._streamed, *new]
                cap = min([r.max_rows for r in (*running, row) if r.max_rows is not None], default=self.max_batch_size)
                if len(running) + 1 > cap:
                    break  # in arrival order: a row that cannot join now waits, and so do the ones behind it
                new.append(row)
            self._pending = self._pending[len(new):]
        if not new:
            return
        streamed = [r for r in new if self.engine.long_contexts.streams(len(r.ids) + r.tracker.max_new_tokens)]
        for row in streamed:
            row.host = HostSlot(self.engine, self.engine.long_contexts.host_workspace())
            self._start(row, self._streamed)
        new = [r for r in new if r.host is None]
        if not new:
            return
        if self._leased & set(range(len(self._active) + len(new))):
            raise RuntimeError("a leased workspace row is in use by a draft sequence or a warm; rows cannot be "
                               "admitted over it")
        self._compute_shared_prefixes(waiting)
        self._share_prefix(new)
        self._ensure_rows(len(self._active) + len(new))
        need = max([r.length for r in self._active] + [len(r.ids) + r.tracker.max_new_tokens for r in new])
        self.ws.ensure_capacity(need, keep=max([r.length for r in self._active], default=0))
        for row in new:
            row.slot = len(self._active)
            self._start(row, self._active)

    def _start(self, row: Row, rows: list[Row]) -> None:
        """Prefill a new row, join it to `rows`, emit its first token."""
        try:
            self._prefill(row)
        except Exception as exc:  # one bad row must not take the batch down
            self._fail(row, exc)
            return
        rows.append(row)
        row.spec = self.speculation.speculator(row)
        row.emit([row.next_token])
        if row.unplaced:  # after the first token is out: the row's steps and its write-back read its slot
            self._place_unplaced(row)
        if row.tracker.finished:
            self.finish(row)

    def _ensure_rows(self, n: int) -> None:
        """Workspace rows for n active rows (a batch bucket's worth where the runner steps rows)."""
        if self.runner is not None and n > 1:
            n = next((b for b in BATCH_BUCKETS if b >= max(n, self.runner.least_rows)), n)
        self.ws.ensure_rows(n)

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
                    # Cut as part of the full prompt, so the stored chunks are the ones its rows look up.
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
        rows = self._active + new
        if self.shared_prefix_off_reason is not None or len(rows) < 2:  # a lone row keeps the runner's own steps
            return 0
        if any(r.mode is GenerationMode.BASELINE for r in rows) or len({r.salt for r in rows}) != 1:
            return 0
        # ids[:-1]: every row keeps its last prompt token for its own prefill; n is a cut of every row.
        n = find_common_chunk_prefix([r.ids[:-1] for r in rows], self.engine.config.chunk_size, self.engine.chunker)
        if self.runner is not None and n < CASCADE_MIN_TOKENS:
            return 0  # rows copy a short prefix, so their decode steps run through the runner (graphs)
        # Never grows while rows rely on it (their columns below a larger P were never written).
        return min(n, self.prefix.length) if self.prefix is not None else n

    def _load_prefix(self, row: Row, target: int) -> SharedPrefix | None:
        """Assemble prefix K/V from the store, once for the whole batch (None if the store lacks it)."""
        # The row's own chunks, cut as in its full ids, whole chunks only.
        plan = self.kv.lookup(row.ids, row.salt, GenerationMode.PREFIX_CACHE)
        n = min(target, plan.reuse_len)
        if not n:
            return None
        found = span_prefix(plan)
        if found is not None and found[1] >= n:  # one stored span holds it: its views, no copy
            return SharedPrefix.viewing(row.ids[:n], row.salt, found[0].keys, found[0].values)
        return SharedPrefix.from_segments(row.ids[:n], row.salt, plan.segments, self.engine.device)

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

    # ---- prefill ---------------------------------------------------------------------------------
    def _prefill(self, row: Row) -> None:
        request = row.request
        if row.host is not None:  # host memory
            plan, logits = row.host.prefill(request)
        elif self.prefix is None:  # the row's own slot from position 0
            plan, logits = self._prefill_own(row)
        else:
            plan, logits = self._prefill_over_prefix(row)
        row.plan = plan
        row.length = len(request.ids)
        if request.return_logits:
            row.first_logits = logits.float().clone()
        row.next_token = row.sampler(logits.float())
        row.ttft_ms = (time.perf_counter() - request.t_start) * 1e3

    def _prefill_own(self, row: Row) -> Prefill:
        """The row's prefill in its slot. On a CPU a long reuse is attended as the row's prefix (cascade attention: its
        part unmasked, every query head of a KV head in one pass: faster than one masked SDPA from CASCADE_MIN_TOKENS
        on); where it lies in one stored span from position 0 (one write-back's chunks), the span is read where it lies
        and copied into the slot only once the first token is out (_place_unplaced)."""
        request, slot = row.request, self.slot(row.slot)
        plan = slot.lookup(request)
        cascade = self.shared_prefix_off_reason is None and not plan.has_content and self.ws.device.type == "cpu"
        found = span_prefix(plan) if cascade else None
        in_place = found is not None and found[1] >= IN_PLACE_MIN_TOKENS
        if not in_place and not (cascade and plan.reuse_len >= CASCADE_MIN_TOKENS):
            return slot.prefill(request, plan)
        n = found[1] if in_place else plan.reuse_len
        slot.forget()  # until its prefix is placed the slot holds nothing trustworthy
        self.kv.place(plan, self.ws, request.ids, row=row.slot, skip_below=n if in_place else 0)
        if in_place:
            keys, values = found[0].keys, found[0].values
        else:  # the slot's own columns below the suffix
            bufs = [self.ws.buffers(i) for i in range(len(self.ws.shapes))]
            keys, values = [k[row.slot] for k, _ in bufs], [v[row.slot] for _, v in bufs]
        self.prefix = SharedPrefix.viewing(request.ids[:n], request.salt, keys, values)
        try:
            logits = self.forwards.prefill(row.slot, request.ids[plan.reuse_len:], plan.reuse_len)
        finally:
            self.prefix = None
        if in_place:
            row.unplaced = n
        else:
            slot.claim(request, plan, request.ids)
        return Prefill(plan, logits)

    def _place_unplaced(self, row: Row) -> None:
        """Copy the stored prefix the row's prefill read in place into its slot; the slot then holds the prompt."""
        assert row.plan is not None
        self.kv.place_exact(row.plan, self.ws, row.slot, stop=row.unplaced)
        row.unplaced = 0
        self.slot(row.slot).claim(row.request, row.plan, row.request.ids)

    def _prefill_over_prefix(self, row: Row) -> Prefill:
        """A row reading positions below the shared prefix from it: only its own chunks are placed."""
        request, shared = row.request, self.prefix.length
        plan = self.kv.lookup(request.ids, request.salt, request.mode, request.approximate, skip_before=shared)
        if plan.has_content:
            # Placed content is repaired over one contiguous sequence: a private one-row workspace, copied over.
            scratch = Slot(self.engine, self._private_workspace())
            pre = scratch.prefill(request)
            self.ws.write(*scratch.ws.read(shared, len(request.ids)), shared, row=row.slot)
            return pre
        self.kv.place(plan, self.ws, request.ids, row=row.slot)
        return Prefill(plan, self.forwards.prefill(row.slot, request.ids[plan.reuse_len:], plan.reuse_len))

    # ---- decode: one token (or a verify) for every active row ---------------------------------------------
    def _decode(self) -> None:
        rows = self._active
        n = len(rows)
        if n == 1 and rows[0].spec is not None:
            return self.speculation.alone(rows[0])
        if n > 1 and self.speculation.verify_together(rows):
            return
        t0 = time.perf_counter()
        if n == 1:  # alone: the row's own step, without the padding mask a batch needs (the runner's, when it has one)
            logits = self.forward_alone([rows[0].next_token], rows[0].length)
        elif self.prefix is None and self.runner is not None and self.runner.fits_batch(n):
            logits = self.runner.decode_batch([r.next_token for r in rows], [r.length for r in rows])
        else:
            logits = self.forwards.decode([r.next_token for r in rows], [r.length for r in rows])
        for row, token in zip(rows, sample_rows([r.sampler for r in rows], logits)):
            row.length += 1
            row.next_token = token
            if row.spec is not None:
                row.spec.proposer.extend([token])
        self.speculation.timed_plain(rows, t0)
        for row in list(rows):
            self.emit(row, [row.next_token])

    def _step_streamed(self, row: Row) -> None:
        """A row whose K/V lives in host memory runs its own forward (speculating alone, if it speculates)."""
        if row.spec is not None:
            return self.speculation.alone(row)
        assert row.host is not None
        logits = row.host.forward([row.next_token], row.length)
        row.length += 1
        row.next_token = row.sampler(logits)
        self.emit(row, [row.next_token])

    def forward_alone(self, tokens: list[int], start: int) -> torch.Tensor:
        """float32 logits [n, vocab] of tokens at positions [start, start + n) of the only row (slot 0): a verify, or
        the row's plain step."""
        assert len(self._active) == 1 and self._active[0].slot == 0
        if self.prefix is None:
            return self.slot(0).forward(tokens, start, all_logits=True).float()
        return self.forwards.alone(tokens, start)

    def emit(self, row: Row, tokens: list[int]) -> None:
        """Hand the row's new tokens to its caller; the row finishes once its output is complete."""
        row.emit(tokens)
        if row.tracker.finished:
            self.finish(row)

    # ---- leaving ---------------------------------------------------------------------------------
    def finish(self, row: Row) -> None:
        """The row's output is complete: store its K/V, build its result, free its slot."""
        request, plan = row.request, row.plan
        assert plan is not None
        self._store(row)
        self.kv.record(request.mode, len(request.ids), plan)
        spec = row.spec
        if spec is not None:
            spec.close(request.ids + row.tracker.tokens)
            self.engine.spec_counts.merge(spec.counts)
        row.handle.result = request.result(plan, row.tracker, row.ttft_ms, row.first_logits, sampler=row.sampler,
                                           spec=spec.counts if spec is not None else None)
        self._release(row)
        row.handle.finished = True

    def _fail(self, row: Row, exc: Exception) -> None:
        row.handle.error = exc
        if row in self._active or row in self._streamed:
            self._release(row)
        elif row.host is not None:  # failed in its prefill: its host workspace goes now, not at garbage collection
            row.host.forget()
        if row.host is None:
            self.slot(row.slot).forget()  # whatever the row wrote is not a finished request's K/V
        row.handle.finished = True

    def _store(self, row: Row) -> None:
        """Write back the K/V the row computed (prompt and the output fed so far)."""
        request, plan = row.request, row.plan
        assert plan is not None
        fed = (request.ids + row.tracker.tokens)[: row.length]
        if row.host is not None or self.prefix is None:  # a slot from position 0 keeps it resident for the next
            self._own(row).finish(request, plan, fed)
        elif request.uses_cache and self.engine.config.write_back:
            # Only the exact part may be stored under prefix-chain keys; PrefixedRows reads the columns below the
            # prefix.
            exact = fed[: plan.reuse_len] if plan.needs_repair else fed
            self.kv.write_back(exact, request.salt, PrefixedRows(self.ws, self.prefix), row=row.slot)

    def _drop_cancelled(self) -> None:
        """Cancelled rows leave: a waiting one at once, a running one after storing what it computed."""
        with self._lock:
            for row in [r for r in self._pending if r.handle.cancelled]:
                self._pending.remove(row)
                row.handle.finished = True
        for row in [r for r in (*self._streamed, *self._active) if r.handle.cancelled]:
            self._store(row)
            if row.spec is not None:
                row.spec.close(row.request.ids + row.tracker.tokens)
            self._release(row)
            row.handle.finished = True

    def _release(self, row: Row) -> None:
        """Free the row's slot; the last active row moves into it so active slots stay 0..n-1. The row lets go of its
        plan (and its holds on stored blocks) here."""
        row.plan, row.spec = None, None
        if row.host is not None:
            self._streamed.remove(row)
            row.host.forget()
            return
        idx = self._active.index(row)
        last = self._active[-1]
        end = last.length - self.ws.base  # columns hold positions from the shared prefix's end on
        if last is not row:
            for i in range(len(self.ws.shapes)):
                k_buf, v_buf = self.ws.buffers(i)
                k_buf[idx, :, :end].copy_(k_buf[last.slot, :, :end])
                v_buf[idx, :, :end].copy_(v_buf[last.slot, :, :end])
            self.slot(idx).forget()  # overwritten by the moved row, which is still running
            self.slot(last.slot).forget()
            last.slot = idx
            self._active[idx] = last
        self._active.pop()
