"""`kvboost bench prefix`: TTFT of full prefill, KVBoost, and the floor, side by side in one run.

The floor is what no cache can beat: prefill of exactly the tokens KVBoost did not reuse, over a
Hugging Face DynamicCache that already holds the rest (built before the clock starts). Each repeat asks a
different question, so no run is helped by the previous run's suffix; requests store nothing (what every prompt
shares, the text and the question's opening tokens, is stored once first). KVBoost is measured twice per repeat on
that repeat's prompt, reusing the same tokens: with the prefix resident in its workspace (a repeated system prompt,
the common case), then from the chunk store (the workspace forgotten first; on a CPU read in place, the copy into
the workspace after the first token: "done" is the whole one-token request). --host-tier adds the "host" row on
the same prompt: every stored chunk in the host tier (tier_rows.py). "X/kvb" is X over the resident row on the
same prompt, each over the floor of its own cached tokens, median over repeats: same-time, same-suffix ratios.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .console import bench_console
from .model_options import DeviceOption, DtypeOption, ModelChoice, ModelOption, ShapeOption, as_choice, model_choice

if TYPE_CHECKING:  # torch and transformers load on first use: `kvboost --help` stays fast
    import torch
    from transformers import DynamicCache


@dataclass
class PrefixRow:
    prefix_tokens: int
    prompt_tokens: int
    baseline_ms: float
    kvboost_ms: float  # prefix resident in the workspace
    kvboost_store_ms: float  # prefix from the chunk store
    floor_ms: float
    floor_store_ms: float
    keys_and_match_ms: float  # hashing every chunk + exact-chain lookup
    cached_tokens: int
    identical_first_token: bool
    store_over_resident: float = float("nan")  # median over repeats, same prompt: (store / its floor) / (kvb / its)
    tiers: dict = field(default_factory=dict)  # --host-tier: host ms, over floor, errors (tier_rows.py)
    # The whole one-token request from the store: on a CPU a prefix read in place is copied into the workspace after
    # the first token is out, so this is TTFT plus that copy.
    kvboost_store_done_ms: float = float("nan")
    # Median over repeats of store / kvb TTFT on the same prompt, the same tokens reused: no floor in between.
    store_over_resident_direct: float = float("nan")

    @property
    def ratio(self) -> float:
        return self.kvboost_ms / self.floor_ms

    @property
    def ratio_store(self) -> float:
        return self.kvboost_store_ms / self.floor_store_ms


def prefix_text(tokenizer, n_tokens: int) -> str:
    """About n_tokens of workload text (the RAG documents, repeated as needed), cut at a token boundary."""
    from .workloads import load_rag

    docs, _ = load_rag()
    pieces = [doc["title"] + "\n" + doc["text"] + "\n\n" for doc in docs.values()]
    sizes = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces]
    if not any(sizes):
        raise RuntimeError("the RAG workload has no text")
    # Tokenize the whole text once (pieces counted alone add up to about the same), with a 5% margin.
    text, total, i = "", 0, 0
    while total < n_tokens * 1.05 + 16:
        text += pieces[i % len(pieces)]
        total += sizes[i % len(pieces)]
        i += 1
    ids = tokenizer(text)["input_ids"]
    if len(ids) < n_tokens:
        raise RuntimeError("not enough workload text")
    return tokenizer.decode(ids[:n_tokens])


def bench_questions() -> list[str]:
    """The system-prompt workload's questions: a different suffix for every measurement."""
    from .workloads import load_system_prompt

    _, qs = load_system_prompt()
    return [q["question"] if isinstance(q, dict) else str(q) for q in qs]


