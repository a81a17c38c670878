"""`kvboost bench multiturn`: replay chats turn by turn, as a chat client does, for several systems at once.

Systems, all on the same model object, in the same run:
  plain    transformers with no cache: full prefill of the whole history every turn
  manual   the careful hand-written recipe: keep the previous turn's DynamicCache, crop it to the
           part the new prompt shares, prefill only the rest (the floor for that turn)
  kvboost  KVBoost.generate(messages=...)
  peer     optional: another package driven in a subprocess (--peer-python)
Every system sees the same history: each turn appends the plain system's reply (the reference).
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.live import Live
from rich.table import Table

from .console import bench_console
from .model_options import DeviceOption, DtypeOption, ModelChoice, ModelOption, ShapeOption, as_choice, model_choice

if TYPE_CHECKING:  # transformers loads on first use: `kvboost --help` stays fast
    from transformers import DynamicCache


@dataclass
class TurnSample:
    conversation: str
    turn: int
    prompt_tokens: int
    plain_ms: float
    manual_ms: float
    kvboost_ms: float
    kvboost_reuse: float
    reusable_tokens: int  # shared with the previous turn's prompt + reply: the most any prefix cache can reuse
    kvboost_cached: int
    kvboost_tokens_per_s: float
    identical: bool
    manual_identical: bool
    peak_rss_mb: float
    peer_ms: float | None = None
    peer_reuse: float | None = None
    peer_identical: bool | None = None


@dataclass
class TurnSummary:
    turn: int
    n: int
    prompt_tokens: float
    plain_p50: float
    manual_p50: float
    kvboost_p50: float
    kvboost_p90: float
    reuse: float
    reusable: float  # mean (tokens shared with the previous turn's prompt + reply) / prompt tokens
    of_reusable: float  # KVBoost's cached tokens among those / those
    identical_rate: float
    tokens_per_s: float
    peak_rss_mb: float
    peer_p50: float | None = None
    peer_reuse: float | None = None
    peer_identical_rate: float | None = None
    extra: dict = field(default_factory=dict)


def greedy_over_cache(model, ids: list[int], cache: DynamicCache, start: int, n: int,
                      eos: set[int]) -> tuple[float, list[int]]:
    """Prefill ids[start:] over `cache`, then decode greedily; returns (ttft_ms, tokens). Tensors are built on
    the model's device, and reading each token id waits for the device, so the clock sees the whole prefill."""
    from kvboost.model.cpu_linear import model_own_products

    with model_own_products(model):  # plain transformers as users run it, not the engine's CPU products
        return _greedy(model, ids, cache, start, n, eos)


def _greedy(model, ids: list[int], cache: DynamicCache, start: int, n: int, eos: set[int]) -> tuple[float, list[int]]:
    import torch

    from kvboost.model.cache_arg import cache_kwargs

    device = model.device
    t0 = time.perf_counter()
    logits = model(input_ids=torch.tensor([ids[start:]], device=device), **cache_kwargs(cache), use_cache=True,
                   logits_to_keep=1).logits
    token = int(logits[0, -1].argmax())
    ttft = (time.perf_counter() - t0) * 1e3
    out = []
    while token not in eos:
        out.append(token)
        if len(out) >= n:
            break
        logits = model(input_ids=torch.tensor([[token]], device=device), **cache_kwargs(cache),
                       use_cache=True).logits
        token = int(logits[0, -1].argmax())
    return ttft, out


class ManualPrefixCache:
    """The hand-written prefix-cache recipe a careful transformers user would write."""

    def __init__(self, model):
        self.model = model
        self.ids: list[int] = []
        self.cache: DynamicCache | None = None

    def shared_with(self, ids: list[int]) -> int:
        """Tokens of `ids` whose K/V the previous turn left behind (prompt + reply, as fed to the model)."""
        from kvboost.reuse.match import common_prefix_length

        return min(common_prefix_length(self.ids, ids), len(ids) - 1)

    def run(self, ids: list[int], n: int, eos: set[int]) -> tuple[float, list[int]]:
        shared = self.shared_with(ids)
        if self.cache is None or shared == 0:
            from transformers import DynamicCache

            cache, shared = DynamicCache(config=self.model.config), 0
        else:
            cache = self.cache
            extra = cache.get_seq_length() - shared
            if extra:
                cache.crop(-extra)  # drop what the new prompt does not share (e.g. a re-tokenized reply)
        ttft, out = greedy_over_cache(self.model, ids, cache, shared, n, eos)
        self.ids, self.cache = (ids + out)[: cache.get_seq_length()], cache
        return ttft, out


