"""Paged KV's rows of the prefix benchmarks (`kvboost bench prefix --paged`, `kvboost bench gpu`), each TTFT over
the floor of its own cached tokens:

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
    ({name: engine}, {name: why it could not be built}). No fast path: a single request over a table runs eager
    (the runner's graphs would only cost capture time and memory)."""
    stored = int(_kv_bytes_per_token(engine) * max_tokens * 1.25) + (64 << 20)
    options = {"placed": dict(memory_budget_bytes=0, device_kv_budget_bytes=stored, paged_attention="workspace"),
               "table": dict(memory_budget_bytes=0, device_kv_budget_bytes=stored, paged_attention="table"),
               "host": dict(memory_budget_bytes=stored, device_kv_budget_bytes=1, paged_attention="table")}
    built, errors = {}, {}
    for name, extra in options.items():
        try:
            built[name] = type(engine)(engine.model, engine.tokenizer, chunk_size=engine.config.chunk_size,
                                       attention_backend=engine.config.attention_backend, paged_kv=True,
                                       fast_path="off", **extra)
        except Exception as exc:  # recorded: a GPU run must come back with every other row
            errors[name] = f"{type(exc).__name__}: {exc}"
    return built, errors


def measure_paged(row: dict, name: str, paged, prefix: str, prompts: list[list[int]], floor: SuffixFloor) -> None:
    """Store `prefix` in a paged engine, then TTFT of prompts[1:] (prompts[0] untimed) into row["<name>_ms"] and
    row["<name>_over_floor"] (medians; the floor over each result's own cached tokens)."""
    try:
        paged.clear_cache()
        paged.warm(prefix)
        paged.generate(input_ids=prompts[0], max_new_tokens=1)  # untimed: first-call allocations
        restored = _restored(paged)
        ms, over = [], []
        for ids in prompts[1:]:
            # Chunks over the device budget move to the host when the previous request let go of them; trimming
            # here again (a no-op then) makes sure the row times the copy back alone.
            paged.kv.blocks.cache.trim()
            paged.forget_workspace()  # "placed": from the blocks, not a prefix left resident (a no-op over tables)
            res = paged.generate(input_ids=ids, max_new_tokens=1)
            floor_ms, _ = floor.ttft_ms(ids, res.cached_tokens)
            ms.append(res.ttft_ms)
            over.append(res.ttft_ms / floor_ms)
        row[f"{name}_ms"], row[f"{name}_over_floor"] = _median(ms), _median(over)
        row[f"{name}_restored_from_host"] = _restored(paged) - restored  # chunks copied back during the timed runs
        row[f"{name}_cached_tokens"] = res.cached_tokens  # of the last timed request
    except Exception as exc:
        row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"


def _restored(engine) -> int:
    host = engine.cache_stats()["paged_kv"]["host"]
    return host["restored"] if host else 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
