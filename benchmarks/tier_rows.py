"""The storage-tier rows of the prefix benchmarks (`kvboost bench prefix --host-tier`, `kvboost bench gpu`), each
TTFT over the floor of its own cached tokens, timed interleaved with the benchmark's own rows (TierRows: one request
of each row per repeat, so drift of the machine cancels out of the ratios between rows):

  host   an engine whose device keeps no stored chunk (device_kv_budget_bytes=0): every stored chunk waits in the
         host tier (page-locked on a GPU) and is placed from there into the workspace row on the hit

An engine that cannot be built or a request that fails is recorded in the row ("<name>_error"), never fatal: a
GPU run must come back with every other row.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .prefix import SuffixFloor

TIER_ROWS = ("host",)


def _kv_bytes_per_token(engine) -> int:
    size = torch.empty((), dtype=engine.kv_dtype).element_size()
    return sum(s.kv_heads * (s.head_dim_k + s.head_dim_v) for s in engine.workspace.shapes) * size


def tier_engines(engine, max_tokens: int) -> tuple[dict, dict[str, str]]:
    """The TIER_ROWS engines around `engine`'s model, with room for max_tokens of stored prefix:
    ({name: engine}, {name: why it could not be built}). Each takes `engine`'s fast path, as a user's engine would."""
    stored = int(_kv_bytes_per_token(engine) * max_tokens * 1.25) + (64 << 20)
    options = {"host": dict(memory_budget_bytes=stored, device_kv_budget_bytes=0)}
    built, errors = {}, {}
    for name, extra in options.items():
        try:
            built[name] = type(engine)(engine.model, engine.tokenizer, chunk_size=engine.config.chunk_size,
                                       attention_backend=engine.config.attention_backend,
                                       fast_path=engine.config.fast_path, write_back=engine.config.write_back,
                                       **extra)
        except Exception as exc:  # recorded: a GPU run must come back with every other row
            errors[name] = f"{type(exc).__name__}: {exc}"
    return built, errors


class TierRows:
    """The tier rows at one prefix length, timed interleaved with the caller's own rows (one request of each per
    repeat: time(), then into()), so that drift of the machine between rows cancels out of their ratios."""

    def __init__(self, engines: dict, prefix: str, first_ids: list[int]):
        """Store `prefix` in every engine and run first_ids once, untimed (first-call allocations)."""
        self.engines, self.errors = {}, {}
        self.ms: dict[str, list[float]] = {}
        self.over: dict[str, list[float]] = {}
        self.over_reference: dict[str, list[float]] = {}
        self.restored: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        for name, tiered in engines.items():
            try:
                tiered.clear_cache()
                tiered.warm(prefix)
                tiered.generate(input_ids=first_ids, max_new_tokens=1)
                self.restored[name] = _restored(tiered)
                self.engines[name] = tiered
                self.ms[name], self.over[name], self.over_reference[name] = [], [], []
            except Exception as exc:  # recorded: a GPU run must come back with every other row
                self.errors[name] = f"{type(exc).__name__}: {exc}"

    def time(self, ids: list[int], floor: SuffixFloor, reference_over_floor: float | None = None) -> None:
        """One timed request of `ids` in every engine, each over the floor of its own cached tokens, and that
        over `reference_over_floor` (the caller's resident row on the same ids, over its floor)."""
        for name, tiered in list(self.engines.items()):
            try:
                tiered.forget_workspace()  # from the tier, not a prefix left resident in the workspace
                res = tiered.generate(input_ids=ids, max_new_tokens=1)
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
        """row["<name>_ms"], row["<name>_over_floor"] (medians), host-tier hits during the timed requests, the last
        request's cached tokens and whether host memory is page-locked; row["<name>_error"] for a row that
        failed."""
        for name, tiered in self.engines.items():
            row[f"{name}_ms"], row[f"{name}_over_floor"] = _median(self.ms[name]), _median(self.over[name])
            if self.over_reference[name]:
                row[f"{name}_over_resident"] = _median(self.over_reference[name])
            row[f"{name}_restored_from_host"] = _restored(tiered) - self.restored[name]
            if name in self.cached:
                row[f"{name}_cached_tokens"] = self.cached[name]
            host = tiered.cache_stats()["tiers"].get("host")
            if host:  # pageable host memory copies synchronously: say which ran
                row[f"{name}_host_pinned"] = host.get("pinned")
        for name, error in self.errors.items():
            row[f"{name}_error"] = error


def _restored(engine) -> int:
    """Hits served by the host tier so far."""
    host = engine.cache_stats()["tiers"].get("host")
    return host["hits"] if host else 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
