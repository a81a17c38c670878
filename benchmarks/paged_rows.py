"""Paged KV's rows of the prefix benchmarks (`kvboost bench prefix --paged`, `kvboost bench gpu`), each TTFT over
the floor of its own cached tokens, timed interleaved with the benchmark's own rows (PagedRows: one request of each
row per repeat, so drift of the machine cancels out of the ratios between rows):

  placed an engine with paged_kv=True and the default paged_attention ("workspace"), its workspace forgotten before
         each request: the stored blocks are placed (copied) into the workspace, then the suffix runs there
  table  an engine with paged_kv=True, paged_attention="table": the stored blocks are attended where they are
  host   the same over a device budget of one byte: every stored chunk waits in host memory (the host pool) and is
         copied back, one copy per block, on the hit (moving them out happens before the clock starts)

An engine that cannot be built or a request that fails is recorded in the row ("<name>_error"), never fatal: a
GPU run must come back with every other row.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .prefix import SuffixFloor

PAGED_ROWS = ("placed", "table", "host")


def _kv_bytes_per_token(engine) -> int:
    size = torch.empty((), dtype=engine.kv_dtype).element_size()
    return sum(s.kv_heads * (s.head_dim_k + s.head_dim_v) for s in engine.workspace.shapes) * size


def paged_engines(engine, max_tokens: int) -> tuple[dict, dict[str, str]]:
    """The PAGED_ROWS engines around `engine`'s model, with room for max_tokens of stored prefix:
    ({name: engine}, {name: why it could not be built}). Each takes `engine`'s fast path: on a GPU the table rows'
    short forwards replay CUDA graphs over the block table (model/table_runner.py), as a user's engine would."""
    stored = int(_kv_bytes_per_token(engine) * max_tokens * 1.25) + (64 << 20)
    options = {"placed": dict(memory_budget_bytes=0, device_kv_budget_bytes=stored, paged_attention="workspace"),
               "table": dict(memory_budget_bytes=0, device_kv_budget_bytes=stored, paged_attention="table"),
               "host": dict(memory_budget_bytes=stored, device_kv_budget_bytes=1, paged_attention="table")}
    built, errors = {}, {}
    for name, extra in options.items():
        try:
            built[name] = type(engine)(engine.model, engine.tokenizer, chunk_size=engine.config.chunk_size,
                                       attention_backend=engine.config.attention_backend, paged_kv=True,
                                       fast_path=engine.config.fast_path, write_back=engine.config.write_back,
                                       **extra)
        except Exception as exc:  # recorded: a GPU run must come back with every other row
            errors[name] = f"{type(exc).__name__}: {exc}"
    return built, errors


class PagedRows:
    """The paged rows at one prefix length, timed interleaved with the caller's own rows (one request of each per
    repeat: time(), then into()), so that drift of the machine between rows cancels out of their ratios."""

    def __init__(self, engines: dict, prefix: str, first_ids: list[int]):
        """Store `prefix` in every engine and run first_ids once, untimed (first-call allocations)."""
        self.engines, self.errors = {}, {}
        self.ms: dict[str, list[float]] = {}
        self.over: dict[str, list[float]] = {}
        self.over_reference: dict[str, list[float]] = {}
        self.restored: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        for name, paged in engines.items():
            try:
                paged.clear_cache()
                paged.warm(prefix)
                paged.generate(input_ids=first_ids, max_new_tokens=1)
                self.restored[name] = _restored(paged)
                self.engines[name] = paged
                self.ms[name], self.over[name], self.over_reference[name] = [], [], []
            except Exception as exc:  # recorded: a GPU run must come back with every other row
                self.errors[name] = f"{type(exc).__name__}: {exc}"

    def time(self, ids: list[int], floor: SuffixFloor, reference_over_floor: float | None = None) -> None:
        """One timed request of `ids` in every engine, each over the floor of its own cached tokens, and that
        over `reference_over_floor` (the caller's resident row on the same ids, over its floor)."""
        for name, paged in list(self.engines.items()):
            try:
                # Chunks over the device budget move to the host when the previous request let go of them;
                # trimming here again (a no-op then) makes sure the row times the copy back alone.
                paged.kv.blocks.cache.trim()
                paged.forget_workspace()  # "placed": from the blocks, not a prefix left resident
                res = paged.generate(input_ids=ids, max_new_tokens=1)
                floor_ms, _ = floor.ttft_ms(ids, res.cached_tokens)
                self.ms[name].append(res.ttft_ms)
                self.over[name].append(res.ttft_ms / floor_ms)
                if reference_over_floor:
                    self.over_reference[name].append(res.ttft_ms / floor_ms / reference_over_floor)
                self.cached[name] = res.cached_tokens  # of the last timed request
            except Exception as exc:
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                del self.engines[name]

    def into(self, row: dict) -> None:
        """row["<name>_ms"], row["<name>_over_floor"] (medians), chunks restored from the host during the timed
        requests, the last request's cached tokens, the table runner's step counts and whether host blocks are
        pinned; row["<name>_error"] for a row that failed."""
        for name, paged in self.engines.items():
            row[f"{name}_ms"], row[f"{name}_over_floor"] = _median(self.ms[name]), _median(self.over[name])
            if self.over_reference[name]:
                row[f"{name}_over_resident"] = _median(self.over_reference[name])
            row[f"{name}_restored_from_host"] = _restored(paged) - self.restored[name]
            if name in self.cached:
                row[f"{name}_cached_tokens"] = self.cached[name]
            stats = paged.cache_stats()
            if "table" in stats["fast_path"]:  # whether the table's steps replayed graphs (and why not)
                row[f"{name}_table_steps"] = stats["fast_path"]["table"]
            if stats["paged_kv"]["host"]:  # unpinned host blocks copy synchronously: say which ran
                row[f"{name}_host_pinned"] = stats["paged_kv"]["host"]["pinned"]
        for name, error in self.errors.items():
            row[f"{name}_error"] = error


def _restored(engine) -> int:
    host = engine.cache_stats()["paged_kv"]["host"]
    return host["restored"] if host else 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