class _Peer:
    """Another package in its own interpreter; one JSON request per line on stdin, one answer per line."""

    def __init__(self, python: str, model_dir: str):
        driver = Path(__file__).with_name("peer_driver.py")
        self.proc = subprocess.Popen([python, str(driver), model_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        ready = self.proc.stdout.readline()
        if not ready.startswith("{"):
            raise RuntimeError(f"peer driver failed to start: {ready!r}")

    def run(self, prompt: str, n: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_new_tokens": n}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


WORKLOADS = ("chat", "support")


def _load_workload(name: str) -> list[dict]:
    from .workloads import load_conversations, load_support_conversations

    return load_conversations() if name == "chat" else load_support_conversations()


def run_multiturn_bench(model: str | ModelChoice | None, conversations: int, turns: int, new_tokens: int,
                        json_path: str | None, plot_path: str | None, peer_python: str | None = None,
                        workload: str = "chat") -> list[TurnSummary]:
    import torch
    from transformers import DynamicCache

    from .model_options import load_engine

    choice = as_choice(model)
    if peer_python and choice.shape:
        raise ValueError("--peer-python needs a checkpoint the other package can load; a --shape has none")
    model_name = choice.model
    console = bench_console()
    with console.status("loading model"):
        engine = load_engine(choice)
    model, tok = engine.model, engine.tokenizer
    eos = engine.eos_token_ids
    peer = None
    if peer_python:
        from kvboost.loading import embedded_model_dir, is_embedded
        peer = _Peer(peer_python, str(embedded_model_dir()) if is_embedded(model_name) else model_name)
    samples: list[TurnSample] = []
    convs = _load_workload(workload)[:conversations]
    with Live(console=console, refresh_per_second=2) as live, torch.inference_mode():
        for ci, conv in enumerate(convs):
            manual = ManualPrefixCache(model)
            messages = [{"role": "system", "content": conv["system"]}]
            for t, user in enumerate(conv["turns"][:turns]):
                messages.append({"role": "user", "content": user})
                ids = engine.encode(messages=messages)
                plain_ttft, reference = greedy_over_cache(model, ids, DynamicCache(config=model.config), 0,
                                                          new_tokens, eos)
                reusable = manual.shared_with(ids)
                manual_ttft, manual_out = manual.run(ids, new_tokens, eos)
                r = engine.generate(messages=messages, max_new_tokens=new_tokens)
                s = TurnSample(conv["id"], t + 1, len(ids), plain_ttft, manual_ttft, r.ttft_ms, r.kv_reuse_ratio,
                               reusable, r.cached_tokens, r.tokens_per_sec, r.output_token_ids == reference,
                               manual_out == reference, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
                if peer is not None:
                    prompt_text = tok.decode(ids)
                    p = peer.run(prompt_text, new_tokens)
                    s.peer_ms, s.peer_reuse = p["ttft_ms"], p["kv_reuse_ratio"]
                    reference_text = tok.decode(reference, skip_special_tokens=True)
                    s.peer_identical = p["output_text"].strip() == reference_text.strip()
                samples.append(s)
                messages.append({"role": "assistant", "content": tok.decode(reference, skip_special_tokens=True)})
                live.update(_table(summarize(samples), f"conversation {ci + 1}/{len(convs)}, turn {t + 1}"))
    if peer is not None:
        peer.close()
    summary = summarize(samples)
    overall = _overall(samples)
    console.print(_overall_line(overall))
    console.print("reuse = KVBoost cached / prompt tokens; history = tokens this prompt shares with the previous "
                  "turn's prompt + reply / prompt tokens (what the manual recipe reuses; the new user message is "
                  "never among them); of history = KVBoost cached tokens among those / those")
    if json_path:
        from .plots import write_json
        write_json(json_path, {"benchmark": "multiturn", **choice.record(engine), "workload": workload,
                               "conversations": len(convs), "turns": turns, "new_tokens": new_tokens,
                               "summary": overall, "reuse_rate": overall["kvboost_reuse_from_turn2"],
                               "prefill_tokens_per_s": overall["plain_prefill_tokens_per_s"],
                               "per_turn": [asdict(x) for x in summary], "samples": [asdict(x) for x in samples]})
        console.print(f"wrote {json_path}")
    if plot_path:
        from .plots import plot_lines
        series = {"plain transformers (no cache)": [(x.turn, x.plain_p50) for x in summary],
                  "manual prefix-cache recipe": [(x.turn, x.manual_p50) for x in summary],
                  "KVBoost": [(x.turn, x.kvboost_p50) for x in summary]}
        if peer is not None:
            series["peer"] = [(x.turn, x.peer_p50) for x in summary]
        plot_lines(series, "Multi-turn replay: TTFT p50 by turn", "turn", "TTFT p50 (ms)", plot_path)
        console.print(f"wrote {plot_path}")
    return summary


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(samples: list[TurnSample]) -> list[TurnSummary]:
    out = []
    for turn in sorted({s.turn for s in samples}):
        ss = [s for s in samples if s.turn == turn]
        peer = [s.peer_ms for s in ss if s.peer_ms is not None]
        out.append(TurnSummary(
            turn, len(ss), statistics.mean(s.prompt_tokens for s in ss), _p([s.plain_ms for s in ss], .5),
            _p([s.manual_ms for s in ss], .5), _p([s.kvboost_ms for s in ss], .5), _p([s.kvboost_ms for s in ss], .9),
            statistics.mean(s.kvboost_reuse for s in ss),
            statistics.mean(s.reusable_tokens / s.prompt_tokens for s in ss),
            _of_reusable(ss), sum(s.identical for s in ss) / len(ss),
            statistics.mean(s.kvboost_tokens_per_s for s in ss), max(s.peak_rss_mb for s in ss),
            _p(peer, .5) if peer else None,
            statistics.mean(s.peer_reuse for s in ss if s.peer_reuse is not None) if peer else None,
            sum(bool(s.peer_identical) for s in ss) / len(peer) if peer else None))
    return out


def _of_reusable(samples: list[TurnSample]) -> float:
    reusable = sum(s.reusable_tokens for s in samples)
    return sum(min(s.kvboost_cached, s.reusable_tokens) for s in samples) / reusable if reusable else float("nan")


def _overall(samples: list[TurnSample]) -> dict:
    later = [s for s in samples if s.turn >= 2]
    final: dict[str, TurnSample] = {}
    for s in samples:
        final[s.conversation] = s  # samples are in replay order: the last one seen is the final turn
    last = [s for s in final.values() if s.turn >= 2]
    plain_rate = sum(s.prompt_tokens for s in samples) / (sum(s.plain_ms for s in samples) / 1e3)
    return {
        "turns_measured": len(samples),
        "identical_rate": sum(s.identical for s in samples) / len(samples),
        "manual_identical_rate": sum(s.manual_identical for s in samples) / len(samples),
        "kvboost_reuse_from_turn2": statistics.mean(s.kvboost_reuse for s in later) if later else 0.0,
        "reusable_from_turn2": statistics.mean(s.reusable_tokens / s.prompt_tokens for s in later) if later else 0.0,
        "kvboost_of_reusable_from_turn2": _of_reusable(later) if later else float("nan"),
        "kvboost_over_manual_p50": _p([s.kvboost_ms / s.manual_ms for s in later], .5) if later else None,
        # Each conversation's final turn (4 to 8 turns in): the longest history, where flatness is tested.
        "last_turn_kvboost_over_manual_p50": _p([s.kvboost_ms / s.manual_ms for s in last], .5) if last else None,
        "last_turn_kvboost_p50_ms": _p([s.kvboost_ms for s in last], .5) if last else None,
        "last_turn_manual_p50_ms": _p([s.manual_ms for s in last], .5) if last else None,
        "last_turn_plain_p50_ms": _p([s.plain_ms for s in last], .5) if last else None,
        "peer_identical_rate": (sum(bool(s.peer_identical) for s in samples if s.peer_ms is not None)
                                / max(1, sum(s.peer_ms is not None for s in samples))) if any(
            s.peer_ms is not None for s in samples) else None,
        "turn2_kvboost_p50_ms": _p([s.kvboost_ms for s in samples if s.turn == 2], .5) if later else None,
        "plain_prefill_tokens_per_s": plain_rate,
    }


def _overall_line(o: dict) -> str:
    def f(key: str, fmt: str) -> str:
        return format(o[key], fmt) if o.get(key) is not None else "-"
    return (f"{o['turns_measured']} turns: identical to no-cache {f('identical_rate', '.1%')}; from turn 2 KVBoost "
            f"reuse {f('kvboost_reuse_from_turn2', '.1%')} of the prompt, {f('kvboost_of_reusable_from_turn2', '.1%')}"
            f" of the history; each conversation's last turn: KVBoost/manual TTFT p50 "
            f"{f('last_turn_kvboost_over_manual_p50', '.2f')} (KVBoost {f('last_turn_kvboost_p50_ms', '.0f')} ms, "
            f"manual {f('last_turn_manual_p50_ms', '.0f')} ms, plain {f('last_turn_plain_p50_ms', '.0f')} ms; "
            f"KVBoost at turn 2: {f('turn2_kvboost_p50_ms', '.0f')} ms)")


def _table(summary: list[TurnSummary], caption: str) -> Table:
    table = Table(title="Multi-turn replay (TTFT ms)", caption=caption)
    cols = ["turn", "n", "prompt tok", "plain p50", "manual p50", "KVBoost p50", "KVBoost p90", "KVB/manual",
            "reuse", "history", "of history", "identical", "tok/s", "peak RSS MB"]
    if any(s.peer_p50 is not None for s in summary):
        cols += ["peer p50", "peer reuse", "peer identical"]
    for c in cols:
        table.add_column(c, justify="right")
    for s in summary:
        row = [str(s.turn), str(s.n), f"{s.prompt_tokens:.0f}", f"{s.plain_p50:.0f}", f"{s.manual_p50:.0f}",
               f"{s.kvboost_p50:.0f}", f"{s.kvboost_p90:.0f}", f"{s.kvboost_p50 / s.manual_p50:.2f}",
               f"{s.reuse:.1%}", f"{s.reusable:.1%}", f"{s.of_reusable:.1%}", f"{s.identical_rate:.0%}",
               f"{s.tokens_per_s:.1f}", f"{s.peak_rss_mb:.0f}"]
        if len(cols) > 14:
            row += [f"{s.peer_p50:.0f}" if s.peer_p50 is not None else "-",
                    f"{s.peer_reuse:.1%}" if s.peer_reuse is not None else "-",
                    f"{s.peer_identical_rate:.0%}" if s.peer_identical_rate is not None else "-"]
        table.add_row(*row)
    return table


def bench_multiturn_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    conversations: int = typer.Option(8, min=1, help="Conversations to replay (of 64 shipped)."),
    turns: int = typer.Option(8, min=1, help="At most this many user turns per conversation."),
    new_tokens: int = typer.Option(128, min=1, help="Greedy tokens per reply (at most; EOS ends it)."),
    json_path: str | None = typer.Option(None, "--json", help="Write results as JSON."),
    plot_path: str | None = typer.Option(None, "--plot", help="Write a PNG plot."),
    peer_python: str | None = typer.Option(None, "--peer-python", help="Python of a virtualenv with another kvboost."),
    workload: str = typer.Option("chat", help="chat: the 64 shipped conversations (80-370-token system prompts); "
                                              "support: the ~1,000-token manual of the system-prompt workload, its "
                                              "questions as turns."),
) -> None:
    """Replay chats turn by turn: plain transformers, the manual prefix-cache recipe, KVBoost (and a peer)."""
    choice = model_choice(model, shape, device, dtype)
    if workload not in WORKLOADS:
        raise typer.BadParameter(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}",
                                 param_hint="--workload")
    if peer_python and shape:
        raise typer.BadParameter("the peer loads a checkpoint by path; random-weight shapes have none",
                                 param_hint="--peer-python")
    run_multiturn_bench(choice, conversations, turns, new_tokens, json_path, plot_path, peer_python, workload)