class SuffixFloor:
    """A DynamicCache holding ids[:split], cloned fresh for each timed suffix prefill: what no cache can beat (on
    CUDA the same suffix runs once untimed first, so the floor holds no attention-plan build)."""

    def __init__(self, model):

        self.model = model
        self.ids: list[int] = []
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _prepare(self, ids: list[int], split: int) -> None:
        from kvboost.model.cache_arg import cache_kwargs

        reuse = 0
        while reuse < min(len(self.ids), split) and self.ids[reuse] == ids[reuse]:
            reuse += 1
        if reuse < len(self.ids):  # rebuild from scratch: the cached prefix does not extend to this split
            self.ids, self.layers = [], []
        cache = self._fresh()
        if split > len(self.ids):
            self.model(input_ids=self._tensor(ids[len(self.ids):split]), **cache_kwargs(cache), use_cache=True,
                       logits_to_keep=1)
            self.layers = [(layer.keys, layer.values) for layer in cache.layers]
            self.ids = list(ids[:split])

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        import torch

        return torch.tensor([ids], device=self.model.device)  # built where the model lives

    def _fresh(self) -> DynamicCache:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(self.layers):
            cache.update(k.clone(), v.clone(), i)
        return cache

    def ttft_ms(self, ids: list[int], split: int) -> tuple[float, int]:
        import torch

        from kvboost.model.cache_arg import cache_kwargs

        self._prepare(ids, split)
        suffix = self._tensor(ids[split:])
        cuda = bool(self.layers) and self.layers[0][0].is_cuda
        if cuda:  # cuDNN builds an attention plan per new (q_len, kv_len): ~50-90 ms per layer on its first call.
            # The floor is the suffix's compute, not that one-off cost, so the same shape runs once untimed first.
            self.model(input_ids=suffix, **cache_kwargs(self._fresh()), use_cache=True, logits_to_keep=1)
        cache = self._fresh()
        if cuda:
            torch.cuda.synchronize()  # the clone above must not be billed to the timed prefill
        t0 = time.perf_counter()
        logits = self.model(input_ids=suffix, **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())  # .item() waits for the device: the clock sees the whole prefill
        return (time.perf_counter() - t0) * 1e3, token


def fitting_lengths(lengths: list[int], max_context: int | None, room: int = 64) -> list[int]:
    """The prefix lengths that leave `room` positions of the model's context for the question and answer."""
    return [n for n in lengths if max_context is None or n + room <= max_context]


