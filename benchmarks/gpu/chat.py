"""Section a of `kvboost bench gpu`: chat-turn TTFT, turn by turn, for three systems on one model.

  plain    full prefill of the whole history every turn (transformers, no cache)
  manual   keep the previous turn's DynamicCache, crop it to what the new prompt shares, prefill the rest
  kvboost  engine.generate(messages=...)
Every system sees the same history (the plain system's reply is appended), as in `kvboost bench multiturn`.
Each chat turn is a shape (query length, key length) no earlier turn had, which is where per-shape costs
(cuDNN attention plans, compilation) show up; the spike is the slowest turn over the median turn. The
systems take turns going first, so none is always the one that meets a new shape (or library warm-up) first.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from ..multiturn import ManualPrefixCache, greedy_over_cache
from .settings import GpuBenchSettings
from .timing import Budget, median, percentile

SYSTEMS = ("plain", "manual", "kvboost")


@dataclass
class ChatSample:
    conversation: int
    turn: int
    prompt_tokens: int
    plain_ms: float
    manual_ms: float
    kvboost_ms: float
    kvboost_cached: int


def chat_workload(tokenizer, conversations: int, turns: int, system_tokens: int,
                  user_tokens: int) -> tuple[str, list[list[str]]]:
    """(system prompt of ~system_tokens, per conversation `turns` user messages of ~user_tokens each), cut from
    the shipped support manual and chat turns, so every run of every shape sees the same text."""
    from ..workloads import load_conversations, load_system_prompt

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    manual, _ = load_system_prompt()
    system_ids = ids(manual)
    while len(system_ids) < system_tokens:
        system_ids += system_ids
    system = tokenizer.decode(system_ids[:system_tokens])
    texts = [t for conv in load_conversations() for t in conv["turns"]]
    users: list[list[str]] = []
    cursor = 0
    for _ in range(conversations):
        msgs = []
        for _ in range(turns):
            pieces: list[int] = []
            while len(pieces) < user_tokens:  # consecutive chat turns joined, cut to the length wanted
                pieces += ids(texts[cursor % len(texts)] + " ")
                cursor += 1
            msgs.append(tokenizer.decode(pieces[:user_tokens]).strip())
        users.append(msgs)
    return system, users


def run_chat(engine, settings: GpuBenchSettings, budget: Budget, on_sample: Callable[[dict], None]) -> dict:
    """Replay the chats; on_sample(section) after every turn (the live table). Returns the section."""
    model, tok = engine.model, engine.tokenizer
    eos = engine.eos_token_ids
    system, users = chat_workload(tok, settings.conversations, settings.turns, settings.system_tokens,
                                  settings.user_tokens)
    section: dict = {"status": "running", "samples": []}
    samples: list[ChatSample] = []
    n = settings.reply_tokens
    with torch.inference_mode():
        for c, turns in enumerate(users):
            manual = ManualPrefixCache(model)
            messages = [{"role": "system", "content": system}]
            for t, user in enumerate(turns):
                if budget.expired():
                    section["status"] = "truncated"
                    section["reason"] = f"time budget ({budget.seconds:.0f} s) spent"
                    return _finish(section, samples)
                messages.append({"role": "user", "content": user})
                ids = engine.encode(messages=messages)
                ms: dict[str, float] = {}
                reference: list[int] = []
                cached = 0
                order = SYSTEMS[t % 3:] + SYSTEMS[:t % 3]
                for system_name in order:
                    if system_name == "plain":
                        ms["plain"], reference = greedy_over_cache(model, ids, DynamicCache(config=model.config),
                                                                   0, n, eos)
                    elif system_name == "manual":
                        ms["manual"], _ = manual.run(ids, n, eos)
                    else:
                        r = engine.generate(messages=messages, max_new_tokens=n)
                        ms["kvboost"], cached = r.ttft_ms, r.cached_tokens
                samples.append(ChatSample(c + 1, t + 1, len(ids), ms["plain"], ms["manual"], ms["kvboost"], cached))
                messages.append({"role": "assistant", "content": tok.decode(reference, skip_special_tokens=True)})
                on_sample(_finish(dict(section), samples))
    section["status"] = "ok"
    return _finish(section, samples)


def _finish(section: dict, samples: list[ChatSample]) -> dict:
    section["samples"] = [asdict(s) for s in samples]
    section["per_turn"] = summarize(samples)
    section["spike"] = spikes(samples)
    later = [s for s in samples if s.turn >= 2]
    section["from_turn2"] = {f"{name}_{stat}": percentile([getattr(s, f"{name}_ms") for s in later], q)
                             for name in SYSTEMS for stat, q in (("p50_ms", 0.5), ("p99_ms", 0.99))}
    return section


def summarize(samples: list[ChatSample]) -> list[dict]:
    """Per turn: TTFT p50 and p99 of each system over the conversations, mean prompt and cached tokens."""
    rows = []
    for turn in sorted({s.turn for s in samples}):
        ss = [s for s in samples if s.turn == turn]
        row: dict = {"turn": turn, "n": len(ss), "prompt_tokens": sum(s.prompt_tokens for s in ss) / len(ss),
                     "kvboost_cached": sum(s.kvboost_cached for s in ss) / len(ss)}
        for name in SYSTEMS:
            values = [getattr(s, f"{name}_ms") for s in ss]
            row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = percentile(values, 0.5), percentile(values, 0.99)
        rows.append(row)
    return rows


def spikes(samples: list[ChatSample]) -> dict:
    """The first-seen-shape spike per system: its slowest turn over its median turn (turn 1 included)."""
    out = {}
    for name in SYSTEMS:
        values = [getattr(s, f"{name}_ms") for s in samples]
        med = median(values)
        out[name] = {"max_ms": max(values) if values else float("nan"), "median_ms": med,
                     "max_over_median": max(values) / med if values and med > 0 else float("nan")}
    return out
