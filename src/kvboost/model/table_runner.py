"""TableRunner: the runner's fixed-shape steps (runner.py) over a sequence's block table instead of the workspace.

With paged_attention="table" a stored prefix is attended where its blocks are; run eagerly, that forward is as
launch-bound on a GPU as any other (H100, Qwen2.5-3B shape, bf16: 66 ms for a 12-token suffix over 1k cached
tokens, 1.2x transformers' eager suffix, where the workspace's captured steps take 10.5 ms). A table step fixes
every shape, so that one CUDA graph per (kind, T, W) replays at any position over any table:

    ids        [1, T]      the tokens, T a bucket (1: decode; 16..256: suffixes; verify: 16..256, every row's
                           logits), padded at the end
    positions  [T]         start .. start + T - 1 (RoPE)
    rows       [Hkv * T]   pool rows the step's K/V go to (kv/paged_cache.py StaticPagedLayer): the table's own
                           blocks, and for padding past them a scratch block the runner holds
    tables     [1, W]      the table's block ids, W a power-of-two bucket (>= MIN_WIDTH), padded with the scratch
                           block
    ends       [1]         start + T: the valid length the paged kernel reads (padded queries sit after the real
                           ones, so causal attention keeps them out of every real token's view, as in runner.py)
    last       [1]         the last real token: its logits

The host fills those tensors and replays; nothing in a step reads a host value. Padding's K/V lands in the table's
own last block past its length (positions no one has written: reserve() copied a shared block on write first) or
in the scratch block, and is overwritten by later steps. Mode "eager" runs the same steps uncaptured on any device
(the tests check them against model/paged.py's forward on CPU, the Triton kernel under its interpreter included).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ..kv.block_table import BlockTable
from ..kv.blocks import BlockPool
from ..kv.paged_cache import static_paged_cache, static_pool_rows
from ..kv.static import set_length
from .attention.paged_hf import static_paged_attention
from .cache_arg import cache_kwargs
from .graphs import GraphSteps, RunnerStats
from .runner import PREFILL_BUCKETS, ModelRunner, bucket_for

TABLE_RUNNER_MODES = ("graphs", "eager")
MIN_WIDTH = 8  # table width buckets: 8, 16, 32, ... blocks (a conversation under 1k tokens uses one graph a step)
# Steps kept (each graph keeps a private memory pool for its activations: tens of MB on a 3B model at T = 256);
# past this the least recently used one is dropped and recaptured if it is needed again.
MAX_STEPS = 32


def width_bucket(blocks: int) -> int:
    return max(MIN_WIDTH, 1 << max(blocks - 1, 0).bit_length())


@dataclass
class _TableStep:
    key: tuple[str, int, int]  # (kind, tokens, width): kind "seq" (last token's logits) or "verify" (every token's)
    ids: torch.Tensor  # [1, T] int64
    positions: torch.Tensor  # [T] int64
    rows: torch.Tensor  # [Hkv * T] int64
    tables: torch.Tensor  # [1, W] int32
    ends: torch.Tensor  # [1] int32
    last: torch.Tensor  # [1] int64
    cache: Cache
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # float32: [vocab] ("seq") or [T, vocab] ("verify")


class TableRunner(GraphSteps):
    def __init__(self, model: torch.nn.Module, pool: BlockPool, *, mode: str = "eager", backend: str | None = None,
                 buckets: Sequence[int] = PREFILL_BUCKETS, fallback_on_failure: bool = False):
        if mode not in TABLE_RUNNER_MODES:
            raise ValueError(f"mode must be one of {', '.join(TABLE_RUNNER_MODES)}, got {mode!r}")
        if mode == "graphs" and pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the block pool is on {pool.device}")
        self.model, self.pool, self.mode, self.backend = model, pool, mode, backend
        self.buckets = tuple(sorted(buckets))
        self.fallback_on_failure = fallback_on_failure
        self.scratch_block = pool.allocate(1)[0]  # held for the runner's life: padding past a table lands here
        self.steps: OrderedDict[tuple[str, int, int], _TableStep] = OrderedDict()  # least recently used first
        self.stats = RunnerStats()
        self.failure: str | None = None  # why graphs were given up (auto mode): the steps then run eagerly

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1] if self.buckets else 1

    def fits(self, n_tokens: int) -> bool:
        return bucket_for(n_tokens, self.buckets) is not None

    def forward(self, tokens: Sequence[int], table: BlockTable, all_logits: bool = False) -> torch.Tensor:
        """Run `tokens` at the table's next positions [start, start + n) (start = table.length) and append them to
        it. Returns float32 logits [vocab] of the last token, or [n, vocab] of every token (all_logits and n > 1: a
        speculative verify): a buffer the next step overwrites (clone to keep). If the step raises, the table is
        cut back to start."""
        n, start = len(tokens), table.length
        if n == 0:
            raise ValueError("a step needs at least one token")
        kind = "verify" if all_logits and n > 1 else "seq"
        size = bucket_for(max(n, 2) if kind == "verify" else n, self.buckets)
        if size is None:
            raise ValueError(f"{n} tokens: more than the largest bucket ({self.max_tokens}); use the eager path")
        table.reserve(n)
        try:
            step = self._step((kind, size, width_bucket(self.pool.layout.blocks_for(start + size))))
            self._fill(step, tokens, table, start)
            logits = self._execute(step)
        except BaseException:
            table.truncate(start)
            raise
        return logits[:n] if kind == "verify" else logits

    def warm_up(self) -> int:
        """Capture the decode step and every suffix bucket at the smallest width now (over a scratch table), so
        that chat-sized requests meet no capture. Returns the number of steps run."""
        table = BlockTable(self.pool)
        try:
            for size in (1, *self.buckets):
                table.truncate(0)
                if size == 1:
                    table.reserve(1)  # decode after one position, as every real one is
                self.forward([0] * size, table)
        finally:
            table.release()
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        return 1 + len(self.buckets)

    # ---- one step -----------------------------------------------------------------------------
    def _fill(self, step: _TableStep, tokens: Sequence[int], table: BlockTable, start: int) -> None:
        n, size, width = len(tokens), step.ids.shape[1], step.tables.shape[1]
        bs, blocks = self.pool.layout.block_size, table.blocks
        own = len(blocks) * bs
        slots = [blocks[p // bs] * bs + p % bs if p < own else self.scratch_block * bs + p % bs
                 for p in range(start, start + size)]
        step.ids[0, :n].copy_(torch.tensor(list(tokens), dtype=torch.long), non_blocking=True)
        torch.arange(start, start + size, out=step.positions)
        step.rows.copy_(static_pool_rows(self.pool, torch.tensor(slots, dtype=torch.long)), non_blocking=True)
        padded = blocks + [self.scratch_block] * (width - len(blocks))
        step.tables.copy_(torch.tensor([padded], dtype=torch.int32), non_blocking=True)
        step.ends.fill_(start + size)
        step.last.fill_(n - 1)
        set_length(step.cache, start)

    def _run(self, step: _TableStep) -> torch.Tensor:
        verify = step.key[0] == "verify"
        with static_paged_attention(self.model):
            out = self.model(input_ids=step.ids, position_ids=step.positions[None], **cache_kwargs(step.cache),
                             use_cache=True, logits_to_keep=0 if verify else step.last, kvboost_tables=step.tables,
                             kvboost_ends=step.ends, kvboost_backend=self.backend)
        logits = out.logits.float()  # [1, T or 1, vocab]
        return logits[0] if verify else logits[0, -1]

    def _device(self) -> torch.device:
        return self.pool.device

    def _forget_graphs(self) -> None:
        for step in self.steps.values():
            step.graph = None

    def _step(self, key: tuple[str, int, int]) -> _TableStep:
        step = self.steps.get(key)
        if step is not None:
            self.steps.move_to_end(key)
        else:
            if len(self.steps) >= MAX_STEPS:
                _, dropped = self.steps.popitem(last=False)
                if dropped.graph is not None:
                    torch.cuda.synchronize(self.pool.device)  # no replay of it may still run when it goes
                    self.stats.counts["dropped"] += 1
            _, size, width = key
            device = self.pool.device

            def zeros(*shape: int, dtype=torch.long) -> torch.Tensor:
                return torch.zeros(*shape, dtype=dtype, device=device)

            rows = zeros(self.pool.layout.kv_heads * size)
            step = _TableStep(key, zeros(1, size), zeros(size), rows, zeros(1, width, dtype=torch.int32),
                              zeros(1, dtype=torch.int32), zeros(1), static_paged_cache(self.pool, rows))
            self.steps[key] = step
        return step


def make_table_runner(runner: ModelRunner | None, model: torch.nn.Module, pool: BlockPool) -> TableRunner | None:
    """The table runner matching the engine's runner over the workspace (same mode, kernels and fallback; None
    when there is none). fast_path="compiled" (the CPU's compiled decode over the workspace) has no table form:
    refused rather than ignored."""
    if runner is None:
        return None
    if runner.mode == "compiled":
        raise ValueError("fast_path='compiled' compiles the workspace's decode step; with paged_attention='table' "
                         "requests run over block tables: use fast_path='eager' or 'off' (or "
                         "paged_attention='workspace')")
    return TableRunner(model, pool, mode=runner.mode, backend=runner.backend,
                       fallback_on_failure=runner.fallback_on_failure)
