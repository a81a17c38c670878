"""Every engine option, grouped by concern (cache, tiers, execution, speculation), validated once.

`EngineConfig(**options)` takes the flat keyword names `KVBoost(...)` accepts; `config.chunk_size` reads through to its
group. Each group checks its own values; combinations are refused in one table, RULES (with the model's and device's
facts when the engine is built, without them for a config alone).
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

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
class CacheOptions:
    chunk_size: int = 128
    # >0: cuts slide up to this many tokens to a word/sentence boundary (chunking.py).
    chunk_boundary_window: int = 0
    # Reuse at another position (RAG): stored chunks found later in a prompt are re-positioned and repaired.
    # Approximate by nature, so off by default: generate() then gives output identical to plain generation.
    content_reuse: bool = False
    recompute_strategy: RecomputeStrategy | str = RecomputeStrategy.SELECTIVE
    recompute_ratio: float = 0.15
    recompute_overlap: int = 16
    sink_tokens: int = 0  # content is never placed before this position
    cache_salt: str | None = None  # default tenant (requests and warm()); a request's own cache_salt overrides it
    write_back: bool = True  # store new full chunks (prompt + output) after each request
    # The dtype of the workspace and stored chunks: "auto", "model", "bfloat16", "float16", "float32" (kv/dtype.py).
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        from .kv.dtype import KV_DTYPES

        self.recompute_strategy = RecomputeStrategy.parse(self.recompute_strategy)
        _option(self, "chunk_size", _is_int(self.chunk_size) and 8 <= self.chunk_size <= 8192, "an int in [8, 8192]")
        _int_option(self, "chunk_boundary_window", 0, "an int >= 0")
        _option(self, "content_reuse", isinstance(self.content_reuse, bool), "a bool")
        _option(self, "recompute_ratio", 0.0 <= float(self.recompute_ratio) <= 1.0, "in [0, 1]")
        _option(self, "recompute_overlap", self.recompute_overlap >= 0, ">= 0")
        _option(self, "sink_tokens", self.sink_tokens >= 0, ">= 0")
        _option(self, "cache_salt", self.cache_salt is None or isinstance(self.cache_salt, str), "a string or None")
        _option(self, "write_back", isinstance(self.write_back, bool), "a bool")
        _option(self, "kv_dtype", self.kv_dtype in KV_DTYPES, f"one of {', '.join(KV_DTYPES)}")


@dataclass
class TierOptions:
    memory_budget_bytes: int | None = None  # None: default_memory_budget(); on a GPU the host tier's
    max_chunks: int | None = None  # entry cap for the memory tier; bytes decide when None
    # Stored chunks kept on the model's device: over this budget the coldest move to host memory, which holds
    # memory_budget_bytes of them (page-locked on CUDA), and come back on a hit, instead of being dropped
    # (store/host.py). None: on CUDA 30% of the device memory free at load; elsewhere no host tier (the device is
    # host memory: one tier of memory_budget_bytes). Set on a CPU, it builds the host tier in RAM.
    device_kv_budget_bytes: int | None = None
    kv_cache_bits: int = 16  # 8 / 4: stored chunks quantized (KIVI), in memory and in the slow tiers
    disk_cache_dir: str | None = None
    disk_budget_bytes: int | None = None
    redis_url: str | None = None
    redis_ttl_s: int | None = 24 * 3600
    # Disk and Redis are written behind, off the request path, through a queue of at most this many bytes
    # (a write that does not fit is dropped and counted); flush()/close() wait at most flush_timeout_s.
    write_queue_bytes: int = 256 * 1024**2
    flush_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        from .store.quant import KV_CACHE_BITS  # (owners imported when a config is made: `import kvboost` stays light)

        if self.memory_budget_bytes is None:
            self.memory_budget_bytes = default_memory_budget()
        _int_option(self, "memory_budget_bytes", 0, "a non-negative int")
        _int_option(self, "max_chunks", 1, "a positive int or None", optional=True)
        _int_option(self, "device_kv_budget_bytes", 0, "a non-negative int or None", optional=True)
        _option(self, "kv_cache_bits", self.kv_cache_bits in KV_CACHE_BITS,
                f"one of {', '.join(map(str, KV_CACHE_BITS))}")
        _int_option(self, "write_queue_bytes", 1, "a positive int")
        _option(self, "flush_timeout_s", self.flush_timeout_s > 0, "> 0")


@dataclass
class ExecutionOptions:
    device: str | None = None
    # The engine's own forwards: "auto", "model", "sdpa" or "triton" (model/forward.py: resolve_attention).
    attention_backend: str = "auto"
    # Short forwards (decode steps, suffixes up to 256 tokens) as fixed-shape steps: "auto", "graphs" (CUDA graphs),
    # "compiled" (torch.compile, CPU), "eager", "off" (model/fast_path.py: make_runner).
    fast_path: str = "auto"
    # Linear layers over a few rows as W @ x^T, which CPU BLAS threads: "auto", "on", "off" (model/cpu_linear.py).
    cpu_linear: str = "auto"
    max_batch_size: int = 16  # the most requests the loop runs together; more wait their turn
    # Rows of a batch that share a long stored prefix attend to one copy of its K/V (cascade attention); on a CPU a
    # lone row attends to a long reuse the same way, a stored one read where it lies.
    shared_prefix_attention: bool = True
    # The longest sequence whose K/V the device holds: a longer one keeps its K/V in host memory and each forward
    # brings it to the device one layer at a time (the first device_kv_max_tokens positions stay on the device).
    # None: elsewhere than CUDA no limit; on CUDA none while the stored chunks' budget and two sequences of the
    # model's longest context fit in 60% of the device memory free at load, else what 15% of it holds.
    device_kv_max_tokens: int | None = None
    # Device bytes for the model's weights: decoder layers that do not fit stream from host memory, a layer at a time
    # (model/weight_stream.py). None: the whole model on the device. fast_path="graphs" captures decode steps over
    # fixed slots; "auto" keeps streamed weights on the eager path.
    weight_budget_bytes: int | None = None
    # With weight_budget_bytes: device slots for streamed layers, so copies run up to depth - 1 layers ahead of the
    # forward. None: 2 (double buffering); fewer when the budget cannot hold that many.
    weight_prefetch_depth: int | None = None

    def __post_init__(self) -> None:
        from .model.cpu_linear import CPU_LINEAR_MODES
        from .model.forward import ATTENTION_BACKENDS
        from .model.runner import FAST_PATHS

        for name, modes in (("attention_backend", ATTENTION_BACKENDS), ("fast_path", FAST_PATHS),
                            ("cpu_linear", CPU_LINEAR_MODES)):
            _option(self, name, getattr(self, name) in modes, f"one of {', '.join(modes)}")
        _int_option(self, "max_batch_size", 1, "an int >= 1")
        _option(self, "shared_prefix_attention", isinstance(self.shared_prefix_attention, bool), "a bool")
        _int_option(self, "device_kv_max_tokens", 1, "a positive int or None", optional=True)
        _int_option(self, "weight_budget_bytes", 1, "a positive int or None", optional=True)
        _int_option(self, "weight_prefetch_depth", 1, "a positive int or None", optional=True)


@dataclass
class SpeculativeOptions:
    # "prompt_lookup" (n-gram drafts from prompt + output), "draft" (the engine's draft_model=), or None/"off".
    # Requests may override it. Greedy output is identical.
    speculative: str | None = None
    num_speculative_tokens: int = 8  # the most drafts verified per forward (adapted to acceptance below it)
    prompt_lookup_max_ngram: int = 3
    # None ("auto"): 1 where a 2-token verify measures about a plain step, else 2 (decoding.speculative).
    prompt_lookup_min_ngram: int | None = None

    def __post_init__(self) -> None:
        from .decoding.speculative import check_speculative_numbers, parse_method

        self.speculative = parse_method(self.speculative)
        check_speculative_numbers(self.num_speculative_tokens, self.prompt_lookup_max_ngram,
                                  self.prompt_lookup_min_ngram)


GROUPS: dict[str, type] = {"cache": CacheOptions, "tiers": TierOptions, "execution": ExecutionOptions,
                           "speculation": SpeculativeOptions}
OWNER = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}  # option -> its group

# Options of removed designs: accepted (with one warning per process and name) and ignored.
DEPRECATED = {
    "paged_kv": "the engine has one KV design, the contiguous workspace (docs/architecture.md); stored chunks spill "
                "to host memory with device_kv_budget_bytes and long contexts stream with device_kv_max_tokens "
                "without it",
    "kv_block_size": "there are no KV blocks: chunks are the unit of reuse (chunk_size)",
    "paged_attention": "there are no block tables: every request runs over a workspace row",
}
_warned: set[str] = set()


@dataclass(frozen=True)
class Environment:
    """The model's and device's facts the rules read (each None: nothing against it)."""

    device: str  # device type: "cpu", "cuda", ...
    attention_unsupported: str | None  # why KVBoost's attention cannot run this model's layers
    triton_unavailable: str | None  # why the Triton kernels cannot run here
    static_unsupported: str | None  # why the model cannot run over a static cache (fixed-shape steps)
    cpu_linear_unsupported: str | None  # why W @ x^T does not apply
    has_draft_model: bool = False
    quantized: str | None = None  # the quantized layers' format (model/int4), None for float weights
    quantized_elsewhere: str | None = None  # why the quantized layers' kernel layout is not this device's
    dtype: str | None = None  # the model's compute dtype ("float32", ...)


@dataclass(frozen=True)
class Rule:
    """A combination that cannot run: `check` returns why (None: fine). needs_environment: only checked once the
    model and device are known."""

    options: tuple[str, ...]
    check: Callable[[EngineConfig, Environment | None], str | None]
    needs_environment: bool = False


def _fast_path(config: EngineConfig, env: Environment | None) -> str | None:
    choice = config.fast_path
    if choice in ("auto", "off"):
        return None
    if env.static_unsupported is not None:
        return f"fast_path={choice!r}: {env.static_unsupported}"
    if choice == "graphs" and env.device != "cuda":
        return f"fast_path='graphs' needs a CUDA device, the model is on {env.device}"
    if choice == "graphs" and (config.attention_backend not in ("auto", "triton") or env.triton_unavailable):
        why = env.triton_unavailable or f"the engine attends with {config.attention_backend!r}"
        return ("fast_path='graphs' needs attention_backend='triton' (the kernels read each row's valid length from "
                f"device memory); {why}")
    if choice == "compiled" and env.device != "cpu":
        return f"fast_path='compiled' is the CPU path; on {env.device} use 'graphs' (or 'auto')"
    if choice == "compiled" and env.quantized:
        return (f"fast_path='compiled' compiles float weights; this model's layers are {env.quantized} "
                "(use 'auto' or 'off')")
    return None


def _attention(config: EngineConfig, env: Environment | None) -> str | None:
    choice = config.attention_backend
    if choice in ("sdpa", "triton") and env.attention_unsupported is not None:
        return f"attention_backend={choice!r}: {env.attention_unsupported}"
    if choice == "triton" and env.device != "cuda":  # the CPU interpreter is for tests, never for serving
        return f"attention_backend='triton' needs a CUDA device, the model is on {env.device}"
    if choice == "triton" and env.triton_unavailable is not None:
        return f"attention_backend='triton' is not available here: {env.triton_unavailable}"
    return None


def _weight_streaming(config: EngineConfig, env: Environment | None) -> str | None:
    if config.weight_prefetch_depth is not None and config.weight_budget_bytes is None:
        return "weight_prefetch_depth applies to streamed weights: it needs weight_budget_bytes"
    if config.weight_budget_bytes is not None and config.fast_path in ("compiled", "eager"):
        return (f"fast_path={config.fast_path!r} with weight_budget_bytes: streamed weights run the eager path or "
                "CUDA graphs over fixed slots (use 'auto', 'graphs' or 'off')")
    return None


def _kv_dtype(config: EngineConfig, env: Environment | None) -> str | None:
    choice, backend = config.kv_dtype, config.attention_backend
    if choice in ("auto", "model", env.dtype):
        return None
    if backend == "model":
        why = "attention_backend='model'"
    elif env.attention_unsupported:
        why = env.attention_unsupported
    elif backend == "auto" and env.device not in ("cuda", "cpu"):
        why = f"auto on {env.device}"
    else:
        return None
    return (f"kv_dtype={choice!r} needs KVBoost's attention, which reads K/V narrower than the model ({env.dtype}); "
            f"here the model's own attention runs: {why}")


RULES: tuple[Rule, ...] = (
    Rule(("device",), lambda c, e: e.quantized_elsewhere, needs_environment=True),
    Rule(("chunk_boundary_window", "chunk_size"), lambda c, e: None if c.chunk_boundary_window < c.chunk_size // 2
         else f"chunk_boundary_window must be in [0, chunk_size/2), got {c.chunk_boundary_window}"),
    Rule(("attention_backend",), _attention, needs_environment=True),
    Rule(("fast_path", "attention_backend"), _fast_path, needs_environment=True),
    Rule(("weight_budget_bytes", "weight_prefetch_depth", "fast_path"), _weight_streaming),
    Rule(("kv_dtype", "attention_backend"), _kv_dtype, needs_environment=True),
    Rule(("cpu_linear",), lambda c, e: f"cpu_linear='on': {e.cpu_linear_unsupported}"
         if c.cpu_linear == "on" and e.cpu_linear_unsupported else None, needs_environment=True),
    Rule(("speculative",), lambda c, e: "speculative='draft' needs draft_model= (a path, hub id or loaded model "
         "sharing the tokenizer)" if c.speculative == "draft" and not e.has_draft_model else None,
         needs_environment=True),
)


class EngineConfig:
    """All options, by group (config.cache, .tiers, .execution, .speculation); flat names read through."""

    cache: CacheOptions
    tiers: TierOptions
    execution: ExecutionOptions
    speculation: SpeculativeOptions

    def __init__(self, **options) -> None:
        unknown = sorted(set(options) - set(OWNER))
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(OWNER))}")
        for group, cls in GROUPS.items():
            object.__setattr__(self, group, cls(**{k: v for k, v in options.items() if OWNER[k] == group}))
        self.check()

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """The keyword API: deprecated names warned once and ignored, the rest validated."""
        for name in sorted(set(kwargs) & set(DEPRECATED)):
            value = kwargs.pop(name)
            if name not in _warned:
                _warned.add(name)
                warnings.warn(f"{name}={value!r} is deprecated and ignored: {DEPRECATED[name]}", FutureWarning,
                              stacklevel=3)
        return cls(**kwargs)

    def __getattr__(self, name: str):
        group = OWNER.get(name)
        if group is None:
            raise AttributeError(f"EngineConfig has no option {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    def __setattr__(self, name: str, value) -> None:
        if name not in OWNER:
            raise AttributeError(f"EngineConfig has no option {name!r}")
        setattr(getattr(self, OWNER[name]), name, value)

    def check(self, env: Environment | None = None) -> None:
        """ValueError for the first combination in RULES that cannot run (with env: the model's and device's too)."""
        for rule in RULES:
            if rule.needs_environment and env is None:
                continue
            why = rule.check(self, env)
            if why is not None:
                raise ValueError(why)

    def as_dict(self) -> dict[str, dict]:
        """The options by group, as given and defaulted."""
        return {group: {k: (v.value if isinstance(v, RecomputeStrategy) else v)
                        for k, v in asdict(getattr(self, group)).items()} for group in GROUPS}

    def __repr__(self) -> str:
        return f"EngineConfig({self.as_dict()!r})"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _option(options: object, name: str, ok: bool, what: str) -> None:
    """ValueError "<name> must be <what>, got <value>" unless ok."""
    if not ok:
        raise ValueError(f"{name} must be {what}, got {getattr(options, name)!r}")


def _int_option(options: object, name: str, least: int, what: str, optional: bool = False) -> None:
    """An int >= least (optional: or None)."""
    value = getattr(options, name)
    _option(options, name, (optional and value is None) or (_is_int(value) and value >= least), what)
