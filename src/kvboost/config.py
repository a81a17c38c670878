"""Every engine knob in one validated dataclass."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields

from .results import RecomputeStrategy

_GIB = 1024**3


def default_memory_budget() -> int:
    """A quarter of physical memory, capped at 4 GiB: a hot system prompt fits, the host keeps breathing."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * _GIB
    return int(min(4 * _GIB, max(256 * 1024**2, total // 4)))


@dataclass
class EngineConfig:
    chunk_size: int = 128
    max_chunks: int | None = None  # entry cap for the memory tier; bytes decide when None
    memory_budget_bytes: int | None = None  # None: default_memory_budget()
    recompute_overlap: int = 16
    # Reuse at another position (RAG): stored chunks found later in a prompt are re-positioned and repaired.
    # Approximate by nature, so off by default: generate() then gives output identical to plain generation.
    content_reuse: bool = False
    recompute_strategy: RecomputeStrategy | str = RecomputeStrategy.SELECTIVE
    recompute_ratio: float = 0.15
    kv_cache_bits: int = 16
    disk_cache_dir: str | None = None
    disk_budget_bytes: int | None = None
    redis_url: str | None = None
    redis_ttl_s: int | None = 24 * 3600
    # Disk and Redis are written behind, off the request path, through a queue of at most this many bytes
    # (a write that does not fit is dropped and counted); flush()/close() wait at most flush_timeout_s.
    write_queue_bytes: int = 256 * 1024**2
    flush_timeout_s: float = 10.0
    cache_salt: str | None = None  # default tenant (requests and warm()); a request's own cache_salt overrides it
    chunk_boundary_window: int = 0
    sink_tokens: int = 0
    device: str | None = None
    write_back: bool = True  # store new full chunks (prompt + output) after each generate
    # Batched rows that share a stored prefix attend to one copy of its K/V (cascade attention) instead of
    # each holding its own; off: every row copies the prefix into its slot.
    shared_prefix_attention: bool = True
    # The most requests the engine's loop runs together (rows of one step); more wait their turn.
    max_batch_size: int = 16
    # The engine's own forwards: "auto" (the Triton kernels on CUDA where they run, else torch SDPA without cuDNN;
    # the model's own attention elsewhere),
    # "model", "sdpa", or "triton" (KVBoost's kernels; CUDA + triton). See model.forward.resolve_attention.
    attention_backend: str = "auto"
    # Linear layers over 2-4 token rows (verifies, batched decode steps; 1-9 at 2+ threads) as W @ x^T,
    # which CPU BLAS threads: "auto" (float32 on a CPU with MKL), "on" (refused where it does not apply), "off"
    # (the model's own products, bit for bit). Installed on the model's nn.Linear modules, so every forward path
    # rounds alike. See model.cpu_linear.
    cpu_linear: str = "auto"
    # Short forwards (decode steps, suffixes up to 256 tokens) over a static cache in fixed-size buckets:
    # "auto" (CUDA graphs on CUDA with the Triton attention, off elsewhere), "graphs", "eager" (the static
    # step without capture, any device), "off" (the ordinary eager forward). See model.runner.
    fast_path: str = "auto"
    # Stored chunks kept on the model's device: over this budget the coldest move to host memory, which holds
    # memory_budget_bytes of them (page-locked on CUDA), and come back on a hit, instead of being dropped
    # (store/host.py). None: on CUDA 30% of the device memory free at load; elsewhere no host tier (the device is
    # host memory: one tier of memory_budget_bytes). Set on a CPU, it builds the host tier in RAM.
    device_kv_budget_bytes: int | None = None
    # The longest sequence whose K/V the device holds: a longer one keeps its K/V in host memory and each forward
    # brings it to the device one layer at a time (the first device_kv_max_tokens positions stay on the device): it
    # runs, identically, instead of running out of device memory. None: elsewhere than CUDA no limit; on CUDA none
    # while the stored chunks' budget and two sequences of the model's longest context fit in 60% of the device
    # memory free at load, else what 15% of it holds. Exact reuse only for such a sequence.
    device_kv_max_tokens: int | None = None
    # Speculative decoding (decoding/): "prompt_lookup" (n-gram drafts from prompt + output), "draft" (a draft
    # model: the engine's draft_model=), or None/"off". Requests may override it. Greedy output is identical.
    speculative: str | None = None
    num_speculative_tokens: int = 8  # the most drafts verified per forward (adapted to acceptance below it)
    prompt_lookup_max_ngram: int = 3
    # None ("auto"): 1 where a 2-token verify measures about a plain step (GPU; CPU with cpu_linear), else 2 - a
    # lone recurring token is worth a verify only when verifies are cheap (decoding.speculative.lookup_min_ngram).
    prompt_lookup_min_ngram: int | None = None

    def __post_init__(self) -> None:
        self.recompute_strategy = RecomputeStrategy.parse(self.recompute_strategy)
        _require(self.cache_salt is None or isinstance(self.cache_salt, str),
                 f"cache_salt must be a string or None, got {self.cache_salt!r}")
        _require(isinstance(self.content_reuse, bool), f"content_reuse must be a bool, got {self.content_reuse!r}")
        _require(isinstance(self.chunk_size, int) and 8 <= self.chunk_size <= 8192,
                 f"chunk_size must be an int in [8, 8192], got {self.chunk_size!r}")
        _require(self.max_chunks is None or (isinstance(self.max_chunks, int) and self.max_chunks > 0),
                 f"max_chunks must be a positive int or None, got {self.max_chunks!r}")
        if self.memory_budget_bytes is None:
            self.memory_budget_bytes = default_memory_budget()
        _require(isinstance(self.memory_budget_bytes, int) and self.memory_budget_bytes >= 0,
                 f"memory_budget_bytes must be a non-negative int, got {self.memory_budget_bytes!r}")
        _require(self.recompute_overlap >= 0, f"recompute_overlap must be >= 0, got {self.recompute_overlap}")
        _require(0.0 <= float(self.recompute_ratio) <= 1.0,
                 f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        _require(self.kv_cache_bits in (4, 8, 16), f"kv_cache_bits must be 16, 8 or 4, got {self.kv_cache_bits!r}")
        _require(self.chunk_boundary_window >= 0 and self.chunk_boundary_window < self.chunk_size // 2,
                 f"chunk_boundary_window must be in [0, chunk_size/2), got {self.chunk_boundary_window}")
        _require(isinstance(self.write_queue_bytes, int) and self.write_queue_bytes > 0,
                 f"write_queue_bytes must be a positive int, got {self.write_queue_bytes!r}")
        _require(self.flush_timeout_s > 0, f"flush_timeout_s must be > 0, got {self.flush_timeout_s!r}")
        _require(self.sink_tokens >= 0, f"sink_tokens must be >= 0, got {self.sink_tokens}")
        _require(self.attention_backend in ("auto", "model", "sdpa", "triton"),
                 f"attention_backend must be auto, model, sdpa or triton, got {self.attention_backend!r}")
        _require(self.cpu_linear in ("auto", "on", "off"),
                 f"cpu_linear must be auto, on or off, got {self.cpu_linear!r}")
        _require(self.fast_path in ("auto", "graphs", "compiled", "eager", "off"),
                 f"fast_path must be auto, graphs, compiled, eager or off, got {self.fast_path!r}")
        from .decoding.speculative import check_speculative_numbers, parse_method

        self.speculative = parse_method(self.speculative)
        check_speculative_numbers(self.num_speculative_tokens, self.prompt_lookup_max_ngram,
                                  self.prompt_lookup_min_ngram)
        _require(isinstance(self.max_batch_size, int) and not isinstance(self.max_batch_size, bool)
                 and self.max_batch_size >= 1, f"max_batch_size must be an int >= 1, got {self.max_batch_size!r}")
        _require(isinstance(self.shared_prefix_attention, bool),
                 f"shared_prefix_attention must be a bool, got {self.shared_prefix_attention!r}")
        _require(self.device_kv_budget_bytes is None or (
            isinstance(self.device_kv_budget_bytes, int) and self.device_kv_budget_bytes >= 0),
                 f"device_kv_budget_bytes must be a non-negative int or None, got {self.device_kv_budget_bytes!r}")
        _require(self.device_kv_max_tokens is None or (
            isinstance(self.device_kv_max_tokens, int) and not isinstance(self.device_kv_max_tokens, bool)
            and self.device_kv_max_tokens > 0),
                 f"device_kv_max_tokens must be a positive int or None, got {self.device_kv_max_tokens!r}")
    # Stored chunks kept on the model's device: over this budget the coldest move to host memory, which holds
    # memory_budget_bytes of them (page-locked on CUDA), and come back on a hit, instead of being dropped
    # (store/host.py). None: on CUDA 30% of the device memory free at load; elsewhere no host tier (the device is
    # host memory: one tier of memory_budget_bytes). Set on a CPU, it builds the host tier in RAM.

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        for name in sorted(set(kwargs) & set(DEPRECATED)):
            value = kwargs.pop(name)
            if name not in _warned:
                _warned.add(name)
                warnings.warn(f"{name}={value!r} is deprecated and ignored: {DEPRECATED[name]}", FutureWarning,
                              stacklevel=3)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


# Options of removed designs: accepted (with one warning per process and name) and ignored.
DEPRECATED = {
    "paged_kv": "the engine has one KV design, the contiguous workspace (docs/architecture.md); stored chunks spill "
                "to host memory with device_kv_budget_bytes and long contexts stream with device_kv_max_tokens "
                "without it",
    "kv_block_size": "there are no KV blocks: chunks are the unit of reuse (chunk_size)",
    "paged_attention": "there are no block tables: every request runs over a workspace row",
}
_warned: set[str] = set()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