def run_prefix_bench(model: str | ModelChoice | None, lengths: list[int], repeats: int, json_path: str | None,
                     plot_path: str | None, host_tier: bool = False) -> list[PrefixRow]:
    import torch

    from kvboost.reuse.match import common_prefix_length, match_exact

    from .model_options import load_engine
    from .plots import plot_lines, write_json

    choice = as_choice(model)
    console = bench_console()
    with console.status("loading model"):
        # Requests store nothing (the prefix is stored by warm()): every row of a repeat runs the same prompt with
        # the same reuse, so their ratios compare like with like.
        engine = load_engine(choice, write_back=False)
    tok, model = engine.tokenizer, engine.model
    fitting = fitting_lengths(lengths, engine.max_context)
    if len(fitting) < len(lengths):
        console.print(f"skipping prefix lengths {sorted(set(lengths) - set(fitting))}: the model's context is "
                      f"{engine.max_context} tokens")
    lengths = fitting
    from .tier_rows import TIER_ROWS, TierRows, tier_engines

    tiers_built, tier_errors = {}, {}
    if host_tier:
        tiers_built, tier_errors = tier_engines(engine, max(lengths, default=0) + 256)
        for name, why in tier_errors.items():
            console.print(f"[red]tier row {name!r} not measured: {why}")
    questions = bench_questions()
    rows: list[PrefixRow] = []
    with Progress(console=console, transient=True) as progress, torch.inference_mode():
        task = progress.add_task("prefix bench", total=len(lengths) * repeats)
        for n in lengths:
            prefix = prefix_text(tok, n)
            engine.clear_cache()
            floor = SuffixFloor(model)
            samples: dict[str, list[float]] = {k: [] for k in ("base", "ws", "store", "floor", "floor_store", "keys",
                                                               "store_over_ws", "store_done", "store_by_ws")}
            cached, agree = 0, True
            qi = 0

            def prompt_for(prefix: str = prefix) -> str:  # bound now: one prefix per length
                nonlocal qi
                qi += 1
                return f"{prefix}\n\nQuestion: {questions[qi % len(questions)]} (case {qi})\nAnswer:"

            # The store holds what every prompt shares (the text and the question's opening tokens): from the store and
            # resident reuse the same tokens, so the two rows run the same suffix.
            probe = [engine.encode(prompt_for()) for _ in range(2)]
            engine.warm_ids(probe[0][:common_prefix_length(*probe)])
            engine.generate(prompt_for(), 1)  # warm-up: first-call allocations, thread pools
            tier_rows = TierRows(tiers_built, prefix, engine.encode(prompt_for()))
            # Every system starts from token ids: the floor is handed ids, so KVBoost is too (tokenizing a 7k
            # prompt costs tens of ms, the same for any system given text, and is no part of what is compared).
            for r in range(repeats):
                # One prompt per repeat for every row: resident (the workspace holds the previous prompt, whose
                # prefix this one shares), then from the store, then the tier rows; each over its floor.
                ids = engine.encode(prompt_for())
                t0 = time.perf_counter()
                engine.chunker.split(ids)
                match_exact(engine.store, engine.chunker.split(ids))
                samples["keys"].append((time.perf_counter() - t0) * 1e3 / 2)
                fast = engine.generate(input_ids=ids, max_new_tokens=1, return_logits=True)
                ms, floor_token = floor.ttft_ms(ids, fast.cached_tokens)
                samples["ws"].append(fast.ttft_ms)
                samples["floor"].append(ms)
                resident_over_floor = fast.ttft_ms / ms
                cached = fast.cached_tokens
                agree &= int(fast.first_token_logits.argmax()) == floor_token  # EOS is a valid first token
                engine.forget_workspace()
                store = engine.generate(input_ids=ids, max_new_tokens=1)
                ms, _ = floor.ttft_ms(ids, store.cached_tokens)
                samples["store"].append(store.ttft_ms)
                samples["store_done"].append(store.total_ms)
                samples["floor_store"].append(ms)
                # Over resident: each over the floor of its own run, and directly (both reuse the same tokens).
                samples["store_over_ws"].append(store.ttft_ms / ms / resident_over_floor)
                samples["store_by_ws"].append(store.ttft_ms / fast.ttft_ms)
                tier_rows.time(ids, floor, resident_over_floor)  # interleaved: drift cancels in the ratios
                if r < max(1, min(3, repeats)):  # full prefill is slow at 7k; three samples suffice
                    samples["base"].append(engine.generate(input_ids=engine.encode(prompt_for()), max_new_tokens=1,
                                                           mode="baseline").ttft_ms)
                progress.advance(task)
            med = {k: statistics.median(v) for k, v in samples.items()}
            row = PrefixRow(n, len(ids), med["base"], med["ws"], med["store"], med["floor"], med["floor_store"],
                            med["keys"], cached, agree, med["store_over_ws"],
                            kvboost_store_done_ms=med["store_done"], store_over_resident_direct=med["store_by_ws"])
            tier_rows.into(row.tiers)
            rows.append(row)
    _print(console, rows)
    if json_path:
        write_json(json_path, {"benchmark": "prefix", **choice.record(engine),
                               "threads": torch.get_num_threads(), "repeats": repeats, "tier_errors": tier_errors,
                               "rows": [asdict(r) | {"ratio": r.ratio, "ratio_store": r.ratio_store} for r in rows]})
        console.print(f"wrote {json_path}")
    if plot_path:
        series = {
            "baseline (full prefill)": [(r.prefix_tokens, r.baseline_ms) for r in rows],
            "KVBoost (workspace)": [(r.prefix_tokens, r.kvboost_ms) for r in rows],
            "KVBoost (from store)": [(r.prefix_tokens, r.kvboost_store_ms) for r in rows],
            "floor (suffix over HF cache)": [(r.prefix_tokens, r.floor_ms) for r in rows],
        }
        for name in TIER_ROWS:
            if any(f"{name}_ms" in r.tiers for r in rows):
                series[f"KVBoost ({name} tier)"] = [(r.prefix_tokens, r.tiers[f"{name}_ms"]) for r in rows
                                                     if f"{name}_ms" in r.tiers]
        plot_lines(series, "TTFT vs cached prefix length", "cached prefix tokens", "TTFT (ms)", plot_path)
        console.print(f"wrote {plot_path}")
    return rows


