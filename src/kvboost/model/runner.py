"""ModelRunner: the engine's short forwards (decode steps, chat-turn suffixes) as fixed-shape steps.

An eager forward of a large model on a GPU is launch-bound, so every forward of up to `max_tokens` tokens runs as a step
of a fixed bucket size (1 for decode, 16-256 for suffixes), padded at its end: padded tokens sit after the real ones, so
causal attention hides them, and their K/V is overwritten by the next step. Nothing in a step reads a host value, so
mode "graphs" captures each bucket as a CUDA graph, "compiled" runs the decode, rows and verify steps under
torch.compile (CPU; compiled_step.py), "package" runs only the batch-1 decode step, from an AOTInductor package
(CPU; aot_build.py), and "eager" runs the same step directly. A workspace reallocation drops the graphs; longer
prefills stay on the eager path.
"""
from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ..kv.static import set_length, set_views, static_cache
from ..kv.workspace import KVWorkspace
from .aot_build import DecodePackage, share_cores
from .attention.static import static_attention
from .attention.switch import switch_unsupported_reason
from .cache_arg import cache_kwargs
from .compiled_step import CompiledStep, StepNotCompiled
from .graphs import GraphSteps

log = logging.getLogger(__name__)


PREFILL_BUCKETS = (16, 32, 64, 128, 256)
BATCH_BUCKETS = (1, 2, 4, 8, 16)  # rows of a batched decode step (continuous batching)
VERIFY_WIDTHS = (2, 4, 8, 16)  # tokens per row of a batched verify step (each row's token and its drafts)
# Tokens in a batched verify step: each captured step keeps float32 logits [rows, width, vocab] in a graph's private
# pool.
MAX_VERIFY_STEP_TOKENS = 64
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_KIND_NAMES = {"seq": "decode", "rows": "rows", "verify": "verify", "rows_verify": "rows_verify"}
FAST_PATHS = ("auto", "graphs", "compiled", "eager", "off")
RUNNER_MODES = ("graphs", "compiled", "package", "eager")
# Compiled mode compiles the batch-1 decode step (the launch-bound one on CPU; each more bucket is another compile). A
# speculative verify (compile_verify) is compiled at the exact token count: padded to a bucket through ATen it would
# cost several decode steps.
COMPILED_STEPS = {("seq", 1)}
# ... and the batched decode step: one graph for every row count from COMPILED_MIN_ROWS.
COMPILED_MIN_ROWS = 2
# Models whose batched verify has compiled: the graph is shared by every batch runner over the model.
_BATCHED_VERIFY_READY: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# Graph mode grows the workspace in steps this large, so a growing conversation rarely recaptures.
CAPACITY_STEP = 1024
WARM_CAPACITY = 4096


def static_path_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why a model cannot run over a static cache (None: it can). The static step hands attention the whole
    workspace buffer, so every layer must be plain causal attention that KVBoost's kernels compute."""
    reason = switch_unsupported_reason(model)
    if reason is not None:
        return reason
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}: only full-attention layers run over a static cache"
    if not layer_types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit softcapping"
    rope_type = getattr(getattr(getattr(model, "model", model), "rotary_emb", None), "rope_type", None)
    if rope_type in LENGTH_DEPENDENT_ROPE:  # they read max(position_ids) on the host each forward
        return f"rope_type {rope_type!r} recomputes its frequencies from the pass length"
    return None


