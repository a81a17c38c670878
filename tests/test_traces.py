"""Random request traces under memory pressure, against plain generation.

Each trace mixes what users do - documents with questions, multi-turn follow-ups that quote earlier outputs,
warm(), prefix-cache mode, speculative requests, streams, batches, stop strings, regex-constrained output,
logprobs, repetition penalty, restarts over the same disk directory - on an engine whose memory tier holds only a
few chunks (evictions on nearly every request), optionally with a disk tier behind it or long prompts run from host
memory. Every greedy output must equal plain generation's (no cache at all), and after every operation no row is
left in the engine's loop and every tier is within its budget.
"""
from __future__ import annotations

import importlib.util
import random

import pytest

from kvboost import KVBoost
from kvboost.kv.long_context import bytes_per_position

from .prompts import text_with_tokens, words
from .tiny_models import make_tiny_model

CHUNK = 16
OPERATIONS = 32
REGEXES = ("[a-z ]{1,12}", "(yes|no|maybe)", "[0-9]+") if importlib.util.find_spec("xgrammar") else ()
# options forwarded to plain generation as they are (stop, max_new_tokens: Trace.want's own arguments)
OUTPUT_OPTIONS = ("regex", "logprobs", "repetition_penalty")


SETUPS = ("memory", "disk", "streamed")


def make_engine(model, tokenizer, setup: str, tmp_path) -> KVBoost:
    """Budgets of a few chunks: memory holds 4 (with disk behind it: 3), long prompts run from host memory."""
    probe = KVBoost(model, tokenizer, chunk_size=CHUNK)
    chunk = CHUNK * bytes_per_position(probe.workspace_shapes, probe.kv_dtype)
    kw: dict = {"chunk_size": CHUNK, "memory_budget_bytes": 4 * chunk}
    if setup == "disk":
        kw.update(memory_budget_bytes=3 * chunk, disk_cache_dir=str(tmp_path / "disk"))
    elif setup == "streamed":
        kw.update(device_kv_max_tokens=4 * CHUNK)
    return KVBoost(model, tokenizer, **kw)


class Trace:
    """Random operations over a few documents; remembers what plain generation answers."""

    def __init__(self, tokenizer, plain: KVBoost, seed: int):
        self.rng = random.Random(seed)
        self.plain = plain
        self.docs = [text_with_tokens(tokenizer, self.rng.choice((2, 3, 5, 7)) * CHUNK + self.rng.randrange(CHUNK),
                                      seed=100 * seed + i) for i in range(3)]
        self.turns: list[str] = []  # prompts + outputs of earlier requests, for follow-ups
        self._answers: dict[tuple, tuple[list[int], str]] = {}

    def prompt(self) -> str:
        r = self.rng.random()
        if self.turns and r < 0.3:  # a follow-up: an earlier prompt, its answer and a new question
            return self.rng.choice(self.turns) + " " + words(self.rng.randrange(2, 9), seed=self.rng.randrange(10**6))
        if r < 0.4:  # a document alone (its partial last chunk matched token by token next time)
            return self.rng.choice(self.docs)
        if r < 0.45:
            return words(self.rng.randrange(3, 30), seed=self.rng.randrange(10**6))  # unrelated
        return self.rng.choice(self.docs) + " " + words(self.rng.randrange(2, 9), seed=self.rng.randrange(10**6))

    def want(self, prompt: str, opts: dict) -> tuple[list[int], str]:
        """Plain generation's (output tokens, output text: cut before a stop string) for these options."""
        same = {k: v for k, v in opts.items() if k in OUTPUT_OPTIONS}
        key = (prompt, opts["max_new_tokens"], tuple(opts.get("stop") or ()), tuple(sorted(same.items())))
        if key not in self._answers:
            r = self.plain.generate(prompt, max_new_tokens=opts["max_new_tokens"], mode="baseline",
                                    stop=opts.get("stop"), **same)
            self._answers[key] = (r.output_token_ids, r.output_text)
        return self._answers[key]

    def options(self) -> dict:
        opts: dict = {"max_new_tokens": self.rng.randrange(1, 9)}
        if self.rng.random() < 0.3:
            opts["speculative"] = "prompt_lookup"
        if self.rng.random() < 0.15:
            opts["stop"] = [self.rng.choice(("the", "a", "of", "and", "to"))]
        if self.rng.random() < 0.1:
            opts["mode"] = "prefix_cache"
        r = self.rng.random()
        if r < 0.15 and REGEXES:
            opts["regex"] = self.rng.choice(REGEXES)
        elif r < 0.25:
            opts["logprobs"] = 2
        if self.rng.random() < 0.1:
            opts["repetition_penalty"] = 1.3
        return opts


def check_holds(engine: KVBoost, where: str) -> None:
    assert not engine.scheduler.has_work(), f"{where}: a finished request is still in the loop"
    for name, tier in engine.cache_stats()["tiers"].items():
        budget = tier.get("budget_bytes")
        if budget:
            assert tier["bytes"] <= budget, f"{where}: the {name} tier holds more than its budget"


def _step(engine: KVBoost, trace: Trace, op: int, restart) -> KVBoost:
    """One random operation; returns the engine (a new one after a restart: what was on disk is still there)."""
    rng = trace.rng
    kind = rng.choices(("generate", "stream", "batch", "warm", "forget", "restart"), weights=(10, 3, 3, 1, 1, 1))[0]
    where = f"operation {op} ({kind})"
    if kind == "restart":
        engine.close()
        engine = restart()
    elif kind == "warm":
        engine.warm(rng.choice(trace.docs))
    elif kind == "forget":
        engine.forget_workspace()
    elif kind == "batch":
        prompts = [trace.prompt() for _ in range(rng.randrange(2, 4))]
        opts = trace.options()
        method = rng.choice((engine.generate_batch, engine.generate_many))
        for prompt, got in zip(prompts, method(prompts, **opts)):
            assert (got.output_token_ids, got.output_text) == trace.want(prompt, opts), where
    else:
        prompt, opts = trace.prompt(), trace.options()
        want = trace.want(prompt, opts)
        if kind == "stream":
            stream = engine.generate_stream(prompt, **opts)
            assert "".join(stream) == want[1], where
            got = stream.result
        else:
            got = engine.generate(prompt, **opts)
        assert (got.output_token_ids, got.output_text) == want, where
        trace.turns.append(prompt + got.output_text)
    check_holds(engine, where)
    return engine


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("seed", [1, 2])
def test_random_traces_under_memory_pressure_match_plain_generation(tokenizer, tmp_path, setup, seed):
    model = make_tiny_model("llama", tokenizer)
    plain = KVBoost(model, tokenizer, chunk_size=CHUNK)
    trace = Trace(tokenizer, plain, seed)
    engines = [make_engine(model, tokenizer, setup, tmp_path)]

    def restart() -> KVBoost:
        engines.append(make_engine(model, tokenizer, setup, tmp_path))
        return engines[-1]

    engine = engines[0]
    for op in range(OPERATIONS):
        engine = _step(engine, trace, op, restart)
    stats = [e.cache_stats() for e in engines]
    assert sum(s["cached_tokens"] for s in stats) > 0
    assert sum(s["tiers"]["memory"]["evictions"] for s in stats) > 0
    if setup == "disk":
        assert sum(s["tiers"]["disk"]["hits"] for s in stats) > 0
    if setup == "streamed":
        assert sum(s["streamed"]["sequences"] for s in stats) > 0
