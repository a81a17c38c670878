"""What `kvboost bench gpu` measures and how long each part may take: full runs and `--quick` smoke runs."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

SECTIONS = ("fidelity", "chat", "prefix", "decode", "kernels")
PREFIX_LENGTHS = (1000, 4000, 16000, 30000)
# Shares of the time left after loading. Decode holds the torch.compile warm-ups (minutes on a GPU); the
# order of the run is fidelity, chat, prefix, kernels, decode, so an unused share carries over to what comes
# later. Fidelity (seconds on a GPU: small models, ~150 short generations) runs first so that a long decode
# section can never leave it without time; it builds its own models, which leave no state behind.
SHARES = {"fidelity": 0.06, "chat": 0.2, "prefix": 0.2, "kernels": 0.1, "decode": 0.5}
RUN_ORDER = ("fidelity", "chat", "prefix", "kernels", "decode")


@dataclass
class GpuBenchSettings:
    quick: bool = False
    sections: tuple[str, ...] = SECTIONS
    # fidelity: greedy tokens over a stored prefix vs HF generate, on the bench's model (bf16 and an fp32 copy) and
    # on small random llama/mistral models, each continuation also scored step by step against fp32. Per dtype
    # 24 + 2 x 36 = 96 continuations: the bench's model costs ~1 s a question on an H100 (HF generate's eager
    # steps at 36 layers), a small model ~0.3 s.
    fidelity_prefix_tokens: int = 700
    fidelity_prefixes: int = 2
    fidelity_questions: int = 36
    fidelity_new_tokens: int = 24
    fidelity_bench_questions: int = 24  # 0: the bench's own model is left out of the section
    fidelity_bench_new_tokens: int = 16
    # a. chat turns: a ~900-token system prompt, 40-token user turns, short greedy replies
    conversations: int = 4
    turns: int = 6
    system_tokens: int = 900
    user_tokens: int = 40
    reply_tokens: int = 8
    # b. prefix TTFT against the suffix-only floor
    prefix_lengths: list[int] = field(default_factory=lambda: list(PREFIX_LENGTHS))
    prefix_repeats: int = 3
    # c. decode tokens/s
    decode_prompt_tokens: int = 1000
    decode_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1, 16)
    decode_repeats: int = 2
    compile: bool = True
    compile_reason: str = ""  # why compile is off, when it is
    # whole run
    time_limit_s: float = 510.0
    # seconds for a section, instead of its share of the time left (--budgets; the shares split what the explicit
    # budgets of later sections leave)
    budgets: dict[str, float] = field(default_factory=dict)

    @classmethod
    def make(cls, *, quick: bool, device_type: str, max_prefix: int, sections: tuple[str, ...],
             compile_flag: bool | None, time_limit_s: float, prefix_lengths: list[int] | None = None,
             batch_sizes: tuple[int, ...] | None = None, budgets: dict[str, float] | None = None) -> GpuBenchSettings:
        """prefix_lengths / batch_sizes / budgets, where given, replace the defaults (and --quick's)."""
        s = cls(quick=quick, sections=sections, time_limit_s=time_limit_s, budgets=dict(budgets or {}))
        if quick:  # every code path once, at sizes that take seconds (batch 4 runs batch 16's code on a CPU)
            s.conversations, s.reply_tokens = 1, 4
            s.prefix_lengths, s.prefix_repeats = [n for n in PREFIX_LENGTHS if n <= 4000], 1
            s.decode_prompt_tokens, s.decode_tokens, s.decode_repeats = 256, 8, 1
            s.batch_sizes = (1, 16) if device_type == "cuda" else (1, 4)
            # 160 tokens: past one 128-token chunk, so a stored chunk and a resident tail are both reused
            s.fidelity_prefix_tokens, s.fidelity_questions, s.fidelity_new_tokens = 160, 2, 8
            s.fidelity_prefixes, s.fidelity_bench_questions, s.fidelity_bench_new_tokens = 1, 2, 8
        if prefix_lengths:
            s.prefix_lengths = sorted(set(prefix_lengths))
        if batch_sizes:
            s.batch_sizes = tuple(batch_sizes)
        s.prefix_lengths = [n for n in s.prefix_lengths if n <= max_prefix]
        if compile_flag is not None:
            s.compile = compile_flag
            s.compile_reason = "" if compile_flag else "off (--no-compile)"
        elif device_type != "cuda":
            s.compile = False
            s.compile_reason = "skipped on CPU: minutes to compile, needs a C++ toolchain (--compile forces it)"
        elif quick:
            s.compile = False
            s.compile_reason = "skipped with --quick (--compile forces it)"
        return s

    def record(self) -> dict:
        return asdict(self)