def bucket_for(n_tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n_tokens (1 is its own bucket: a decode step), or None if none does."""
    if n_tokens == 1:
        return 1
    return next((b for b in buckets if b >= n_tokens), None)


@dataclass
class _Step:
    """One bucket's fixed inputs and output (and its CUDA graph in graph mode).

    One sequence: ids [1, T], positions [T], ends [1], last [1], logits [vocab]. B decode rows: ids and positions [B,
    1], ends [B], last None, logits [B, vocab]. B verify rows x W: ids and positions [B, W], logits [B, W, vocab].
    """

    key: tuple  # ("seq", tokens), ("verify", tokens), ("rows", rows) or ("rows_verify", rows, width)
    ids: torch.Tensor  # int64
    positions: torch.Tensor  # int64: where each token's K/V goes (and its RoPE position)
    ends: torch.Tensor  # int32: each row's valid keys after the write
    last: torch.Tensor | None
    cache: Cache
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # float32
    all_logits: bool = False  # a verify step: logits [T, vocab] of every token, not only the last
    end: int = 0  # valid keys after the step (host copy of ends[0]; the compiled decode step's view length)


class ModelRunner(GraphSteps):
    def __init__(self, model: torch.nn.Module, workspace: KVWorkspace, *, mode: str = "eager",
                 backend: str | None = None, buckets: Sequence[int] = PREFILL_BUCKETS,
                 fallback_on_failure: bool = False, packed_gemv: bool = True,
                 unpacked_reason: str | None = None, verifies: bool = False, reports_to: ModelRunner | None = None,
                 package: DecodePackage | None = None):
        """reports_to: the engine's runner, where a batch runner records the steps dynamo refuses. package: the
        decode-step package of package mode."""
        if mode not in RUNNER_MODES:
            raise ValueError(f"mode must be one of {', '.join(RUNNER_MODES)}, got {mode!r}")
        if (mode == "package") != (package is not None):
            raise ValueError("package mode runs a DecodePackage, and only it does")
        if mode == "graphs" and workspace.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the workspace is on {workspace.device}")
        self.model, self.workspace, self.mode, self.backend = model, workspace, mode, backend
        self.package = package
        self.buckets = () if package is not None else tuple(sorted(buckets))
        self.fallback_on_failure = fallback_on_failure  # a capture that fails: run eagerly (True) or raise
        self.steps: dict[tuple[str, int], _Step] = {}
        self.generation = workspace.generation
        self.stats: Counter = Counter()
        self.failure: str | None = None  # why graphs were given up (auto mode): the steps then run eagerly
        # verifies: the verify step is made ready at load; compiled mode compiles it at the exact token count.
        self.verifies = verifies
        self.compile_verify = verifies and mode == "compiled"
        # Compiled mode: torch.compile with a dynamic capacity axis and packed GEMV weights (compiled_step.py).
        self._compiled = CompiledStep(self._logits, packed=packed_gemv, unpacked_reason=unpacked_reason,
                                      owner=model) if mode == "compiled" else None
        self.uncompiled: dict[str, str] = {}  # kinds dynamo refused, and why
        self.reports_to = reports_to
        self.least_rows = COMPILED_MIN_ROWS if mode == "compiled" else 1  # the smallest batched decode step

    @property
    def decode_kernels(self) -> str | None:
        """Compiled mode: which GEMV kernels the compiled decode step runs (packed, or ATen's and why); package mode:
        the package's state."""
        if self.package is not None:
            return self.package.description
        return self._compiled.description if self._compiled is not None else None

    @property
    def compiled_steps(self) -> list[str]:
        """Compiled mode: the kinds of step that run compiled (decode, rows, verify, rows_verify)."""
        if self._compiled is None:
            return []
        kinds = ("seq", "rows", "verify", "rows_verify") if self.compile_verify else ("seq", "rows")
        return [_KIND_NAMES[k] for k in kinds if k not in self.uncompiled]

    def _runs_compiled(self, key: tuple) -> bool:
        return self.mode == "compiled" and key[0] not in self.uncompiled \
            and (key in COMPILED_STEPS or key[0] == "rows" or (self.compile_verify and "verify" in key[0]))

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1] if self.buckets else 1

    def fits(self, n_tokens: int) -> bool:
        if self.package is not None:  # a decode step, once the package is ready
            return n_tokens == 1 and self.package.step is not None
        return bucket_for(n_tokens, self.buckets) is not None

    def before_step(self) -> None:
        """Called by the thread that steps the engine: gives a package build its core (aot_build.py)."""
        share_cores()

    # ---- one step -----------------------------------------------------------------------------
    def forward(self, tokens: Sequence[int] | torch.Tensor, start: int) -> torch.Tensor:
        """Run `tokens` at positions [start, start + n) after the K/V of [0, start) in the workspace. Returns float32
        logits [vocab] of the last token, in a buffer the next call overwrites. The caller holds the engine lock, under
        torch.inference_mode()."""
        n = len(tokens)
        size = bucket_for(n, self.buckets)
        if size is None:
            raise ValueError(f"{n} tokens: more than the largest bucket ({self.max_tokens}); use the eager path")
        step = self._row_step(("seq", size), tokens, start)
        step.last.fill_(n - 1)
        return self._execute(step)

    def verify(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Like forward(), but float32 logits [n, vocab] of every token (the last sampled token and its drafts). A
        compiled verify runs the exact count, unpadded."""
        n = len(tokens)
        size = bucket_for(max(n, 2), self.buckets)  # never the 1-token decode bucket: that one keeps 1 row
        if self.compile_verify and size is not None:
            size = max(n, 2)
        if size is None:
            raise ValueError(f"{n} tokens: more than the largest bucket ({self.max_tokens})")
        return self._execute(self._row_step(("verify", size), tokens, start))[:n]

    def _row_step(self, key: tuple[str, int], tokens: Sequence[int] | torch.Tensor, start: int) -> _Step:
        """The one-row step `key`, fed `tokens` at positions [start, start + n) after [0, start) of the workspace."""
        size = key[1]
        self._ensure_capacity(start + size, keep=start)
        step = self._step(key)
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(list(tokens), dtype=torch.long)
        step.ids[0, :len(tokens)].copy_(ids.reshape(-1), non_blocking=True)
        torch.arange(start, start + size, out=step.positions)
        step.ends.fill_(start + size)
        set_length(step.cache, start)
        step.end = start + size
        return step

    def fits_batch(self, n_rows: int) -> bool:
        return self.package is None and self._batch_rows(n_rows, exact=False) is not None

    def _batch_rows(self, n_rows: int, exact: bool) -> int | None:
        """The rows a batched step of n_rows rows runs, or None: the smallest batch bucket the workspace has rows for,
        or with `exact` (a compiled step, whose one graph takes any row count) n_rows itself (at least least_rows)."""
        ws = self.workspace
        if ws.base != 0:
            return None
        if exact:
            rows = max(n_rows, self.least_rows)
            return rows if rows <= ws.batch_size else None
        return next((b for b in BATCH_BUCKETS if n_rows <= b <= ws.batch_size), None)

    def decode_batch(self, tokens: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """One decode step for rows 0..n-1: row i feeds tokens[i] at position lengths[i]. Returns float32 logits [n,
        vocab], overwritten by the next call; rows past n up to the bucket compute throwaway tokens at position 0."""
        rows = self._batch_rows(len(tokens), exact=self.mode == "compiled")
        if rows is None:
            raise ValueError(f"{len(tokens)} rows do not fit a batch bucket of this workspace; use the eager path")
        return self._rows_step(("rows", rows), [[token] for token in tokens], lengths)

    def verify_width(self, n_rows: int, width: int) -> int | None:
        """The width to verify `width` tokens per row of n_rows rows at: the smallest step width holding them, else the
        widest there is; None where the rows fit no batch bucket."""
        rows = self._batch_rows(n_rows, exact=self.compile_verify)
        if rows is None:
            return None
        widths = [w for w in (range(2, VERIFY_WIDTHS[-1] + 1) if self.compile_verify else VERIFY_WIDTHS)
                  if rows * w <= MAX_VERIFY_STEP_TOKENS]
        return next((w for w in widths if w >= width), widths[-1] if widths else None)

    def verify_batch(self, tokens: Sequence[Sequence[int]], lengths: Sequence[int]) -> torch.Tensor:
        """One verify step for rows 0..n-1: row i feeds tokens[i] (W tokens, the same W for every row) at positions
        [lengths[i], lengths[i] + W). Returns float32 logits [n, W, vocab], overwritten by the next call; rows past n up
        to the bucket compute throwaway tokens."""
        n, width = len(tokens), len(tokens[0])
        rows = self._batch_rows(n, exact=self.compile_verify)
        if rows is None or self.verify_width(n, width) != width or any(len(t) != width for t in tokens):
            raise ValueError(f"{n} rows x {width} tokens do not fit a batched verify step of this workspace")
        return self._rows_step(("rows_verify", rows, width), tokens, lengths)

    def _rows_step(self, key: tuple, tokens: Sequence[Sequence[int]], lengths: Sequence[int]) -> torch.Tensor:
        """Run the batched step `key` (key[1] rows): row i feeds tokens[i] at [lengths[i], lengths[i] + W); rows past
        n compute throwaway tokens at [0, W)."""
        n, width, pad = len(tokens), len(tokens[0]), key[1] - len(tokens)
        self._ensure_capacity(max(lengths) + width, keep=max(lengths))
        step = self._step(key)
        ids = [list(t) for t in tokens] + [[0] * width] * pad
        step.ids.copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        starts = torch.tensor(list(lengths) + [0] * pad, dtype=torch.long)
        step.positions.copy_(starts[:, None] + torch.arange(width), non_blocking=True)
        step.ends.copy_(step.positions[:, -1] + 1)
        set_length(step.cache, max(lengths))
        step.end = max(lengths) + width
        return self._execute(step)[:n]

    def _run(self, step: _Step) -> torch.Tensor:
        position_ids = step.positions if step.last is None else step.positions[None]  # [B, tokens]
        keep = 0 if step.all_logits else (1 if step.last is None else step.last)  # 0: every position
        compiled = self._runs_compiled(step.key)
        if compiled:
            # Compiled steps attend over views of exactly the valid keys; a length of 1 would compile another graph
            # (torch specializes sizes 0 and 1), so that step runs eagerly.
            compiled = step.end >= 2
            set_views(step.cache, self.workspace, step.end if compiled else None, rows=step.ids.shape[0])
        packaged = self.package is not None and self.package.step is not None and step.end >= 2
        with static_attention(self.model):
            logits = self._packaged_logits(step) if packaged else None
            if logits is None:
                logits = self._compiled_logits(step, position_ids, keep) if compiled else \
                    self._logits(step.ids, position_ids, step.cache, step.ends, keep)  # [B, kept, vocab]
        if not step.all_logits:
            logits = logits[:, -1]  # [B, vocab]
        return logits[0] if step.last is not None else logits  # one row: [T, vocab] (verify) or [vocab]

    def _packaged_logits(self, step: _Step) -> torch.Tensor | None:
        """The batch-1 decode step from the package: logits [1, 1, vocab]; None where it failed (then for good, said in
        the package's failure: the eager step rewrites the token's K/V)."""
        assert self.package is not None and self.package.step is not None
        buffers = [self.workspace.buffers(i) for i in range(len(self.workspace.shapes))]
        try:
            return self.package.step(step.ids, step.positions, step.end, [k[:1] for k, _ in buffers],
                                     [v[:1] for _, v in buffers])
        except Exception as exc:
            self.package.fail(f"the decode-step package failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            self.stats["package_failures"] += 1
            return None

    def _compiled_logits(self, step: _Step, position_ids: torch.Tensor, keep: int) -> torch.Tensor:
        """The step's compiled forward; a kind of step dynamo refuses (StepNotCompiled) runs eagerly from then on,
        counted in stats and said in `failure`."""
        assert self._compiled is not None
        ends = step.ends if step.key[0].startswith("rows") else None  # rows of different lengths: masked to their
        # ends (and each row's verified tokens causal among themselves: the ends align them bottom-right)
        try:
            return self._compiled(step.ids, position_ids, step.cache, ends, keep)
        except StepNotCompiled as exc:
            failure = f"{_KIND_NAMES[step.key[0]]} steps run eagerly: {exc}"
            for runner in (self, self.reports_to) if self.reports_to is not None else (self,):
                runner.uncompiled[step.key[0]] = str(exc)
                runner.stats["compile_refusals"] += 1
                runner.failure = failure
            log.warning("kvboost: %s", failure)
            # the eager step reads the whole buffer, masked by ends
            set_views(step.cache, self.workspace, None, rows=step.ids.shape[0])
            return self._logits(step.ids, position_ids, step.cache, step.ends, keep)

    def _logits(self, ids: torch.Tensor, position_ids: torch.Tensor, cache: Cache, ends: torch.Tensor | None,
                keep: int | torch.Tensor) -> torch.Tensor:
        """ends None: the cache's views hold exactly the valid keys (the compiled decode and verify steps)."""
        out = self.model(input_ids=ids, position_ids=position_ids, **cache_kwargs(cache), use_cache=True,
                         logits_to_keep=keep, kvboost_ends=ends, kvboost_exact_views=ends is None,
                         kvboost_backend=self.backend)
        return out.logits.float()

    def _device(self) -> torch.device:
        return self.workspace.device

    def _forget_graphs(self) -> None:
        self.steps.clear()

    # ---- buffers ------------------------------------------------------------------------------
    def _ensure_capacity(self, needed: int, keep: int) -> None:
        ws = self.workspace
        if needed > ws.capacity:
            step = 1 if self.mode in ("eager", "package") else CAPACITY_STEP
            ws.ensure_capacity(-(-needed // step) * step, keep=keep)

    def _step(self, key: tuple[str, int]) -> _Step:
        if self.workspace.generation != self.generation:  # new buffers: every graph points at the old ones
            if self.steps:
                self.stats["invalidations"] += 1
                if self.mode == "graphs":
                    torch.cuda.synchronize(self.workspace.device)  # no replay may still run when they go
            self.steps.clear()
            self.generation = self.workspace.generation
        step = self.steps.get(key)
        if step is None:
            kind, device = key[0], self.workspace.device
            one_row = kind in ("seq", "verify")  # one row of key[1] tokens; else key[1] rows of 1 or key[2] tokens
            rows, width = (1, key[1]) if one_row else (key[1], key[2] if kind == "rows_verify" else 1)
            positions = torch.zeros(*((width,) if one_row else (rows, width)), dtype=torch.long, device=device)
            step = _Step(key, torch.zeros(rows, width, dtype=torch.long, device=device), positions,
                         torch.zeros(rows, dtype=torch.int32, device=device),
                         torch.zeros(1, dtype=torch.long, device=device) if one_row else None,
                         static_cache(self.workspace, positions, rows=rows), all_logits="verify" in kind)
            if self.mode == "compiled":  # one graph for every capacity, not one per workspace size
                for layer in step.cache.layers:
                    torch._dynamo.mark_dynamic(layer.keys, 2)
                    torch._dynamo.mark_dynamic(layer.values, 2)
            if self._runs_compiled(key):  # ... for every row count (batched steps) and token count (verify steps)
                row_axes = [(step.ids, 0), (step.positions, 0), (step.ends, 0)] if kind.startswith("rows") else []
                token_axes = [(step.ids, 1), (step.positions, positions.dim() - 1)] if "verify" in kind else []
                for tensor, dim in row_axes + token_axes:
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
            self.steps[key] = step
        return step

    def prepare_batched_verify(self) -> None:
        """Compiled mode, speculating engine: compile the batched verify now on a scratch 2 x 2 step, so no timed row
        step pays the compile. The workspace holds no rows yet. Once per model."""
        if not self._runs_compiled(("rows_verify", 2, 2)) or self.model in _BATCHED_VERIFY_READY:
            return
        self.workspace.ensure_rows(2)
        if self._batch_rows(2, exact=True) is None:
            return
        self.verify_batch([[0, 0], [0, 0]], [0, 0])
        for resident in self.workspace.residents[:2]:  # their first positions now hold the scratch step's K/V
            resident.clear()
        _BATCHED_VERIFY_READY.add(self.model)

    def warm_up(self, capacity: int = WARM_CAPACITY) -> int:
        """Size the workspace and run every bucket now, so the first request meets no capture or compile. Writes scratch
        K/V at the first positions (the caller forgets the resident prefix). Returns buckets run."""
        ws = self.workspace
        if self.mode != "graphs":  # nothing is captured per buffer address: no need to size it ahead
            capacity = min(capacity, CAPACITY_STEP)
        cap = capacity if ws.max_positions is None else min(capacity, ws.max_positions)
        self._ensure_capacity(max(cap, self.max_tokens), keep=0)
        for size in (1, *self.buckets):
            self.forward([0] * size, 1 if size == 1 else 0)  # decode after one position, as every real one is
        if self.verifies:  # one verify (compiled: the dynamic graph; graphs: the
            self.verify([0] * 2, 1)  # smallest bucket, holding the most drafts)
        if ws.device.type == "cuda":
            torch.cuda.synchronize(ws.device)
        return 1 + len(self.buckets) + int(self.verifies)
