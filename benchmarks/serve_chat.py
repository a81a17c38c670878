"""`kvboost bench serve-chat`: one streamed chat through `kvboost serve` against `generate_stream()`, in one run.

The server runs as its own process (`kvboost serve`, the command users run); the library runs in this one, on
the same model with the same options and thread count. The chat has the support manual (~1,100 tokens) as its
system prompt and its questions as user turns; each side appends its own greedy replies. Turns alternate: the
library's turn k, then the server's turn k, so both see the same machine load. Per turn: TTFT (request sent to
the first text) and decode tok/s (tokens after the first over the time after the first). Targets: the server
decodes at >= 0.95x the library's rate over the whole chat, and no server turn after the first has a TTFT above
2x the median of those turns.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Annotated

import typer

from .console import bench_console
from .model_options import ModelOption

TARGET_DECODE_RATIO = 0.95
TARGET_MAX_SPIKE = 2.0
READY_TIMEOUT_S = 600.0


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    ttft_ms: float
    decode_tokens: int  # tokens after the first
    decode_s: float  # time after the first token
    text: str

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str | None, port: int, threads: int, options: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "kvboost.cli", "serve", "--port", str(port), "--log-level", "warning", *options]
    if model:
        cmd += ["--model", model]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_ready(proc: subprocess.Popen, url: str) -> str:
    """The served model's id once /v1/models answers; raises if the server exits or times out."""
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvboost serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            return httpx.get(url + "/v1/models", timeout=2).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            time.sleep(0.5)
    raise RuntimeError(f"kvboost serve was not ready after {READY_TIMEOUT_S:.0f} s")


def _library_turn(engine, messages: list[dict], max_tokens: int, turn: int) -> Turn:
    t0 = time.perf_counter()
    first = None
    stream = engine.generate_stream(messages, max_tokens)
    for delta in stream:
        if first is None and delta:
            first = time.perf_counter()
    end = time.perf_counter()
    result = stream.result
    first = end if first is None else first
    return Turn(turn, result.prompt_tokens, (first - t0) * 1e3, max(result.generated_tokens - 1, 0), end - first,
                result.output_text)


def _server_turn(client, model_id: str, messages: list[dict], max_tokens: int, turn: int) -> Turn:
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    usage = None
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    first = end if first is None else first
    tokens = usage.completion_tokens if usage is not None else 0
    return Turn(turn, usage.prompt_tokens if usage is not None else 0, (first - t0) * 1e3, max(tokens - 1, 0),
                end - first, "".join(parts))