def _print(console: Console, rows: list[PrefixRow]) -> None:
    from .tier_rows import TIER_ROWS

    table = Table(title="Prefix reuse: TTFT, median ms", caption=(
        "full = no cache; kvb = KVBoost, prefix resident in its workspace; store = KVBoost, prefix from the "
        "chunk store; done = the whole one-token request from the store (on a CPU a prefix read in place is "
        "copied into the workspace after the first token); floor = prefill of the same uncached tokens over a "
        "DynamicCache already holding the rest; host = every stored chunk placed from the host tier; X/kvb = X "
        "over kvb on the same prompt, each over the floor of its own cached tokens (median over repeats); lookup = "
        "hashing + chain match; store/kvb ms = store's TTFT over kvb's on the same prompt; "
        "same = first token equals the floor's"))
    tier_names = [name for name in TIER_ROWS if any(name + "_ms" in r.tiers or name + "_error" in r.tiers
                                                 for r in rows)]
    for col in ("prefix", "full", "kvb", "floor", "kvb/floor", "store", "done", "floor", "store/floor", "store/kvb",
                "store/kvb ms",
                *(f"{name}/kvb" for name in tier_names), "speedup", "lookup", "same"):
        table.add_column(col, justify="right")
    for r in rows:
        extra = [f"{r.tiers[name + '_over_resident']:.2f}" if name + "_over_resident" in r.tiers else "error"
                 for name in tier_names]
        table.add_row(str(r.prefix_tokens), f"{r.baseline_ms:.0f}", f"{r.kvboost_ms:.1f}", f"{r.floor_ms:.1f}",
                      f"{r.ratio:.2f}", f"{r.kvboost_store_ms:.1f}", f"{r.kvboost_store_done_ms:.1f}",
                      f"{r.floor_store_ms:.1f}", f"{r.ratio_store:.2f}", f"{r.store_over_resident:.2f}",
                      f"{r.store_over_resident_direct:.2f}", *extra, f"{r.baseline_ms / r.kvboost_ms:.1f}x",
                      f"{r.keys_and_match_ms:.2f}", "yes" if r.identical_first_token else "NO")
    console.print(table)


def bench_prefix_command(
    model: ModelOption = None, shape: ShapeOption = None, device: DeviceOption = None, dtype: DtypeOption = None,
    lengths: str = typer.Option("1000,2000,4000,7000", help="Cached prefix lengths in tokens."),
    repeats: int = typer.Option(5, min=1, help="Timed repeats per length (median reported)."),
    json_path: str | None = typer.Option(None, "--json", help="Write results as JSON."),
    plot_path: str | None = typer.Option(None, "--plot", help="Write a PNG plot."),
    host_tier: bool = typer.Option(False, "--host-tier", help="Also the host tier: every stored chunk placed from "
                               "host memory (device_kv_budget_bytes=0)."),
) -> None:
    """TTFT of baseline, KVBoost and the floor (suffix prefill over a cache in place), side by side."""
    choice = model_choice(model, shape, device, dtype)
    try:
        sizes = [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{lengths!r}: expected comma-separated token counts",
                                 param_hint="--lengths") from None
    run_prefix_bench(choice, sizes, repeats, json_path, plot_path, host_tier)