def run_serve_chat_bench(model: str | None = None, turns: int = 6, max_tokens: int = 32, threads: int = 2,
                         fast_path: str | None = None, progress=print) -> dict:
    import openai
    import torch

    from kvboost import KVBoost

    from .workloads import load_system_prompt

    torch.set_num_threads(threads)
    system, items = load_system_prompt()
    questions = [q["question"] for q in items][:turns]
    options = {"fast_path": fast_path} if fast_path else {}
    port = _free_port()
    proc = _start_server(model, port, threads, ["--fast-path", fast_path] if fast_path else [])
    try:
        progress("loading the library's engine")
        engine = KVBoost.from_pretrained(model, **options) if model else KVBoost.from_pretrained(**options)
        engine.generate("Hello!", 4)  # untimed, as the server's own warm-up request
        url = f"http://127.0.0.1:{port}"
        progress(f"waiting for kvboost serve on {url}")
        model_id = _wait_ready(proc, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=900)
        chats = {"library": [{"role": "system", "content": system}], "server": [{"role": "system", "content": system}]}
        rows: dict[str, list[Turn]] = {"library": [], "server": []}
        for k, question in enumerate(questions, 1):
            for side in ("library", "server"):
                chats[side].append({"role": "user", "content": question})
                t = (_library_turn(engine, chats[side], max_tokens, k) if side == "library"
                     else _server_turn(client, model_id, chats[side], max_tokens, k))
                chats[side].append({"role": "assistant", "content": t.text})
                rows[side].append(t)
                progress(f"turn {k} {side:>7}: TTFT {t.ttft_ms:7.1f} ms, decode {t.decode_tok_s:5.1f} tok/s")
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    rates = {side: chat_decode_rate(ts) for side, ts in rows.items()}
    later = sorted(t.ttft_ms for t in rows["server"][1:])
    median = later[len(later) // 2] if later else float("nan")
    spike = max(later) / median if later else float("nan")
    ratio = rates["server"] / rates["library"]
    return {
        "benchmark": "serve_chat", "model": model or "embedded SmolLM2-135M", "threads": threads,
        "fast_path": fast_path or "auto", "turns": turns, "max_tokens": max_tokens,
        "rows": {side: [{**asdict(t), "decode_tok_s": t.decode_tok_s} for t in ts] for side, ts in rows.items()},
        "decode_tok_s": rates, "server_over_library": ratio, "server_ttft_spike": spike,
        "same_text": [a.text == b.text for a, b in zip(rows["library"], rows["server"])],
        "targets": {"server_over_library": TARGET_DECODE_RATIO, "server_ttft_spike": TARGET_MAX_SPIKE},
        "meets_targets": bool(ratio >= TARGET_DECODE_RATIO and spike <= TARGET_MAX_SPIKE),
    }


def chat_decode_rate(turns: list[Turn]) -> float:
    """Decode tokens over decode time, the whole chat (nan when no reply ran past its first token)."""
    seconds = sum(t.decode_s for t in turns)
    return sum(t.decode_tokens for t in turns) / seconds if seconds > 0 else float("nan")


def print_report(report: dict) -> None:
    from rich.table import Table

    table = Table(title="one streamed chat: kvboost serve vs generate_stream()")
    for col in ("turn", "prompt tok", "library TTFT ms", "server TTFT ms", "library tok/s", "server tok/s", "same"):
        table.add_column(col, justify="right")
    for lib, srv, same in zip(report["rows"]["library"], report["rows"]["server"], report["same_text"]):
        table.add_row(str(lib["turn"]), str(srv["prompt_tokens"]), f"{lib['ttft_ms']:.1f}", f"{srv['ttft_ms']:.1f}",
                      f"{lib['decode_tok_s']:.1f}", f"{srv['decode_tok_s']:.1f}", "yes" if same else "no")
    console = bench_console()
    console.print(table)
    rates = report["decode_tok_s"]
    console.print(f"decode over the chat: server {rates['server']:.1f} tok/s, library {rates['library']:.1f} "
                  f"({report['server_over_library']:.2f}x, target >= {TARGET_DECODE_RATIO}); slowest server TTFT "
                  f"after turn 1 over their median {report['server_ttft_spike']:.2f}x (target <= "
                  f"{TARGET_MAX_SPIKE})")


def bench_serve_chat_command(
    model: ModelOption = None,
    turns: Annotated[int, typer.Option(min=2, help="User turns of the chat.")] = 6,
    max_tokens: Annotated[int, typer.Option(min=2, help="Greedy tokens per reply (at most).")] = 32,
    threads: Annotated[int, typer.Option(min=1, help="Torch threads, for the server and the library alike.")] = 2,
    fast_path: Annotated[str | None, typer.Option(help="fast_path for both (default: the engine's auto).")] = None,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the results as JSON.")] = None,
) -> None:
    """One streamed chat through `kvboost serve` against generate_stream() on the same model, turn by turn."""
    report = run_serve_chat_bench(model, turns, max_tokens, threads, fast_path,
                                  progress=lambda m: typer.echo(m, err=True))
    print_report(report)
    if json_path:
        from .plots import write_json

        write_json(json_path, report)
        typer.echo(f"wrote {json_path}", err=True)
